"""The dataset and loader that train from the cache (dstune.cache_build.CacheIndex) instead of the encoders.

A cached sample makes exactly the random choices the image dataset makes for the same (seed, epoch, index) - the
flip and the caption dropout draw (the crop is always the centre) - and then reads the entries for what it chose:
the latent of that orientation, the embedding of that caption (the empty caption when dropped). Batches carry the
encoded tensors under the names `family.encode_batch` returns, plus caption, sample_id and index, so the loop and
the batch check treat them like any other batch.
"""

from __future__ import annotations

import operator

import torch

from dstune.cache import read_entry
from dstune.data.images import BadSampleError, ImageCaptionDataset, crop_fields, decoded_size, sample_rng
from dstune.data.loader import EpochDataLoader, _one_thread_per_worker
from dstune.data.sampler import GlobalBatchSampler


class CachedDataset(ImageCaptionDataset):
    def __init__(self, data, records, seed: int, index):
        super().__init__(data, records, seed)
        self.index = index  # dstune.cache_build.CacheIndex

    def _usable_record(self, position: int):
        """As the image dataset does with data.skip_bad_files: an unreadable sample is replaced by the next one
        (of the same bucket with data.buckets, so the batch keeps one latent size)."""
        size = self.target_size(position)
        for step in range(min(64, len(self))):
            candidate = (position + step) % len(self)
            record = self.record_at(candidate)
            if record.sample_id not in self.index.failed_samples and self.target_size(candidate) == size:
                return record
        raise BadSampleError(f"no cached sample among the 64 from index {position}")

    def __getitem__(self, position: int) -> dict:
        position = operator.index(position)
        if not 0 <= position < len(self):
            raise IndexError(f"sample index {position} out of range 0..{len(self) - 1}")
        if not self.index.latents:
            out = super().__getitem__(position)  # pixels (and the caption) as without a cache
        else:
            flip_draw, dropout_draw, _, _ = sample_rng(self.seed, self.epoch, position).random(4)
            record = self._usable_record(position)
            flip = self.data.random_flip and flip_draw < 0.5
            caption = "" if dropout_draw < self.data.caption_dropout else record.caption
            out = {"caption": caption, "sample_id": record.sample_id, "index": position}
            out.update(read_entry(self.index.latent_paths[(record.sample_id, flip)]))
            size = self.target_size(position)  # the centre crop the cached latent was made from (header only)
            decoded = decoded_size(record, size, self.data.resolution)
            out.update(crop_fields(record, decoded, size, 0.5, 0.5, flip))
        if self.index.text:
            out.update(read_entry(self.index.text_paths[out["caption"]]))
        return out


def collate_cached(samples: list[dict]) -> dict:
    """Every tensor of a sample (pixels or latents, the family's text tensors, the crop fields) stacked."""
    batch = {name: torch.stack([s[name] for s in samples]) for name, value in samples[0].items()
             if torch.is_tensor(value)}
    batch.update(caption=[s["caption"] for s in samples], sample_id=[s["sample_id"] for s in samples],
                 index=torch.tensor([s["index"] for s in samples], dtype=torch.long))
    return batch


def build_cached_loader(data, plan, rank: int, seed: int, records, index, start_epoch: int = 0,
                        start_step: int = 0) -> tuple[EpochDataLoader, GlobalBatchSampler]:
    """dstune.data.loader.build_loader, reading the cache: same sampler, same epochs, same resume position."""
    dataset = CachedDataset(data, records, seed, index)
    sampler = GlobalBatchSampler(len(dataset), plan, rank, seed, start_epoch, start_step,
                                 group_keys=dataset.group_keys())
    loader = EpochDataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_cached, num_workers=data.num_workers,
        persistent_workers=False, worker_init_fn=_one_thread_per_worker if data.num_workers > 0 else None,
        pin_memory=torch.cuda.is_available(), generator=torch.Generator().manual_seed(seed))
    return loader, sampler
