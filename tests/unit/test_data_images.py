"""dstune.data.images: decoding, crops, flips, caption dropout, bad files, collate. Real image files in tmp_path."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from dstune.data.images import (
    BadSampleError,
    ImageCaptionDataset,
    collate,
    find_bad_images,
    sample_rng,
    to_tensor,
    without_samples,
)
from dstune.data.index import list_samples
from dstune.data.synthetic import render_shape
from dstune.spec.models import DataSpec


def gradient_image(width, height):
    """Every pixel distinct (x in red, y in green, a fixed blue), so any crop offset or flip shows."""
    x = np.linspace(0, 255, width, dtype=np.uint8)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.uint8)[:, None].repeat(width, 1)
    return Image.fromarray(np.stack([x, y, np.full_like(x, 77)], axis=2))


def write_dataset(root, count=6, size=(48, 32)):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        gradient_image(*size).save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(f"caption {i}")
    return root


def dataset(root, seed=0, **data):
    spec = DataSpec(path=str(root), **data)
    return ImageCaptionDataset(spec, list_samples(spec), seed)


def test_sample_contract_and_repeats(tmp_path):
    write_dataset(tmp_path / "ds" / "3_x", count=2)
    write_dataset(tmp_path / "ds", count=1)
    ds = dataset(tmp_path / "ds", resolution=16)
    assert len(ds) == 2 * 3 + 1
    assert [ds.record_at(i).sample_id for i in range(len(ds))] == ["3_x/img0.png"] * 3 + ["3_x/img1.png"] * 3 + [
        "img0.png"
    ]
    item = ds[4]
    assert set(item) == {"pixel_values", "caption", "sample_id", "index", "original_size", "crop_top_left"}
    assert item["pixel_values"].shape == (3, 16, 16) and item["pixel_values"].dtype == torch.float32
    assert -1.0 <= item["pixel_values"].min() and item["pixel_values"].max() <= 1.0
    assert (item["caption"], item["sample_id"], item["index"]) == ("caption 1", "3_x/img1.png", 4)
    with pytest.raises(IndexError):
        ds[7]


def test_centre_crop_resizes_the_shorter_side(tmp_path):
    write_dataset(tmp_path, count=1, size=(64, 32))
    ds = dataset(tmp_path, resolution=16)
    expected = gradient_image(64, 32).resize((32, 16), Image.Resampling.LANCZOS).crop((8, 0, 24, 16))
    assert torch.equal(ds[0]["pixel_values"], to_tensor(expected))
    assert torch.equal(to_tensor(Image.new("RGB", (2, 2), (255, 0, 0)))[:, 0, 0], torch.tensor([1.0, -1.0, -1.0]))


def test_random_crop_flip_and_dropout_come_from_seed_epoch_index_only(tmp_path):
    write_dataset(tmp_path, count=8, size=(64, 32))
    options = dict(resolution=16, center_crop=False, random_flip=True, caption_dropout=0.5)
    first = dataset(tmp_path, **options)
    second = dataset(tmp_path, **options)
    for rng_seed in (1, 2):  # global RNG state must not matter
        torch.manual_seed(rng_seed), np.random.seed(rng_seed), random.seed(rng_seed)
        a = [first[i] for i in range(len(first))]
        b = [second[i] for i in reversed(range(len(second)))][::-1]  # order of access must not matter either
        for x, y in zip(a, b):
            assert torch.equal(x["pixel_values"], y["pixel_values"]) and x["caption"] == y["caption"]
    captions = [s["caption"] for s in a]
    assert "" in captions and any(captions)  # dropout 0.5 over 8 samples: both outcomes (fixed by seed 0)
    first.set_epoch(1)
    changed = [not torch.equal(x["pixel_values"], first[i]["pixel_values"]) for i, x in enumerate(a)]
    assert any(changed)  # a new epoch draws new crops and flips
    other_seed = dataset(tmp_path, seed=1, **options)
    assert any(not torch.equal(x["pixel_values"], other_seed[i]["pixel_values"]) for i, x in enumerate(a))


def test_flip_and_crop_follow_the_documented_draws(tmp_path):
    write_dataset(tmp_path, count=1, size=(64, 32))
    ds = dataset(tmp_path, resolution=16, center_crop=False, random_flip=True)
    resized = gradient_image(64, 32).resize((32, 16), Image.Resampling.LANCZOS)
    flips = set()
    for epoch in range(24):
        ds.set_epoch(epoch)
        flip_draw, _, crop_x, _ = sample_rng(0, epoch, 0).random(4)
        left = int(crop_x * 17)
        expected = resized.crop((left, 0, left + 16, 16))
        if flip_draw < 0.5:
            expected = expected.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        flips.add(bool(flip_draw < 0.5))
        assert torch.equal(ds[0]["pixel_values"], to_tensor(expected)), epoch
    assert flips == {True, False}


def test_caption_dropout_extremes(tmp_path):
    write_dataset(tmp_path, count=4)
    assert all(dataset(tmp_path, caption_dropout=1.0)[i]["caption"] == "" for i in range(4))
    assert all(dataset(tmp_path, caption_dropout=0.0)[i]["caption"] == f"caption {i}" for i in range(4))


def test_transparency_is_composited_on_white(tmp_path):
    image = Image.new("RGBA", (8, 8), (255, 0, 0, 0))  # fully transparent red
    image.save(tmp_path / "clear.png")
    pixels = dataset(tmp_path, resolution=8)[0]["pixel_values"]
    assert torch.equal(pixels, torch.ones(3, 8, 8))


def test_builtin_shapes_through_the_dataset():
    spec = DataSpec(path="builtin:shapes", resolution=32)
    ds = ImageCaptionDataset(spec, list_samples(spec), seed=0)
    image, caption = render_shape(37, 32)
    item = ds[37]
    assert torch.equal(item["pixel_values"], to_tensor(image))
    assert (item["caption"], item["sample_id"]) == (caption, "shapes/000037")


def truncated(path, fmt):
    """Cut 30% off the end of a noisy image: the headers survive, so only decoding the pixels can tell."""
    noise = np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path, fmt)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.7)])


@pytest.fixture
def with_bad_files(tmp_path):
    write_dataset(tmp_path, count=3)
    (tmp_path / "img1.png").write_bytes(b"this is not a png at all")
    truncated(tmp_path / "img3.jpg", "JPEG")  # passes PIL verify(); only decoding finds it
    truncated(tmp_path / "img4.png", "PNG")
    return tmp_path


def test_bad_file_stops_with_its_name(with_bad_files):
    ds = dataset(with_bad_files)
    for index, name in [(1, "img1.png"), (3, "img3.jpg"), (4, "img4.png")]:
        with pytest.raises(BadSampleError) as err:
            ds[index]
        assert err.value.key == "data.path" and name in err.value.message and err.value.path.endswith(name)
        assert "skip_bad_files" in err.value.message
    assert ds[0]["sample_id"] == "img0.png"


def test_bad_file_skipped_by_substituting_the_next_readable_sample(with_bad_files, caplog):
    ds = dataset(with_bad_files, skip_bad_files=True)
    ids = [ds[i]["sample_id"] for i in range(len(ds))]
    assert ids == ["img0.png", "img2.png", "img2.png", "img0.png", "img0.png"]  # 3 -> 4 -> wraps to 0
    assert [ds[i]["index"] for i in range(len(ds))] == list(range(5))
    assert sum("img3.jpg" in r.getMessage() for r in caplog.records) == 1  # logged once per file


def test_find_bad_images_catches_truncated_jpegs_by_rank_share(with_bad_files):
    """The start-up check is validate's (dstune.data.image_check): the JPEG cut short, which PIL's verify() passes,
    is found before step 1 too."""
    records = list_samples(DataSpec(path=str(with_bad_files)))
    found = {r.sample_id: reason for r, reason in find_bad_images(records)}
    assert set(found) == {"img1.png", "img3.jpg", "img4.png"} and "truncated" in found["img3.jpg"]
    shares = [find_bad_images(records, rank, 2) for rank in range(2)]
    assert sorted(r.sample_id for share in shares for r, _ in share) == sorted(found)
    kept = without_samples(records, found)
    assert [r.sample_id for r in kept] == ["img0.png", "img2.png"]
    assert find_bad_images(list_samples(DataSpec())) == []  # built-ins have no files


def test_collate(tmp_path):
    write_dataset(tmp_path, count=3)
    ds = dataset(tmp_path, resolution=8)
    batch = collate([ds[2], ds[0]])
    assert batch["pixel_values"].shape == (2, 3, 8, 8)
    assert batch["caption"] == ["caption 2", "caption 0"]
    assert batch["sample_id"] == ["img2.png", "img0.png"]
    assert batch["index"].dtype == torch.long and batch["index"].tolist() == [2, 0]
