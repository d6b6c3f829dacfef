"""Cache benchmark on the built-in model (builtin:tiny-sd, builtin:shapes), CPU.

  1. Step time, in this process: encode (on the fly, or read from the cache) + loss + backward + AdamW step on the
     UNet, the same batches both ways; ratio = on-the-fly / cached.
  2. Cache build time (`train.py --cache-only`, fresh folder) with 1 rank and with 2 ranks under the launcher; the
     time is the build's own (the summary line), not the process start-up; the fastest of --repeats fresh builds;
     ratio = 1 rank / 2 ranks.

    python3 bench/cache_bench.py [--resolution 64] [--steps 8] [--batch 4] [--build-resolution 128] [--repeats 3]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_CACHE as CACHE_DIR, REPO, env, machine, print_json, print_table, say as _say  # noqa: E402

sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import yaml  # noqa: E402


def _spec(work: Path, resolution: int, batch: int, latents: bool) -> dict:
    return {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": {
            "path": "builtin:shapes",
            "resolution": resolution,
            "num_workers": 0,
            "cache": {"latents": latents, "text_embeddings": latents, "dir": str(work / "cache")},
        },
        "train": {
            "micro_batch_size": batch,
            "max_steps": 10,
            "precision": "fp32",
            "seed": 7,
            "optimizer": {"type": "adamw", "lr": 1e-4},
        },
        "output": {"dir": str(work / "run"), "cache_dir": str(CACHE_DIR), "export": "none"},
    }


def _steps(model, loader, steps: int) -> float:
    """Mean seconds per step after one warm-up step."""
    optimizer = torch.optim.AdamW(model.trainable.parameters(), lr=1e-4)
    times, batches = [], iter(loader)
    for step in range(steps + 1):
        started = time.perf_counter()
        encoded = model.encode_batch(next(batches), torch.float32)
        model.loss(model.trainable, encoded, 7, step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return sum(times[1:]) / steps


def step_times(work: Path, resolution: int, batch: int, steps: int) -> dict:
    from dstune.cache.datasets import CachedDataset, collate_cached
    from dstune.data import list_samples
    from dstune.data.images import ImageCaptionDataset, collate
    from dstune.pretrained import build_model
    from dstune.spec.models import Spec
    from dstune.startup import prepare_caches

    spec = Spec.model_validate(_spec(work, resolution, batch, latents=True))
    model = build_model(spec.model, spec.output.cache_dir, "cpu", torch.float32)
    records = list_samples(spec.data)
    run = SimpleNamespace(rank=0, world_size=1, node_rank=0, is_main=True)
    _say("building the cache in this process")
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds only the table and the JSON line
        caches, code = prepare_caches(run, spec, model, records)
    assert code == 0
    index = caches.images
    order = torch.Generator().manual_seed(0)
    batches = torch.randperm(len(records), generator=order)[: (steps + 1) * batch].view(-1, batch).tolist()
    fly = torch.utils.data.DataLoader(
        ImageCaptionDataset(spec.data, records, 7), batch_sampler=batches, collate_fn=collate
    )
    cached = torch.utils.data.DataLoader(
        CachedDataset(spec.data, records, 7, index), batch_sampler=batches, collate_fn=collate_cached
    )
    state = {k: v.clone() for k, v in model.trainable.state_dict().items()}
    _say("steps on the fly")
    fly_s = _steps(model, fly, steps)
    model.trainable.load_state_dict(state)
    _say("steps from the cache")
    cached_s = _steps(model, cached, steps)
    return {"on_the_fly_step_s": fly_s, "cached_step_s": cached_s, "step_speedup": fly_s / cached_s}


def build_time(work: Path, resolution: int, ranks: int, attempt: int) -> float:
    spec_path = work / f"build{ranks}-{attempt}.yaml"
    spec = _spec(work / f"r{ranks}-{attempt}", resolution, 2, latents=True)
    spec_path.write_text(yaml.safe_dump(spec))
    train = str(REPO / "dstune" / "train.py")
    if ranks == 1:
        cmd = [sys.executable, train, str(spec_path), "--cache-only"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(ranks),
            train,
            str(spec_path),
            "--cache-only",
        ]
    _say(f"cache build with {ranks} rank(s)")
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)
    found = re.search(r"entries per folder \(([\d.]+) s\)", proc.stdout)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"build with {ranks} rank(s) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--build-resolution", type=int, default=128, help="resolution of the cache-build timing")
    parser.add_argument("--repeats", type=int, default=3, help="fresh builds per rank count; the fastest counts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {
            "resolution": args.resolution,
            "batch": args.batch,
            **step_times(work / "steps", args.resolution, args.batch, args.steps),
        }
        one = min(build_time(work, args.build_resolution, 1, i) for i in range(args.repeats))
        two = min(build_time(work, args.build_resolution, 2, i) for i in range(args.repeats))
    result.update(
        build_resolution=args.build_resolution,
        build_entries=256 + 18,
        build_1_rank_s=one,
        build_2_ranks_s=two,
        build_speedup=one / two,
    )
    print_table(
        f"Cache: step time ({args.resolution} px, batch {args.batch}) and build time "
        f"({args.build_resolution} px, {result['build_entries']} entries)",
        ["measure", "dstune (cached / 2 ranks)", "baseline (on the fly / 1 rank)", "baseline / dstune"],
        [
            ["step time, s", result["cached_step_s"], result["on_the_fly_step_s"], result["step_speedup"]],
            ["cache build, s", two, one, one / two],
        ],
    )
    print_json("cache", {**result, **machine()})


if __name__ == "__main__":
    main()
