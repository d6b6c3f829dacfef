"""build_loader: identical batches with and without worker processes, epochs reach workers, exact resume,
per-sample results independent of rank and world size, and bad files reported cleanly from workers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

from dstune.data.images import BadSampleError
from dstune.data.index import list_samples
from dstune.data.loader import build_loader
from dstune.spec.models import DataSpec


@dataclass(frozen=True)
class PlanLike:
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    num_samples: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Ten noisy 40x24 images (so crops and flips change pixels), five of them repeated twice: 15 samples."""
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    for i in range(10):
        target = root / ("2_twice" if i < 5 else "once")
        target.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(target / f"{i}.png")
        (target / f"{i}.txt").write_text(f"image {i}")
    return root


def spec(folder, **overrides):
    options = dict(path=str(folder), resolution=16, center_crop=False, random_flip=True, caption_dropout=0.3)
    return DataSpec(**{**options, **overrides})


def run_epochs(data, plan, rank=0, seed=0, epochs=(0,), start_step=0):
    """[(epoch, batch), ...] exactly as a training loop would see them."""
    loader, sampler = build_loader(data, plan, rank, seed, list_samples(data), epochs[0], start_step)
    seen = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        seen.extend((epoch, batch) for batch in loader)
    return seen


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (epoch_a, x), (epoch_b, y) in zip(a, b):
        assert epoch_a == epoch_b
        assert torch.equal(x["index"], y["index"]) and torch.equal(x["pixel_values"], y["pixel_values"])
        assert x["caption"] == y["caption"] and x["sample_id"] == y["sample_id"]


def test_workers_do_not_change_batches_and_see_each_epoch(folder):
    plan = PlanLike(2, 2, 1, 15)  # 3 steps per epoch, 6 micro batches
    in_process = run_epochs(spec(folder, num_workers=0), plan, epochs=(0, 1))
    with_workers = run_epochs(spec(folder, num_workers=2), plan, epochs=(0, 1))
    assert len(in_process) == 12
    assert_same_batches(in_process, with_workers)
    # Epoch 1 is really a new epoch in the workers: a new order, and new crops for the same index.
    assert not torch.equal(with_workers[0][1]["index"], with_workers[6][1]["index"])
    pixels = {}
    for epoch, batch in with_workers:
        for index, image in zip(batch["index"].tolist(), batch["pixel_values"]):
            pixels.setdefault(index, {})[epoch] = image
    both = [p for p in pixels.values() if len(p) == 2]
    assert both and any(not torch.equal(p[0], p[1]) for p in both)


def test_resume_mid_epoch_yields_the_tail(folder):
    data = spec(folder, num_workers=0)
    plan = PlanLike(1, 2, 1, 15)  # 7 steps per epoch
    full = run_epochs(data, plan, epochs=(1, 2))
    resumed = run_epochs(data, plan, epochs=(1, 2), start_step=3)
    assert_same_batches(resumed, full[3 * 2 :])


def test_the_sampler_tracks_consumed_batches_not_prefetched_ones(folder):
    plan = PlanLike(1, 2, 1, 15)  # 7 steps of 2 micro batches
    data = spec(folder, num_workers=2)
    loader, sampler = build_loader(data, plan, 0, 0, list_samples(data), start_epoch=0, start_step=2)
    first = next(iter(loader))  # peeking (the batch check does) changes nothing
    assert len(loader) == (7 - 2) * 2
    iterator = iter(loader)
    consumed = [next(iterator) for _ in range(3)]  # the workers have prefetched more than this
    assert torch.equal(consumed[0]["index"], first["index"])
    assert sampler.state_dict()["epoch"] == 0 and sampler.state_dict()["step"] == 3  # 2 + one whole step
    assert consumed[2]["index"].tolist() == sampler.micro_batch(0, 3, 0)
    rest = list(iterator)
    assert len(rest) == len(loader) - 3 and sampler.position() == (1, 0)


def test_samples_are_identical_on_any_world_size(folder):
    """Rank 0 and 1 of a 2-rank run produce, sample for sample, the tensors of a 1-rank run."""
    data = spec(folder, num_workers=0)
    single = run_epochs(data, PlanLike(2, 2, 1, 15))
    pairs = [run_epochs(data, PlanLike(2, 1, 2, 15), rank=rank) for rank in range(2)]

    def by_index(runs):
        return {
            i: (img, cap) for _, b in runs for i, img, cap in zip(b["index"].tolist(), b["pixel_values"], b["caption"])
        }

    one = by_index(single)
    two = {**by_index(pairs[0]), **by_index(pairs[1])}
    assert one.keys() == two.keys() and len(one) == 12
    assert all(torch.equal(one[i][0], two[i][0]) and one[i][1] == two[i][1] for i in one)


def test_bad_file_in_a_worker_is_one_clean_error(tmp_path):
    for i in range(4):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(tmp_path / f"{i}.png")
    (tmp_path / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    data = DataSpec(path=str(tmp_path), resolution=8, num_workers=1)
    loader, _ = build_loader(data, PlanLike(4, 1, 1, 4), 0, 0, list_samples(data))
    with pytest.raises(BadSampleError) as err:
        next(iter(loader))
    assert str(err.value).startswith("data.path: cannot read image ") and "2.png" in err.value.message
    assert "Traceback" not in str(err.value) and "Caught" not in str(err.value)
