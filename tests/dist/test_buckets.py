"""Aspect-ratio buckets on 2 real ranks (ZeRO 2, CPU): a folder of portrait, square and landscape images trains
with 1 micro x 2 accumulation x 2 ranks, the bucket-aware batch check passes, every step has one size (the loader
stops at a batch of another size, so a finished run proves it), and a run resumed mid-epoch from the latent cache
continues the on-the-fly run's loss trajectory. Two launches in all."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from harness import base_spec, explain, launch, metrics, write_spec

pytestmark = pytest.mark.dist

STEPS = 4
SHAPES = {(48, 80): 9, (64, 64): 8, (80, 48): 10}  # -> buckets 24x40, 32x32, 40x24 at resolution 32, step 8
BUCKET_STEPS = "24x40: 2, 32x32: 2, 40x24: 2"  # 9 // 4, 8 // 4, 10 // 4 global batches of 4


def _image_folder(root: Path) -> Path:
    from PIL import Image, ImageDraw

    root.mkdir(parents=True)
    number = 0
    for (width, height), count in SHAPES.items():
        for _ in range(count):
            image = Image.new("RGB", (width, height), (30 + 7 * number, 40, 90))
            ImageDraw.Draw(image).ellipse((width // 4, height // 4, width * 3 // 4, height * 3 // 4),
                                          fill=(230, 60 + 5 * number, 40))
            image.save(root / f"img{number:02d}.png")
            (root / f"img{number:02d}.txt").write_text(f"an orange ellipse {width}x{height}")
            number += 1
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("buckets")
    run_dir = root / "run"
    spec = base_spec(
        run_dir,
        data={"path": str(_image_folder(root / "images")), "random_flip": True,
              "buckets": {"enabled": True, "step": 8}},
        train={"micro_batch_size": 1, "gradient_accumulation_steps": 2, "max_steps": STEPS},
        deepspeed={"zero_stage": 2},
        output={"save_every_steps": 2, "keep_last": 5},
    )
    spec_path = write_spec(root / "spec.yaml", spec)
    out = {"run_dir": run_dir, "first": launch(spec_path, num_ranks=2)}
    if out["first"].returncode == 0:
        resumed_dir = root / "resumed"
        (resumed_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed_dir / "checkpoints" / "step-00000002")
        (resumed_dir / "checkpoints" / "latest").write_text("step-00000002")
        out["resumed_dir"] = resumed_dir
        out["resumed"] = launch(spec_path, num_ranks=2, args=(
            "--resume", "latest", "--set", f"output.dir={resumed_dir}", "--set", "data.cache.latents=true",
            "--set", f"data.cache.dir={root / 'cache'}"))
    return out


def test_buckets_train_under_zero2_and_the_bucket_check_passes(runs):
    first = runs["first"]
    assert first.returncode == 0, explain(first)
    assert "batch check passed" in first.stdout, explain(first)
    table = first.stdout[first.stdout.index("batch check passed"):]
    assert re.search(rf"bucket steps\s+{BUCKET_STEPS}\s+{BUCKET_STEPS}\s+{BUCKET_STEPS}", table), explain(first)
    assert re.search(r"steps mixing buckets\s+0\s+0\s+0", table), explain(first)
    assert re.search(r"first batch in bucket\s+True\s+True\s+True", table), explain(first)
    assert re.search(r"40x24\s+10 samples, 2 global batches per epoch, leaves out 2", first.stdout)  # the plan
    logged = metrics(runs["run_dir"])
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(m["samples"] == 4 * m["step"] for m in logged)


def test_every_step_has_one_bucket_size(runs):
    """The loader checks every batch against its step's bucket and stops training otherwise, so the finished run
    trained every step at one size; here the run's own plan and data rebuild each rank's steps and confirm it."""
    assert runs["first"].returncode == 0, explain(runs["first"])
    import json

    from dstune.data import list_samples
    from dstune.data.buckets import assign_buckets, index_keys
    from dstune.data.sampler import GlobalBatchSampler
    from dstune.spec.models import DataSpec

    run_dir = runs["run_dir"]
    spec = json.loads((run_dir / "spec.json").read_text())
    data = DataSpec.model_validate(spec["data"])
    plan = json.loads((run_dir / "plan.json").read_text())
    records = list_samples(data)
    keys = index_keys(records, assign_buckets(records, data)[0])
    plan_like = type("P", (), {k: plan[k] for k in ("micro_batch_size", "gradient_accumulation_steps",
                                                   "global_batch_size", "world_size", "steps_per_epoch")})
    samplers = [GlobalBatchSampler(len(keys), plan_like, rank, spec["train"]["seed"], group_keys=keys)
                for rank in (0, 1)]
    for step in range(STEPS):
        sizes = {keys[i] for s in samplers for k in range(2) for i in s.micro_batch(0, step, k)}
        assert len(sizes) == 1, f"step {step + 1} mixes {sizes}"


def test_resume_from_the_latent_cache_continues_the_run_exactly(runs):
    resumed = runs.get("resumed")
    assert resumed is not None and resumed.returncode == 0, explain(resumed or runs["first"])
    assert "resumed from" in resumed.stdout and "batch check passed" in resumed.stdout, explain(resumed)
    assert "cache: 54 entries per folder" in resumed.stdout, explain(resumed)  # 27 images x 2 flips, at their sizes
    first, second = metrics(runs["run_dir"]), metrics(runs["resumed_dir"])
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        # The cache encodes 8 images per VAE call, training on the fly 1: rounding-level differences only.
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-4, abs=1e-6)
        assert after["lr"] == pytest.approx(before["lr"])
