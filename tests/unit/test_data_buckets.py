"""Aspect-ratio buckets (data.buckets): the bucket list, assignment from headers, crops to the bucket, the plan,
`dstune validate`, the cache key, the batch checker's bucket rules."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml
from PIL import Image
from pydantic import ValidationError

from dstune.cache.entries import latent_key, plan_entries
from dstune.batch_check import Expected, RankReport, bucket_report, find_mismatches
from dstune.cli import main
from dstune.report import plan_text
from dstune.data.buckets import assign_buckets, bucket_counts, generate_buckets, header_size, nearest_bucket
from dstune.data.images import ImageCaptionDataset, resize_and_crop
from dstune.data.index import DataError, list_samples
from dstune.data.loader import build_loader
from dstune.plan import make_plan
from dstune.validate import load_and_validate as resolve
from dstune.spec.load import SpecError, SpecSource
from dstune.spec.models import DataSpec, TrainSpec
from dstune.world import world_from_flags

BUCKETS = {"enabled": True, "step": 8}  # at resolution 32: 24x40, 32x32, 40x24
SOURCE = SpecSource("spec.yaml")
WORLD2 = SimpleNamespace(world_size=2, num_nodes=1, ranks_per_node=(2,))


def image_folder(root, sizes) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for i, (width, height) in enumerate(sizes):
        Image.new("RGB", (width, height), (i * 9 % 256, 80, 160)).save(root / f"{i:03d}.png")
        (root / f"{i:03d}.txt").write_text(f"image {i}")
    return str(root)


def test_generated_buckets_have_about_the_square_area_and_mirror():
    assert generate_buckets(32, 0.5, 2.0, 8) == [(24, 40), (32, 32), (40, 24)]
    sizes = generate_buckets(1024, 0.5, 2.0, 64)
    assert (1024, 1024) in sizes and (704, 1408) in sizes and (1408, 704) in sizes
    assert all(w * h <= 1024 * 1024 and w % 64 == 0 == h % 64 for w, h in sizes)
    assert {(h, w) for w, h in sizes} == set(sizes)  # portrait buckets are the landscape ones mirrored
    assert all(0.5 <= w / h <= 2.0 for w, h in sizes)
    assert generate_buckets(512, 1.0, 1.0, 64) == [(512, 512)]


def test_nearest_bucket_by_aspect_on_a_log_scale():
    sizes = [(24, 40), (32, 32), (40, 24)]
    assert nearest_bucket(100, 60, sizes) == (40, 24)
    assert nearest_bucket(60, 100, sizes) == (24, 40)
    assert nearest_bucket(64, 64, sizes) == (32, 32)
    assert nearest_bucket(300, 100, sizes) == (40, 24)  # wider than every bucket: the widest
    # 1.29 is nearer 1:1 than 5:3 in ratio, but log-nearer to 5:3 (sqrt(5/3) = 1.291 is the midpoint)
    assert nearest_bucket(1300, 1000, sizes) == (40, 24) and nearest_bucket(1280, 1000, sizes) == (32, 32)


def test_header_size_honours_exif_rotation_and_reads_no_pixels(tmp_path):
    rotated = Image.new("RGB", (60, 100))
    exif = rotated.getexif()
    exif[0x0112] = 6  # rotated 90 degrees: shown as 100 x 60
    rotated.save(tmp_path / "phone.jpg", exif=exif)
    assert header_size(str(tmp_path / "phone.jpg")) == (100, 60)
    Image.new("RGB", (100, 60), (200, 10, 10)).save(tmp_path / "whole.png")
    data = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])  # pixel data truncated, header intact
    assert header_size(str(tmp_path / "cut.png")) == (100, 60)


def test_assignment_counts_repeats_and_reports_unreadable_files(tmp_path):
    root = tmp_path / "data"
    image_folder(root / "2_wide", [(100, 60), (90, 50)])
    image_folder(root / "tall", [(60, 100)])
    (root / "tall" / "broken.png").write_bytes(b"not an image")
    data = DataSpec(path=str(root), buckets=BUCKETS)
    records = list_samples(data)
    with pytest.raises(DataError, match="broken.png.*skip_bad_files"):
        assign_buckets(records, data)
    skipping = DataSpec(path=str(root), buckets=BUCKETS, skip_bad_files=True)
    buckets, problems = assign_buckets(records, skipping)
    assert len(problems) == 1 and "broken.png" in problems[0]
    assert bucket_counts(records, buckets) == {"24x40": 1, "32x32": 1, "40x24": 4}  # broken: square; 2_ repeats


def test_resize_covers_the_bucket_and_crops_the_centre():
    image = Image.new("RGB", (100, 50), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 20, 50))  # a white stripe at the far left: 9.6 px of the resized 48
    out = resize_and_crop(image, (40, 24), 0.5, 0.5, flip=False)
    assert out.size == (40, 24)  # covered: 48 x 24 after resizing, 4 px cut from each side
    assert out.getpixel((1, 12))[0] > 240 and out.getpixel((39, 12)) == (0, 0, 0)
    assert resize_and_crop(image, (40, 24), 0.5, 0.5, flip=True).getpixel((38, 12))[0] > 240
    assert resize_and_crop(image, 16, 0.5, 0.5, False).size == (16, 16)  # a square as before


def test_dataset_and_loader_make_one_size_per_step(tmp_path):
    root = image_folder(tmp_path / "data", [(60, 100), (64, 64), (100, 60)] * 4 + [(100, 60)])
    data = DataSpec(path=root, buckets=BUCKETS, random_flip=True, num_workers=0)
    records = list_samples(data)
    dataset = ImageCaptionDataset(data, records, seed=1)
    assert {tuple(dataset[i]["pixel_values"].shape) for i in range(len(dataset))} == {
        (3, 40, 24),
        (3, 32, 32),
        (3, 24, 40),
    }
    plan = make_plan(
        TrainSpec(micro_batch_size=1, gradient_accumulation_steps=2, max_steps=3),
        WORLD2,
        len(records),
        SOURCE,
        bucket_counts(records, assign_buckets(records, data)[0]),
    )
    assert plan.steps_per_epoch == 1 + 1 + 1  # 4, 4 and 5 samples in buckets of a global batch of 4
    for rank in range(2):
        loader, sampler = build_loader(data, plan, rank, 1, records)
        shapes = [tuple(batch["pixel_values"].shape) for batch in loader]
        assert len(shapes) == 6 and all(shapes[2 * s] == shapes[2 * s + 1] for s in range(3))
        assert len(set(shapes)) == 3
        report = bucket_report(sampler, next(iter(build_loader(data, plan, rank, 1, records)[0])))
        assert report["mixed_bucket_steps"] == 0 and report["first_batch_in_bucket"]
        assert report["bucket_steps"] == "24x40: 1, 32x32: 1, 40x24: 1"


def test_grouped_plan_numbers_warnings_and_errors():
    train = TrainSpec(micro_batch_size=2, epochs=2)
    plan = make_plan(train, WORLD2, 30, SOURCE, {"24x40": 9, "32x32": 18, "40x24": 3})
    assert [(g.key, g.samples, g.steps, g.dropped) for g in plan.groups] == [
        ("24x40", 9, 2, 1),
        ("32x32", 18, 4, 2),
        ("40x24", 3, 0, 3),
    ]
    assert (plan.steps_per_epoch, plan.samples_per_epoch, plan.dropped_per_epoch, plan.total_steps) == (6, 24, 6, 12)
    assert plan.micro_batches_per_epoch_per_rank == 6
    texts = [str(w) for w in plan.warnings]
    assert any("data.buckets" in t and "40x24 (3)" in t and "never train" in t for t in texts)
    assert any("leaves out 6 of 30" in t and "24x40: 1, 32x32: 2, 40x24: 3" in t for t in texts)
    assert json.dumps(plan.as_dict())  # plan.json stays writable
    with pytest.raises(SpecError, match="larger than every bucket.*the largest, 32x32, holds 3"):
        make_plan(train, WORLD2, 5, SOURCE, {"24x40": 2, "32x32": 3})


def test_spec_errors_name_the_bucket_keys():
    with pytest.raises(ValidationError, match="not a multiple of 8"):
        DataSpec(buckets={"enabled": True, "step": 12})
    with pytest.raises(ValidationError, match="positive multiples of 8"):
        DataSpec(buckets={"enabled": True, "sizes": [[32, 30]]})
    with pytest.raises(ValidationError, match="step 64 is larger than data.resolution 32"):
        DataSpec(resolution=32, buckets={"enabled": True})
    with pytest.raises(ValidationError, match="below min_aspect"):
        DataSpec(buckets={"min_aspect": 2.0, "max_aspect": 1.0})
    assert DataSpec(resolution=32, buckets={"enabled": True, "sizes": [[48, 24], [32, 32]]})


def test_latent_key_includes_the_bucket_and_stays_the_same_without_one():
    base = dict(
        sample_id="a.png", content_sha256="c" * 64, vae_fingerprint="v" * 64, resolution=32, flip=False, dtype="float32"
    )
    assert latent_key(**base) == latent_key(**base, size=None)
    assert len({latent_key(**base), latent_key(**base, size=(40, 24)), latent_key(**base, size=(24, 40))}) == 3
    records = list_samples(DataSpec(path="builtin:shapes"))[:2]
    hashes = {r.sample_id: "h" for r in records}
    sizes = {r.sample_id: (40, 24) for r in records}
    entries = plan_entries(records, hashes, {"vae": "v"}, 32, False, 0.0, "float32", True, False, sizes)
    assert all(e.size == (40, 24) for e in entries)


def test_checker_names_mixed_steps_wrong_counts_and_disagreeing_ranks():
    expected = Expected(2, 1, 4, 2, 3, 12, bucket_steps="24x40: 1, 32x32: 2")
    good = dict(
        host="h",
        ds_micro_batch=2,
        ds_accumulation=1,
        ds_global_batch=4,
        ds_data_parallel=2,
        loader_micro_batches=3,
        first_batch_size=2,
        num_samples=12,
        bucket_steps="24x40: 1, 32x32: 2",
        bucket_sequence="abc",
    )
    assert find_mismatches([RankReport(rank=r, **good) for r in range(2)], expected) == []
    bad = [
        RankReport(rank=0, **good),
        RankReport(
            rank=1, **{**good, "mixed_bucket_steps": 1, "bucket_sequence": "abd", "first_batch_in_bucket": False}
        ),
    ]
    problems = "\n".join(find_mismatches(bad, expected))
    assert "rank 1 (h): 1 step(s) have a micro batch mixing buckets" in problems
    assert "first batch does not have the first step's bucket size" in problems
    assert "ranks disagree on which bucket each step trains" in problems


def test_validate_prints_the_bucket_plan(capsys, tmp_path):
    root = image_folder(tmp_path / "data", [(60, 100), (64, 64), (100, 60)] * 3 + [(64, 64)])
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "sd"},
                "train": {"micro_batch_size": 1, "epochs": 1},
                "data": {"path": root, "buckets": BUCKETS},
            }
        )
    )
    assert main(["validate", str(spec), "--world-size", "2"]) == 0
    assert "Buckets" in capsys.readouterr().out
    out = plan_text(resolve(spec, world=lambda: world_from_flags(world_size=2)))  # unwrapped, 120 columns
    assert "4 optimizer steps (4 micro-batches per rank, the sum over 3 buckets)" in out
    assert "uses 8 samples, leaves out 2 (drop_last, per bucket)" in out
    assert "  24x40              3 samples, 1 global batch per epoch, leaves out 1" in out
    assert "  32x32              4 samples, 2 global batches per epoch, leaves out 0" in out
    assert "  total              3 buckets: 10 samples, 4 optimizer steps per epoch, leaves out 2" in out
    assert main(["validate", str(spec), "--world-size", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["steps_per_epoch"] == 4 and [g["key"] for g in plan["groups"]] == ["24x40", "32x32", "40x24"]


IMAGE_BUILTINS_32PX = ["tiny-sd", "tiny-sdxl", "tiny-flux", "tiny-qwen-image", "tiny-z-image"]


@pytest.mark.parametrize("name", IMAGE_BUILTINS_32PX)
def test_default_buckets_on_a_32px_built_in_get_validates_error_not_a_traceback(capsys, tmp_path, name):
    """data.resolution left out: the model's native 32 px, below the default step 64. validate used to go on to assign
    the built-in shapes to an empty bucket list (ValueError from min()); now it stops at the step's clear error, the
    same one a video built-in gets."""
    spec = tmp_path / "spec.yaml"
    family = "sd" if name == "tiny-sd" else "sdxl" if name == "tiny-sdxl" else "flow"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": {"family": family, "pretrained": f"builtin:{name}"},
                "train": {"micro_batch_size": 2, "max_steps": 2},
                "data": {"path": "builtin:shapes", "buckets": {"enabled": True}},
            }
        )
    )
    assert main(["validate", str(spec), "--num-gpus", "2"]) == 1
    out = capsys.readouterr()
    errors = [line for line in (out.out + out.err).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.buckets.step: 64 is larger than data.resolution 32" in errors[0], errors
    assert "Use a step of at most data.resolution" in errors[0] and "Traceback" not in out.out + out.err


def test_offline_planning_says_the_buckets_are_unknown(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "sd"},
                "train": {"micro_batch_size": 1, "epochs": 1},
                "data": {"path": str(tmp_path / "elsewhere"), "buckets": BUCKETS},
            }
        )
    )
    resolved = resolve(spec, world=lambda: world_from_flags(world_size=2), num_samples=100)
    assert resolved.plan.groups == () and resolved.plan.steps_per_epoch == 50
    assert any("data.buckets" in str(w) and "overstates the steps per epoch" in str(w) for w in resolved.warnings)
