"""Memory: dstune's memory plan against measurement, per rank, over a grid of ZeRO stages, optimizer offload and
micro batches, for the same model on 2 ranks (CPU: RSS and live tensors; a GPU: CUDA peak allocated).

Model: the benchmark UNet (bench/common.py BENCH_UNET, 17.6 M parameters), bf16, on 8x8 latents (64 px). Each
grid point compiles the demo spec with `dstune compile` for its stage/offload/micro batch and runs
bench/memory_rank.py under the launcher: one optimizer step, then a second backward.

Measured per rank: (a) model states at rest, the bytes of every live tensor after the second backward with the
batch freed (CUDA: memory_allocated), and after the second step; (b) the peak RSS growth over the rank's baseline
before the model was built (CUDA: max_memory_allocated), which holds every transient of the step. Predicted:
dstune.memory.plan's model states (parameters + gradients + optimizer states, the peak of a step: DeepSpeed's
estimators' figure, including the fp32 gradient partition that exists only during the step) and its per-rank total
(model states + DeepSpeed buffers + the activation estimate), and DeepSpeed's own estimator where it has one.

    python3 bench/memory_bench.py [--ranks 2] [--quick]
    python3 bench/memory_bench.py --phases [--ranks 2] [--quick]    per phase, through real training runs
                                                                    (bench/memory_phases.py)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_UNET, REPO, env, launch, machine, print_json, print_table, say  # noqa: E402

sys.path.insert(0, str(REPO))  # this checkout's dstune, not an installed one
from dstune.memory.activations import unet_sample_bytes  # noqa: E402
from dstune.memory.plan import ModelCounts, Setup, estimate, model_states  # noqa: E402

DEMO = REPO / "launch" / "sd-tiny-demo.yaml"
MB = 1e6
# (ZeRO stage, micro batch, optimizer offload, optimizer): offload runs SGD with momentum as a client optimizer on
# the CPU (AdamW under offload is DeepSpeed's CPU Adam, a compiled extension not built on this machine)
GRID = [
    (0, 1, "none", "adamw"),
    (1, 1, "none", "adamw"),
    (2, 1, "none", "adamw"),
    (3, 1, "none", "adamw"),
    (2, 4, "none", "adamw"),
    (2, 1, "cpu", "sgd"),
]
QUICK = [(0, 1, "none", "adamw"), (2, 1, "none", "adamw")]


def deepspeed_estimate(stage: int, offload: str, params: int, largest_layer: int, ranks: int):
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(params, ranks, cpu_offload=offload != "none")[1]
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(
            params, largest_layer, ranks, cpu_offload=offload != "none", cpu_offload_params=False
        )[1]
    return None


def compile_config(work: Path, name: str, stage: int, micro: int, offload: str, optimizer: str, ranks: int) -> Path:
    config = work / f"{name}.json"
    sets = {
        "train.precision": "bf16",
        "deepspeed.zero_stage": stage,
        "train.micro_batch_size": micro,
        "train.global_batch_size": micro * ranks,
        "deepspeed.offload_optimizer": offload,
        "train.optimizer": "{type: sgd, lr: 0.0001, momentum: 0.9}" if optimizer == "sgd" else "{type: adamw}",
    }
    flags = [part for key, value in sets.items() for part in ("--set", f"{key}={value}")]
    subprocess.run(
        [sys.executable, "-m", "dstune", "compile", str(DEMO), "--num-gpus", str(ranks), *flags, "-o", str(config)],
        cwd=REPO,
        env=env(),
        check=True,
        capture_output=True,
        timeout=600,
    )
    return config


def predicted(config: dict, optimizer: str, params: int, largest: int, ranks: int) -> tuple[float, float]:
    """(model states, per-rank total) from dstune.memory.plan for this DeepSpeed JSON."""
    zero = config["zero_optimization"]
    full, _ = unet_sample_bytes(BENCH_UNET, 64)
    counts = ModelCounts("unet", params, params, largest, activation_sample_bytes=int(full))
    setup = Setup(
        world_size=ranks,
        ranks_per_node=ranks,
        zero_stage=zero["stage"],
        offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none"),
        offload_param="none",
        precision="bf16",
        optimizer=optimizer,
        momentum=0.9,
        micro_batch=config["train_micro_batch_size_per_gpu"],
        accumulation=1,
        gradient_checkpointing=False,
        lora=False,
        reduce_bucket=zero.get("reduce_bucket_size", 5e8),
        allgather_bucket=zero.get("allgather_bucket_size", 5e8),
        prefetch_bucket=zero.get("stage3_prefetch_bucket_size", 5e7),
        overlap_comm=zero.get("overlap_comm", False),
        accelerator="cpu",
    )
    return sum(model_states(counts, setup)), estimate(counts, setup).total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="two grid points only (ZeRO 0 and 2, micro 1)")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="prediction and measurement per phase (load, cache, "
        "step, sample) from real training runs: bench/memory_phases.py",
    )
    args = parser.parse_args()
    if args.phases:
        import memory_phases

        sys.argv = [sys.argv[0], "--ranks", str(args.ranks), *(["--quick"] if args.quick else [])]
        return memory_phases.main()
    rows, result = [], {}
    with tempfile.TemporaryDirectory(prefix="dstune-memory-bench-") as tmp:
        for stage, micro, offload, optimizer in QUICK if args.quick else GRID:
            name = f"zero{stage}-micro{micro}-offload_{offload}-{optimizer}"
            say(f"{name}: {args.ranks} ranks")
            config_path = compile_config(Path(tmp), name, stage, micro, offload, optimizer, args.ranks)
            out = Path(tmp) / name
            out.mkdir()
            launch(
                Path(__file__).resolve().parent / "memory_rank.py",
                ["--ds-config", str(config_path), "--out", str(out), "--optimizer", optimizer],
                num_ranks=args.ranks,
            )
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.ranks)]
            params, largest = ranks[0]["num_params"], ranks[0]["largest_layer_params"]
            states, total = predicted(json.loads(config_path.read_text()), optimizer, params, largest, args.ranks)
            at_rest = max(r["after_backward_bytes"] for r in ranks)
            after_step = max(r["after_step_bytes"] for r in ranks)
            peak = max(r["cuda_peak_allocated_bytes"] or r["peak_rss_growth_bytes"] for r in ranks)
            ds = deepspeed_estimate(stage, offload, params, largest, args.ranks)
            rows.append(
                [
                    stage,
                    micro,
                    offload,
                    optimizer,
                    states / MB,
                    "-" if ds is None else ds / MB,
                    at_rest / MB,
                    after_step / MB,
                    at_rest / states,
                    total / MB,
                    peak / MB,
                    peak / total,
                ]
            )
            result[name] = {
                "predicted_model_states_bytes": states,
                "predicted_total_bytes": total,
                "deepspeed_estimate_bytes": ds,
                "measured_at_rest_bytes": at_rest,
                "measured_after_step_bytes": after_step,
                "measured_peak_bytes": peak,
            }
    print_table(
        f"Memory per rank (MB), {params / 1e6:.1f} M-parameter UNet, bf16, {args.ranks} ranks, on {ranks[0]['device']}",
        [
            "ZeRO",
            "micro",
            "offload",
            "optimizer",
            "predicted model states",
            "DeepSpeed estimate",
            "live tensors after backward",
            "after step",
            "at rest / predicted",
            "predicted total",
            "measured peak (RSS growth or CUDA)",
            "peak / predicted total",
        ],
        rows,
    )
    print_json(
        "memory",
        {
            "params": params,
            "largest_layer_params": largest,
            "ranks": args.ranks,
            "precision": "bf16",
            **result,
            **machine(),
        },
    )


if __name__ == "__main__":
    main()
