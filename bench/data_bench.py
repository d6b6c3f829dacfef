"""Data path: how fast one rank's loader delivers samples vs how fast training consumes them, and the data wait
training itself reports.

  1. Loader alone, in this process, one rank's share of one epoch (2 ranks planned), default data.num_workers,
     worker start-up included (workers restart every epoch): (a) JPEG files decoded, resized, cropped and collated
     (the on-the-fly path), (b) latent + text-embedding cache reads (the cached path).
  2. Training, `deepspeed dstune/train.py` with 2 ranks, ZeRO 2, the benchmark UNet (bench/common.py), on the same
     files, once on the fly (VAE and text encoder run in the step) and once from the cache: samples/s per rank
     over a window after warm-up, and the data wait fraction from training's own metrics.jsonl (data_s).
Headroom = loader samples/s / training samples/s per rank, for the same path. Target: >= 5x, and a small data wait
fraction. The two loader measurements and the two trainings alternate (loader, train, loader, train).

    python3 bench/data_bench.py [--images 256] [--source-px 256] [--resolution 64] [--steps 10] [--warmup 2]
    python3 bench/data_bench.py --loader-only --source-px 768 --resolution 512    (SD-scale decode, no training)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    BENCH_CACHE,
    REPO,
    TRAIN,
    bench_model_folder,
    launch,
    machine,
    median,  # noqa: E402
    print_json,
    print_table,
    say,
)

sys.path.insert(0, str(REPO))
import yaml  # noqa: E402

RANKS = 2


def make_folder(root: Path, count: int, source_px: int) -> Path:
    """`count` JPEG images (quality 90) of `source_px` px with same-name .txt captions."""
    from dstune.data.synthetic import render_shape

    root.mkdir(parents=True)
    for i in range(count):
        image, caption = render_shape(i, source_px)
        image.convert("RGB").save(root / f"img{i:05d}.jpg", quality=90)
        (root / f"img{i:05d}.txt").write_text(caption)
    return root


def spec_dict(work: Path, images: Path, folder: Path, args, cached: bool) -> dict:
    data = {"path": str(images), "resolution": args.resolution, "center_crop": True}
    if cached:
        data["cache"] = {"latents": True, "text_embeddings": True, "dir": str(work / "cache")}
    if args.num_workers is not None:
        data["num_workers"] = args.num_workers
    return {
        "model": {"family": "sd", "pretrained": str(folder)},
        "data": data,
        "train": {
            "micro_batch_size": args.micro_batch,
            "gradient_accumulation_steps": 1,
            "max_steps": args.warmup + args.steps,
            "precision": "fp32",
            "seed": 7,
            "optimizer": {"type": "adamw", "lr": 1e-4},
            "scheduler": {"type": "constant"},
        },
        "deepspeed": {"zero_stage": 2},
        "output": {
            "dir": str(work / f"run-{'cached' if cached else 'fly'}"),
            "cache_dir": str(BENCH_CACHE),
            "export": "none",
        },
    }


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def loader_rate(spec_path: Path, folder: Path, cached: bool) -> tuple[float, int, int]:
    """(samples/s, samples, num_workers) of rank 0's loader over one epoch of a 2-rank plan."""
    from dstune.data import build_loader, list_samples
    from dstune.validate import load_and_validate as resolve
    from dstune.world import world_from_flags

    resolved = resolve(str(spec_path), world=world_from_flags(world_size=RANKS))
    spec, plan = resolved.spec, resolved.plan
    records = list_samples(spec.data)
    if cached:
        from dstune.families import card_of
        from dstune.startup import make_training_loader, prepare_caches

        run = SimpleNamespace(rank=0, world_size=1, node_rank=0, is_main=True)
        card = card_of(spec.model.family, folder)
        with contextlib.redirect_stdout(sys.stderr):  # stdout holds only the table and the JSON line
            caches, code = prepare_caches(run, spec, None, records, verify_only=True, card=card, model_folder=folder)
        if code:
            raise SystemExit("the cache the cached training run built is incomplete")
        loader, _ = make_training_loader(spec, plan, 0, None, records, caches, 0, 0)  # images: no model needed
    else:
        loader, _ = build_loader(spec.data, plan, 0, spec.train.seed, records)
    samples, started = 0, time.perf_counter()
    for batch in loader:
        samples += len(batch["index"])
    return samples / (time.perf_counter() - started), samples, spec.data.num_workers


def training_rate(spec_path: Path, run_dir: Path, args) -> tuple[float, float]:
    """(samples/s per rank over the window after warm-up, data wait fraction in that window) of a 2-rank run."""
    launch(TRAIN, [str(spec_path)], num_ranks=RANKS)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    window = lines[args.warmup :]
    ends = [m["elapsed_s"] for m in lines[args.warmup - 1 :]]
    step_s = median([b - a for a, b in zip(ends, ends[1:])])  # median: robust to bursts of other work
    wait = sum(m["data_s"] for m in window) / sum(m["data_s"] + m["compute_s"] for m in window)
    return args.micro_batch / step_s, wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256, help="JPEG files in the benchmark folder")
    parser.add_argument("--source-px", type=int, default=256, help="side of the stored JPEGs")
    parser.add_argument("--resolution", type=int, default=64, help="data.resolution (training size)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=None, help="data.num_workers (default: the spec's)")
    parser.add_argument("--steps", type=int, default=10, help="measured training steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--loader-only", action="store_true", help="measure the on-the-fly loader only")
    args = parser.parse_args()
    folder = bench_model_folder()
    rows, result = [], {}
    with tempfile.TemporaryDirectory(prefix="dstune-data-bench-") as tmp:
        work = Path(tmp)
        say(f"writing {args.images} JPEGs of {args.source_px} px")
        images = make_folder(work / "images", args.images, args.source_px)
        for cached in (False,) if args.loader_only else (False, True):
            path = "cache reads" if cached else "decode + resize + collate"
            spec_path = write_spec(work / f"spec-{cached}.yaml", spec_dict(work, images, folder, args, cached))
            train_rate = wait = None
            if not args.loader_only:
                say(f"training, {path}")  # first, so the cached run builds the cache the loader then reads
                train_rate, wait = training_rate(spec_path, work / f"run-{'cached' if cached else 'fly'}", args)
            say(f"loader alone, {path}")
            load_rate, samples, workers = loader_rate(spec_path, folder, cached)
            headroom = None if train_rate is None else load_rate / train_rate
            rows.append(
                [
                    path,
                    workers,
                    load_rate,
                    train_rate if train_rate else "-",
                    headroom if headroom else "-",
                    wait if wait is not None else "-",
                ]
            )
            result["cached" if cached else "on_the_fly"] = {
                "loader_samples_per_s": load_rate,
                "loader_samples": samples,
                "num_workers": workers,
                "train_samples_per_s_per_rank": train_rate,
                "headroom": headroom,
                "data_wait_fraction": wait,
            }
    print_table(
        f"Data path, per rank: {args.images} JPEGs of {args.source_px} px -> {args.resolution} px, "
        f"micro batch {args.micro_batch}, {RANKS} ranks, ZeRO 2",
        ["path", "workers", "loader samples/s", "training samples/s", "headroom", "training's data wait"],
        rows,
    )
    print_json(
        "data",
        {
            "images": args.images,
            "source_px": args.source_px,
            "resolution": args.resolution,
            "micro_batch": args.micro_batch,
            "ranks": RANKS,
            **result,
            "target_headroom_min": 5,
            **machine(),
        },
    )


if __name__ == "__main__":
    main()
