"""Host memory per rank while the trainable model is loaded, 1 rank vs 2: one copy per process at most, and under
ZeRO-3 a partitioned build ("one copy, not one per rank").

Model: a diffusers pipeline folder (the built-in tiny-sd's VAE, text encoder, tokenizer and scheduler) with a
random UNet of LOAD_UNET (~110 M parameters, 438 MB in fp32), built once into --model-dir (default
/tmp/dstune-load-rss). Each row is one launch of bench/load_rss_rank.py (see there for the modes and how RSS is
read). The baseline, measured in the same run, is `whole` + ZeRO-3 with the same number of ranks: how ZeRO-3 runs
loaded before (every rank reads the whole model, then DeepSpeed partitions it).

    python3 bench/load_rss.py [--ranks 1 2] [--model-dir /tmp/dstune-load-rss]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    BENCH_CACHE,
    REPO,
    launch,
    machine,
    print_json,
    print_table,
    say,  # noqa: E402
    sd_pipeline_with_unet,
)

LOAD_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(160, 320, 640),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=32,
)
RUNS = [("eager", 3), ("whole", 2), ("whole", 3), ("partitioned", 3)]  # (load mode, ZeRO stage)
BASELINE = ("whole", 3)
MB = 1e6


def model_folder(target: Path) -> Path:
    """The tiny-sd pipeline with a random LOAD_UNET, written once (seeded) to `target`."""
    return sd_pipeline_with_unet(target, LOAD_UNET, Path(os.environ.get("DSTUNE_TEST_CACHE", BENCH_CACHE)))


def measure(folder: Path, mode: str, stage: int, ranks: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        launch(
            REPO / "bench" / "load_rss_rank.py",
            ["--mode", mode, "--stage", str(stage), "--folder", str(folder), "--out", out],
            ranks,
            launcher=True,
        )
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "dstune-load-rss")
    args = parser.parse_args()
    folder = model_folder(args.model_dir)
    results = {}
    for ranks in args.ranks:
        for mode, stage in RUNS:
            say(f"{mode} load, ZeRO-{stage}, {ranks} rank(s)")
            results[(mode, stage, ranks)] = measure(folder, mode, stage, ranks)
    rows = []
    for (mode, stage, ranks), per_rank in results.items():
        base = results[(*BASELINE, ranks)]
        model = per_rank[0]["model_fp32_bytes"]
        for r in per_rank:
            ref = base[r["rank"]]
            rows.append(
                [
                    mode,
                    stage,
                    ranks,
                    r["rank"],
                    f"{r['build_peak_bytes'] / MB:.0f}",
                    f"{r['build_peak_bytes'] / model:.2f}",
                    f"{r['after_init_bytes'] / MB:.0f}",
                    f"{r['after_init_bytes'] / model:.2f}",
                    f"{max(r['build_peak_bytes'], r['init_peak_bytes']) / max(ref['build_peak_bytes'], ref['init_peak_bytes']):.2f}",
                ]
            )
    model_mb = next(iter(results.values()))[0]["model_fp32_bytes"] / MB
    print_table(
        f"host RSS per rank, UNet {model_mb:.0f} MB in fp32 (x: multiples of it)",
        ["load", "ZeRO", "ranks", "rank", "load peak MB", "x", "after init MB", "x", "peak vs whole+ZeRO-3"],
        rows,
    )
    print_json("load_rss", {"machine": machine(), "unet": LOAD_UNET, "runs": [r for v in results.values() for r in v]})


if __name__ == "__main__":
    main()
