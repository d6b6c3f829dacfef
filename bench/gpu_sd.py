"""GPU benchmark: an SD-1.5-sized UNet (860 M parameters, random weights) at 512 px, bf16, ZeRO 2, one GPU.
dstune's training path vs a plain diffusers-style accelerate + DeepSpeed loop (bench/gpu_sd_baseline.py).

Nothing is downloaded: the pipeline (UNet, VAE, CLIP text encoder at SD 1.5's sizes, from the config values
below; a small in-memory byte-level tokenizer) is built with random weights into .dstune-cache/bench/ once.
dstune trains from its latent + text-embedding cache of builtin:shapes rendered at 512 px (the cache is built by
the first run, outside the timed steps); the baseline holds random latents and embeddings of the same shapes in a
DataLoader. The UNet's work per step is the same for both: same shapes, same dtype, same DeepSpeed stage.

Reported per side: samples/s of the median step after warm-up (wall time between step ends) and
MFU = samples/s x training FLOPs per sample / peak bf16 FLOPs of the GPU. Training FLOPs per sample = 3 x the
UNet forward FLOPs counted by torch.utils.flop_counter at this resolution (backward ~ 2 x forward; attention
included).

    bash bench/gpu_sd.sh [--micro-batch 8] [--steps 30] [--warmup 5] [--repeats 2]
    python3 bench/gpu_sd.py --dry-run     (tiny sizes, 32 px, runs anywhere incl. CPU: checks the code path only)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_CACHE, TRAIN, launch, machine, median, print_json, print_table, say  # noqa: E402

import yaml  # noqa: E402

BASELINE = Path(__file__).resolve().parent / "gpu_sd_baseline.py"

# Stable Diffusion 1.5's component configs (runwayml/stable-diffusion-v1-5 unet/vae/text_encoder/scheduler).
SD15_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768,
    attention_head_dim=8,
    norm_num_groups=32,
    norm_eps=1e-5,
    act_fn="silu",
    downsample_padding=1,
    flip_sin_to_cos=True,
    freq_shift=0,
    mid_block_scale_factor=1,
    center_input_sample=False,
)
SD15_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    norm_num_groups=32,
    act_fn="silu",
    sample_size=512,
    scaling_factor=0.18215,
)
SD15_TEXT = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
    vocab_size=49408,
)
SD15_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    prediction_type="epsilon",
    steps_offset=1,
)
# --dry-run: the same code path at a size any machine runs in seconds.
DRY_UNET = dict(
    SD15_UNET,
    sample_size=16,
    layers_per_block=1,
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    norm_num_groups=8,
)
DRY_VAE = dict(
    SD15_VAE,
    block_out_channels=(8, 16),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    layers_per_block=1,
    norm_num_groups=8,
    sample_size=32,
)
DRY_TEXT = dict(
    SD15_TEXT,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    projection_dim=32,
    vocab_size=600,
)
# Dense bf16 peak TFLOPS by GPU name (vendor data sheets, without sparsity); first match wins.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("A10G", 70.0),
    ("RTX 4090", 165.2),
)


def build_pipeline(dry_run: bool) -> Path:
    """The SD-1.5-sized (or dry-run) pipeline folder with random weights; built once, reused after."""
    final = BENCH_CACHE / ("sd15-dry-run-v1" if dry_run else "sd15-random-v1")
    if (final / "model_index.json").is_file():
        return final
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dstune.builtin.common import tiny_clip_tokenizer

    tokenizer = tiny_clip_tokenizer()  # SD's 49408-token vocabulary would have to be downloaded
    text = dict(
        DRY_TEXT if dry_run else SD15_TEXT,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    say(f"building the {'dry-run' if dry_run else 'SD-1.5-sized'} pipeline with random weights into {final}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipeline = StableDiffusionPipeline(
            unet=UNet2DConditionModel(**(DRY_UNET if dry_run else SD15_UNET)),
            vae=AutoencoderKL(**(DRY_VAE if dry_run else SD15_VAE)),
            text_encoder=CLIPTextModel(CLIPTextConfig(**text)),
            tokenizer=tokenizer,
            scheduler=DDPMScheduler(**SD15_SCHEDULER),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    work = final.parent / f".{final.name}-building-{os.getpid()}"
    pipeline.save_pretrained(work, safe_serialization=True)
    os.replace(work, final)
    return final


def forward_flops(unet_config: dict, latent_px: int) -> int:
    """FLOPs of one UNet forward for one sample, counted on the meta device (shapes only, no memory)."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_config)
        latents = torch.randn(1, unet_config["in_channels"], latent_px, latent_px)
        text = torch.randn(1, 77, unet_config["cross_attention_dim"])
        with FlopCounterMode(display=False) as counter:
            unet(latents, torch.tensor([500]), text)
    return counter.get_total_flops()


def peak_tflops(override: float | None) -> float | None:
    if override:
        return override
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def window_samples_per_s(ends: list[float], warmup: int, batch: int) -> float:
    """Samples/s of the median step after warm-up (the time between consecutive step ends)."""
    return batch / median([b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:])])


def run_dstune(work: Path, folder: Path, args, changes: dict | None = None) -> float:
    """dstune's samples/s on the pipeline; `changes`: section -> values merged into the spec (bench/gpu_levers.py)."""
    work.mkdir(parents=True)
    spec = {
        "model": {"family": "sd", "pretrained": str(folder)},
        "data": {
            "path": "builtin:shapes",
            "resolution": args.resolution,
            "cache": {"latents": True, "text_embeddings": True, "dir": str(BENCH_CACHE / f"{folder.name}-latents")},
        },
        "train": {
            "micro_batch_size": args.micro_batch,
            "gradient_accumulation_steps": 1,
            "max_steps": args.warmup + args.steps,
            "precision": "bf16",
            "seed": 7,
            "optimizer": {"type": "adamw", "lr": 1e-5},
            "scheduler": {"type": "constant"},
        },
        "deepspeed": {"zero_stage": 2},
        "output": {"dir": str(work / "run"), "cache_dir": str(BENCH_CACHE), "export": "none"},
    }
    for section, values in (changes or {}).items():
        spec[section] = {**spec[section], **values}
    spec_path = work / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    launch(TRAIN, [str(spec_path)], num_ranks=1, launcher=True)
    lines = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    return window_samples_per_s([m["elapsed_s"] for m in lines], args.warmup, args.micro_batch)


def run_baseline(work: Path, folder: Path, args) -> float:
    work.mkdir(parents=True)
    out = work / "baseline.json"
    launch(
        BASELINE,
        [
            "--pipeline",
            str(folder),
            "--resolution",
            str(args.resolution),
            "--micro-batch",
            str(args.micro_batch),
            "--steps",
            str(args.warmup + args.steps),
            "--out",
            str(out),
        ],
        num_ranks=1,
        launcher=True,
    )
    return window_samples_per_s(json.loads(out.read_text())["step_end_s"], args.warmup, args.micro_batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes at 32 px: check the code path anywhere")
    parser.add_argument("--resolution", type=int, default=None, help="px (default 512; 32 with --dry-run)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="dstune/baseline pairs, alternating")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU")
    args = parser.parse_args()
    if args.dry_run:
        args.resolution = args.resolution or 32
        args.steps, args.warmup, args.repeats, args.micro_batch = min(args.steps, 3), 1, 1, min(args.micro_batch, 2)
    args.resolution = args.resolution or 512
    folder = build_pipeline(args.dry_run)
    unet_config = json.loads((folder / "unet" / "config.json").read_text())
    vae_factor = 2 ** (len(json.loads((folder / "vae" / "config.json").read_text())["block_out_channels"]) - 1)
    train_flops = 3 * forward_flops(unet_config, args.resolution // vae_factor)
    peak = peak_tflops(args.peak_tflops)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="dstune-gpu-bench-") as tmp:
        for repeat in range(args.repeats):
            say(f"pair {repeat + 1}/{args.repeats}: dstune")
            ours = run_dstune(Path(tmp) / f"dstune{repeat}", folder, args)
            say(f"pair {repeat + 1}/{args.repeats}: accelerate + DeepSpeed baseline")
            theirs = run_baseline(Path(tmp) / f"baseline{repeat}", folder, args)
            say(f"  dstune {ours:.2f} samples/s, baseline {theirs:.2f} samples/s")
            pairs.append((ours, theirs))
    mfu = lambda rate: None if peak is None else rate * train_flops / (peak * 1e12)  # noqa: E731
    ours, theirs = median([o for o, _ in pairs]), median([t for _, t in pairs])
    info = machine()
    print_table(
        f"SD-1.5-sized UNet, {args.resolution} px, bf16, ZeRO 2, micro batch {args.micro_batch}, "
        f"1 device ({info.get('gpu', 'CPU')}){' - DRY RUN, not a measurement' if args.dry_run else ''}",
        ["loop", "samples/s (median)", "MFU", "per pair"],
        [
            ["dstune", ours, "-" if peak is None else mfu(ours), ", ".join(f"{o:.3g}" for o, _ in pairs)],
            [
                "accelerate + DeepSpeed",
                theirs,
                "-" if peak is None else mfu(theirs),
                ", ".join(f"{t:.3g}" for _, t in pairs),
            ],
            ["dstune / baseline", ours / theirs, "", ""],
        ],
    )
    print_json(
        "gpu_sd",
        {
            "dry_run": args.dry_run,
            "resolution": args.resolution,
            "micro_batch": args.micro_batch,
            "unet_params": sum_params(unet_config),
            "train_flops_per_sample": train_flops,
            "peak_tflops": peak,
            "dstune_samples_per_s": [o for o, _ in pairs],
            "baseline_samples_per_s": [t for _, t in pairs],
            "ratio": ours / theirs,
            "dstune_mfu": mfu(ours),
            "baseline_mfu": mfu(theirs),
            **info,
        },
    )


def sum_params(unet_config: dict) -> int:
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return sum(p.numel() for p in UNet2DConditionModel(**unet_config).parameters())


if __name__ == "__main__":
    main()
