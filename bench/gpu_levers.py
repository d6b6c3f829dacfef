"""GPU benchmark of the memory and speed levers: the SD-1.5-sized UNet of bench/gpu_sd.py (860 M parameters, random
weights, 512 px, bf16, ZeRO 2, one GPU, gradient checkpointing) trained by dstune plain and with each lever, in the
same run: samples/s against the plain run's, and the step phase's CUDA peak (memory.json) beside the memory plan's.

    plain                 gradient checkpointing only (the baseline of every ratio)
    activation-offload    model.activation_offload: cpu (block inputs in pinned host memory)
    compiled              train.compile: blocks (torch.compile of the UNet's transformer blocks; its first steps
                          compile, so the warm-up must cover them)
    bf16-states           deepspeed.offload_optimizer: cpu with bf16_optimizer_states
    offload-fp32-states   deepspeed.offload_optimizer: cpu (the bf16 states' own baseline)

    python3 bench/gpu_levers.py [--micro-batch 8] [--steps 30] [--warmup 5]
    python3 bench/gpu_levers.py --dry-run     (tiny sizes, 32 px, any machine: checks the code path only)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_json, print_table, say  # noqa: E402
from gpu_sd import build_pipeline, run_dstune  # noqa: E402

LEVERS = {
    "plain": {},
    "activation-offload": {"model": {"activation_offload": "cpu"}},
    "compiled": {"train": {"compile": "blocks"}},
    "bf16-states": {"deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu", "bf16_optimizer_states": True}},
    "offload-fp32-states": {"deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"}},
}


def step_peaks(run_dir: Path) -> tuple[float, float]:
    """(predicted, measured) bytes of the step phase: the plan's and the largest rank's own peak."""
    step = json.loads((run_dir / "memory.json").read_text())["phases"]["step"]
    return step["predicted_bytes"], step["measured_max_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes at 32 px: check the code path anywhere")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--levers", nargs="*", default=list(LEVERS), choices=list(LEVERS))
    args = parser.parse_args()
    args.resolution = 32 if args.dry_run else 512
    if args.dry_run:
        args.steps, args.warmup, args.micro_batch = 3, 1, 2
    folder = build_pipeline(args.dry_run)
    results = {}
    with tempfile.TemporaryDirectory(prefix="dstune-gpu-levers-") as tmp:
        for name in ["plain", *[lever for lever in args.levers if lever != "plain"]]:
            say(f"{name}")
            changes = {"model": {"gradient_checkpointing": True}}
            for section, values in LEVERS[name].items():
                changes[section] = {**changes.get(section, {}), **values}
            rate = run_dstune(Path(tmp) / name, folder, args, changes)
            results[name] = (rate, *step_peaks(Path(tmp) / name / "run"))
    plain = results["plain"][0]
    info = machine()
    print_table(
        f"SD-1.5-sized UNet, {args.resolution} px, bf16, ZeRO 2, checkpointing, micro batch {args.micro_batch}, "
        f"1 device ({info.get('gpu', 'CPU')}){' - DRY RUN, not a measurement' if args.dry_run else ''}",
        ["lever", "samples/s", "/ plain", "step predicted GB", "step measured GB"],
        [
            [name, rate, rate / plain, predicted / 1e9, measured / 1e9]
            for name, (rate, predicted, measured) in results.items()
        ],
    )
    print_json("gpu_levers", {"dry_run": args.dry_run, "micro_batch": args.micro_batch, "results": results, **info})


if __name__ == "__main__":
    main()
