"""Memory per phase: dstune's plan against a real training run, phase by phase (load, cache build, step, samples).

Each case trains the benchmark pipeline (bench/common.py: tiny-sd with the 17.6 M-parameter BENCH_UNET) for 2
optimizer steps with `dstune/train.py` on N ranks, and reads the run's memory.json, where every rank recorded each
phase's own peak (dstune.memory.record: CUDA max allocated on a GPU; on the CPU the peak RSS growth over the rank's
baseline, reset at each phase) beside the plan's prediction for that phase (less the runtime reserve). The cases
cover ZeRO 0-3, each with the EMA and the encoder cache off and on, LoRA and full training, samples and optimizer
offload. On the CPU accelerator the prediction includes the runtime reserve a rank holds beyond the tensors
(dstune.memory.reserve.CPU_RUNTIME_RESERVE_BYTES), which its RSS sees.

    python3 bench/memory_phases.py [--ranks 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, bench_model_folder, launch, machine, print_json, print_table, say  # noqa: E402

DEMO = REPO / "launch" / "sd-tiny-demo.yaml"
MB = 1e6
LORA = "{rank: 8, alpha: 8}"
# name -> --set overrides on the demo spec (fp32: DeepSpeed's CPU accelerator has no fp16; bf16 runs on a GPU)
CACHE = {"data.cache.latents": "true", "data.cache.text_embeddings": "true"}
EMA = {"train.ema": "{device: same}"}
SAMPLES = {"sample.prompts": "[a red circle]"}
CASES = {  # ZeRO 0-3, each with the EMA and the encoder cache off and on
    "zero0-full": {"deepspeed.zero_stage": 0},
    "zero0-full-ema-cache": {"deepspeed.zero_stage": 0, **EMA, **CACHE},
    "zero1-full-ema": {"deepspeed.zero_stage": 1, **EMA},
    "zero1-full-cache": {"deepspeed.zero_stage": 1, **CACHE},
    "zero2-full-cache-samples": {"deepspeed.zero_stage": 2, **CACHE, **SAMPLES},
    "zero2-lora-ema-samples": {"deepspeed.zero_stage": 2, "model.train": "lora", "model.lora": LORA, **EMA, **SAMPLES},
    "zero3-full": {"deepspeed.zero_stage": 3},
    "zero3-full-ema-cache-samples": {"deepspeed.zero_stage": 3, **EMA, **CACHE, **SAMPLES},
    "zero2-offload-full": {
        "deepspeed.zero_stage": 2,
        "deepspeed.offload_optimizer": "cpu",
        "train.optimizer": "{type: sgd, lr: 0.0001, momentum: 0.9}",
    },
}
QUICK = ("zero0-full", "zero2-full-cache-samples", "zero3-full")
FLOOR = 0.9  # the plan's goal on every phase: predicted >= 0.9 x measured (docs/performance.md section 5)


def run_case(work: Path, name: str, overrides: dict, ranks: int, model: Path) -> dict:
    sets = {
        "model.pretrained": str(model),
        "output.dir": str(work / name),
        "train.max_steps": 2,
        "train.epochs": "null",
        "train.micro_batch_size": 2,
        "train.global_batch_size": 2 * ranks,
        "sample.steps": 2,
        "sample.every_steps": 1000,
        "output.export": "none",
        "data.cache.dir": str(work / f"{name}-cache"),
        "train.precision": "fp32",
        **overrides,
    }
    sets.setdefault("sample.prompts", "[]")
    args = [str(DEMO), *[part for key, value in sets.items() for part in ("--set", f"{key}={value}")]]
    launch(REPO / "dstune" / "train.py", args, num_ranks=ranks)
    return json.loads((work / name / "memory.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help=f"{len(QUICK)} cases only: {', '.join(QUICK)}")
    args = parser.parse_args()
    model = bench_model_folder()
    rows, result = [], {}
    with tempfile.TemporaryDirectory(prefix="dstune-memory-phases-") as tmp:
        for name in QUICK if args.quick else CASES:
            say(f"{name}: {args.ranks} ranks")
            report = run_case(Path(tmp), name, CASES[name], args.ranks, model)
            result[name] = report["phases"]
            reserves = {
                "step": report["predicted"]["per_gpu"]["runtime_reserve_bytes"],
                "load": report["predicted"]["phases"]["load"]["parts"].get("runtime reserve", 0),
            }
            for phase, row in report["phases"].items():
                predicted, measured = row["predicted_bytes"], row["measured_max_bytes"]
                if predicted is None or measured is None:  # no cache built: the cache phase holds the load's
                    continue
                reserve = reserves["step" if phase in ("step", "sample") else "load"]
                rows.append(
                    [
                        name,
                        phase,
                        predicted / MB,
                        reserve / MB,
                        measured / MB,
                        predicted / max(measured, 1),
                        "yes" if predicted >= FLOOR * measured else "NO",
                    ]
                )
    print_table(
        f"Memory per phase and rank (MB), 17.6 M-parameter UNet, fp32, {args.ranks} ranks, CPU accelerator",
        [
            "case",
            "phase",
            "predicted (with the reserve)",
            "of which runtime reserve",
            "measured (largest rank)",
            "predicted / measured",
            f"predicted >= {FLOOR} x measured",
        ],
        rows,
    )
    print_json("memory_phases", {"ranks": args.ranks, **result, **machine()})


if __name__ == "__main__":
    main()
