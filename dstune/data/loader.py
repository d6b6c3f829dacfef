"""The training loader: dataset + global-epoch sampler + collate, wired so that epochs and resume are exact.

Epoch to workers: workers are fresh processes every epoch (persistent_workers is off), and `EpochDataLoader`
sets the dataset's epoch from the sampler just before it starts them, so each worker's copy of the dataset
carries the right epoch. Consumption: the loader tells the sampler about every batch it hands to training
(not the ones workers prefetched), so `sampler.state_dict()` is always the true position for a checkpoint.

Usage (one epoch per `for` over the loader):
    loader, sampler = build_loader(spec.data, plan, rank, spec.train.seed, records, start_epoch, start_step)
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)          # keeps the resume step for the start epoch
        for batch in loader: ...
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from dstune.card import CAUSAL_4X, ClipRule
from dstune.data.groups import key_label
from dstune.data.images import ImageCaptionDataset, collate
from dstune.data.index import SampleRecord
from dstune.data.sampler import GlobalBatchSampler
from dstune.spec.models import DataSpec


def one_thread_per_worker(worker_id: int) -> None:
    # Workers only decode and resize; with several workers per rank, extra intra-op threads oversubscribe the cores.
    torch.set_num_threads(1)


SPATIAL_TENSORS = ("pixel_values", "latent_mean")  # batch tensors (B, C, H, W) or (B, C, frames, H, W)


def batch_spatial_size(batch: dict) -> tuple[str, tuple[int, ...]] | None:
    """(tensor name, (height, width)) of the first image-like tensor of a batch, (frames, height, width) of a clip
    batch's, or None when it has none."""
    for name in SPATIAL_TENSORS:
        if name in batch:
            return name, tuple(int(side) for side in batch[name].shape[2:])
    return None


def size_matches_bucket(batch: dict, bucket: tuple[int, ...], rule: ClipRule = CAUSAL_4X) -> bool:
    """Pixels must be exactly the bucket's (width, height) - a clip bucket's (frames, width, height) - ; latents must
    have its aspect ratio (their scale is the VAE's) and a clip's latents the latent frames the model's clip rule
    (its card's clip_rule, handed to make_loader) gives its frames."""
    found = batch_spatial_size(batch)
    if found is None:
        return True
    name, shape = found
    frames, (width, height) = (bucket[0], bucket[1:]) if len(bucket) == 3 else (None, bucket)
    if (frames is None) != (len(shape) == 2):
        return False
    if name == "pixel_values":
        return shape == ((frames,) if frames else ()) + (height, width)
    if frames is not None and shape[0] != rule.latent_frames(frames):
        return False
    return shape[-1] * height == shape[-2] * width


class EpochDataLoader(DataLoader):
    """A DataLoader over a GlobalBatchSampler that syncs the dataset's epoch and reports consumed batches.
    With groups (data.buckets) it also checks that every batch has its step's bucket size: a batch of another
    size stops training with the step and both sizes named, instead of training on a mixed step. `clip_rule`: the
    model's (a video model's latent frames per clip), set by make_loader."""

    clip_rule: ClipRule = CAUSAL_4X

    def __iter__(self):
        sampler: GlobalBatchSampler = self.batch_sampler
        self.dataset.set_epoch(sampler.epoch)  # before workers start, so their dataset copies see it
        epoch, first_step = sampler.epoch, sampler.start_step
        for number, batch in enumerate(super().__iter__()):
            if sampler.grouped is not None:
                step = first_step + number // sampler.accumulation
                bucket = sampler.step_group(epoch, step)
                if not size_matches_bucket(batch, bucket, self.clip_rule):
                    raise RuntimeError(
                        f"epoch {epoch} step {step}: the loader made a batch of {batch_spatial_size(batch)}, but the "
                        f"step's bucket is {key_label(bucket)}. Every micro batch of a step must "
                        "have its bucket's size; this is a dstune bug, please report it."
                    )
            sampler.record_consumed(1)
            yield batch


def make_loader(
    dataset,
    collate_fn,
    group_keys,
    data: DataSpec,
    plan,
    rank: int,
    seed: int,
    start_epoch: int = 0,
    start_step: int = 0,
    speakers=None,
    sets=None,
    set_places=None,
    clip_rule: ClipRule = CAUSAL_4X,
) -> tuple[EpochDataLoader, GlobalBatchSampler]:
    """This rank's loader and its sampler over any dataset kind (images, cached images, speech, cached speech),
    positioned at (start_epoch, start_step). `plan` is a dstune.plan.Plan made for exactly this dataset
    (len(dataset) = plan.num_samples); `group_keys` are the per-index bucket keys, or None; `sets` the per-index
    set numbers of data.sets (an image dataset's `set_numbers()`), or None, and `set_places` each set's places per
    epoch with set weights (its `set_places()`)."""
    sampler = GlobalBatchSampler(
        len(dataset),
        plan,
        rank,
        seed,
        start_epoch,
        start_step,
        group_keys=group_keys,
        speakers=speakers,
        sets=sets,
        set_places=set_places,
    )
    loader = EpochDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        num_workers=data.num_workers,
        persistent_workers=False,  # required: a persistent worker would keep the epoch it was started with
        worker_init_fn=one_thread_per_worker if data.num_workers > 0 else None,
        pin_memory=torch.cuda.is_available(),
        # The loader's own base seed comes from this generator, not from (and without advancing) global RNG state.
        generator=torch.Generator().manual_seed(seed),
    )
    loader.clip_rule = clip_rule
    return loader, sampler


def build_loader(
    data: DataSpec, plan, rank: int, seed: int, records: list[SampleRecord], start_epoch: int = 0, start_step: int = 0
) -> tuple[EpochDataLoader, GlobalBatchSampler]:
    """make_loader over the image dataset (decoding the files) of these records."""
    dataset = ImageCaptionDataset(data, records, seed)
    return make_loader(
        dataset,
        collate,
        dataset.group_keys(),
        data,
        plan,
        rank,
        seed,
        start_epoch,
        start_step,
        sets=dataset.set_numbers(),
        set_places=dataset.set_places(),
    )
