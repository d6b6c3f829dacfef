"""One rank of bench/load_rss.py: host memory while the trainable UNet is loaded and handed to DeepSpeed.

    deepspeed --num_gpus N bench/load_rss_rank.py --mode {eager,whole,partitioned} --stage S --folder F --out DIR

Modes (how the UNet is loaded): `eager` from_pretrained(low_cpu_mem_usage=False), the way without accelerate (a
randomly initialised module, then the state dict copied in); `whole` dstune's load_trainable without a ZeRO-3
config (meta device + memory-mapped safetensors: one copy); `partitioned` load_trainable with the ZeRO-3 config
(deepspeed.zero.Init, one parameter gathered at a time). Then deepspeed.initialize with ZeRO `--stage` and SGD.
Resident set sizes come from /proc/self/status (VmRSS; VmHWM, the peak, reset through /proc/self/clear_refs before
each phase), minus the RSS before loading. Writes DIR/rank<R>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def trimmed_rss() -> int:
    """VmRSS after glibc hands freed heap memory back to the OS (malloc_trim): what is really still in use; freed
    chunks that glibc keeps for reuse otherwise still count as resident."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status_bytes("VmRSS")


def load(mode: str, folder: Path, ds_config: dict):
    from diffusers import UNet2DConditionModel

    from dstune.families.diffusion import load_trainable

    if mode == "eager":
        return UNet2DConditionModel.from_pretrained(folder, subfolder="unet", low_cpu_mem_usage=False)
    return load_trainable(folder, "unet", UNet2DConditionModel, ds_config if mode == "partitioned" else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("eager", "whole", "partitioned"), required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "zero_optimization": {"stage": args.stage},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    dist.barrier()
    before = status_bytes("VmRSS")
    reset_peak()
    unet = load(args.mode, args.folder, ds_config)
    dist.barrier()
    build_peak, after_build = status_bytes("VmHWM") - before, status_bytes("VmRSS") - before
    after_build_trimmed = trimmed_rss() - before
    params = [p for p in unet.parameters()]
    model_bytes = sum(int(getattr(p, "ds_numel", p.numel())) * 4 for p in params)
    reset_peak()
    engine, *_ = deepspeed.initialize(
        model=unet,
        model_parameters=params,
        config=ds_config,
        optimizer=torch.optim.SGD(params, lr=1e-3),
        dist_init_required=False,
    )
    dist.barrier()
    init_peak, after_init = status_bytes("VmHWM") - before, status_bytes("VmRSS") - before
    result = {
        "rank": rank,
        "world_size": world,
        "mode": args.mode,
        "stage": args.stage,
        "model_fp32_bytes": model_bytes,
        "build_peak_bytes": build_peak,
        "after_build_bytes": after_build,
        "after_build_trimmed_bytes": after_build_trimmed,
        "init_peak_bytes": init_peak,
        "after_init_bytes": after_init,
        "after_init_trimmed_bytes": trimmed_rss() - before,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
