"""Memory: per-rank model-state memory under ZeRO 0/1/2/3 for the same model on 2 ranks, measured, beside
DeepSpeed's own estimator and the ZeRO paper's formula.

Model: the benchmark UNet (bench/common.py BENCH_UNET, ~18 M parameters), AdamW, bf16 (the mixed precision the
estimator assumes: 16-bit parameters and gradients, fp32 master weights and Adam moments). The DeepSpeed JSON of
each stage is the one `dstune compile` writes for the demo spec with that stage and precision. Measured by
bench/memory_rank.py after a second backward: parameters + gradients + optimizer states, batch freed.

Formulas per rank, P parameters, N ranks (bytes): ZeRO paper (Rajbhandari et al. 2020, mixed-precision Adam):
stage 0: 16P; 1: 4P + 12P/N; 2: 2P + 14P/N; 3: 16P/N. DeepSpeed's estimators (no offload):
estimate_zero2_model_states_mem_needs: 2P + 18P/N; estimate_zero3_model_states_mem_needs: 4L + 18P/N (L: largest
layer's parameters); DeepSpeed has none for stages 0 and 1.

    python3 bench/memory_bench.py [--ranks 2] [--stages 0 1 2 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, env, launch, machine, print_json, print_table, say  # noqa: E402

DEMO = REPO / "launch" / "sd-tiny-demo.yaml"
MB = 1e6


def paper_bytes(stage: int, params: int, ranks: int) -> float:
    return {0: 16 * params, 1: 4 * params + 12 * params / ranks, 2: 2 * params + 14 * params / ranks,
            3: 16 * params / ranks}[stage]


def deepspeed_estimate(stage: int, params: int, largest_layer: int, ranks: int):
    """Per-rank accelerator bytes from DeepSpeed's estimator, or None where it has none."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=ranks, cpu_offload=False)[1]
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(params, largest_layer, num_gpus_per_node=ranks,
                                                     cpu_offload=False, cpu_offload_params=False)[1]
    return None


def measure(work: Path, stage: int, ranks: int) -> list[dict]:
    config = work / f"zero{stage}.json"
    subprocess.run([sys.executable, "-m", "dstune", "compile", str(DEMO), "--num-gpus", str(ranks),
                    "--set", "train.precision=bf16", "--set", f"deepspeed.zero_stage={stage}",
                    "--set", "train.micro_batch_size=1", "--set", f"train.global_batch_size={ranks}",
                    "-o", str(config)], cwd=REPO, env=env(), check=True, capture_output=True, timeout=600)
    out = work / f"zero{stage}"
    out.mkdir()
    launch(Path(__file__).resolve().parent / "memory_rank.py", ["--ds-config", str(config), "--out", str(out)],
           num_ranks=ranks)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=(0, 1, 2, 3))
    args = parser.parse_args()
    rows, result = [], {}
    with tempfile.TemporaryDirectory(prefix="dstune-memory-bench-") as tmp:
        for stage in args.stages:
            say(f"ZeRO {stage}: {args.ranks} ranks")
            ranks = measure(Path(tmp), stage, args.ranks)
            params, largest = ranks[0]["num_params"], ranks[0]["largest_layer_params"]
            measured = max(r["after_backward_bytes"] for r in ranks)
            after_step = max(r["after_step_bytes"] for r in ranks)
            estimate = deepspeed_estimate(stage, params, largest, args.ranks)
            paper = paper_bytes(stage, params, args.ranks)
            rows.append([stage, measured / MB, measured / params, after_step / MB,
                         "-" if estimate is None else estimate / MB, paper / MB,
                         "-" if estimate is None else measured / estimate, measured / paper])
            result[f"zero{stage}"] = {"measured_bytes_per_rank": [r["after_backward_bytes"] for r in ranks],
                                      "after_step_bytes_per_rank": [r["after_step_bytes"] for r in ranks],
                                      "deepspeed_estimate_bytes": estimate, "paper_bytes": paper}
    print_table(f"Model-state memory per rank (MB), {params / 1e6:.1f} M-parameter UNet, AdamW, bf16, "
                f"{args.ranks} ranks, on {ranks[0]['device']}",
                ["ZeRO", "measured MB", "bytes/param", "after step MB", "DeepSpeed estimate MB", "paper formula MB",
                 "measured / estimate", "measured / paper"], rows)
    print_json("memory", {"params": params, "largest_layer_params": largest, "ranks": args.ranks,
                          "precision": "bf16", **result, **machine()})


if __name__ == "__main__":
    main()
