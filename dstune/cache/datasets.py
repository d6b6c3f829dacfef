"""The datasets that train from the caches instead of the encoders: images (dstune.cache.latents.CacheIndex) and
speech (codec tokens, dstune.cache.codec_tokens).

A cached sample makes exactly the random choices the image dataset makes for the same (seed, epoch, index) - the
flip and the caption dropout draw (the crop is always the centre) - and then reads the entries for what it chose:
the latent of that orientation (and the loss mask cached beside it), the embedding of that caption (the empty caption
when dropped), and with data.sets the set's weight and role. Batches carry the
encoded tensors under the names `family.encode_batch` returns, plus caption, sample_id and index, so the loop and
the batch check treat them like any other batch.
"""

from __future__ import annotations

import operator
from pathlib import Path

import torch
from torch.utils.data import Dataset

from dstune.cache.entries import read_entry
from dstune.data.audio_index import AudioRecord
from dstune.data.images import (
    BadSampleError,
    ImageCaptionDataset,
    collate_loss_terms,
    crop_fields,
    decoded_size,
    sample_rng,
    stack_references,
)
from dstune.data.pairs import reference_key, reference_suffix
from dstune.data.video import VideoCaptionDataset, stack_sounds


class CachedDataset(ImageCaptionDataset):
    def __init__(self, data, records, seed: int, index):
        super().__init__(data, records, seed)
        self.index = index  # dstune.cache.latents.CacheIndex

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
            out = {"caption": self.caption_of(record, dropout_draw), "sample_id": record.sample_id, "index": position}
            out.update(read_entry(self.index.latent_paths[(record.sample_id, flip)]))  # with its loss_mask, if masked
            out.update(self.set_fields(self.record_at(position)))
            size = self.target_size(position)  # the centre crop the cached latent was made from (header only)
            decoded = decoded_size(record, size, self.rendered_side(record))
            out.update(crop_fields(record, decoded, size, 0.5, 0.5, flip))
            for number in range(len(record.control_paths)):  # edit pairs: each reference's cached latents, and
                # its pixels, which the text side needs (the instruction is encoded with the images)
                source = read_entry(self.index.latent_paths[(record.sample_id + reference_suffix(number), flip)])
                out.update({reference_key(f"control_{name}", number): value for name, value in source.items()})
            out.update(self.control_pixels(record, size, 0.5, 0.5, flip))
        if self.index.text:
            out.update(read_entry(self.index.text_paths[out["caption"]]))
        return out


class CachedVideoDataset(VideoCaptionDataset):
    """Clips from the cache: the video dataset's caption-dropout draw, then the clip's latent entry (or its
    pixels without data.cache.latents) and the caption's text entry."""

    def __init__(self, data, records, seed: int, index, sound_rate: int | None = None):
        super().__init__(data, records, seed, sound_rate)
        self.index = index  # dstune.cache.latents.CacheIndex

    def __getitem__(self, position: int) -> dict:
        position = operator.index(position)
        if not 0 <= position < len(self):
            raise IndexError(f"sample index {position} out of range 0..{len(self) - 1}")
        if not self.index.latents:
            out = super().__getitem__(position)  # pixels, and the sound when the model trains on it
        else:
            _, dropout_draw, _, _ = sample_rng(self.seed, self.epoch, position).random(4)
            record = self.record_at(position)
            out = {"caption": self.caption_of(record, dropout_draw), "sample_id": record.sample_id, "index": position}
            out.update(read_entry(self.index.latent_paths[(record.sample_id, False)]))  # with its loss_mask, if masked
            out.update(self.set_fields(record))
            if record.control_paths:  # in-context control: the reference clip's posterior mean, cached beside it
                reference = read_entry(self.index.latent_paths[(record.sample_id + reference_suffix(0), False)])
                out["control_latent_mean"] = reference["latent_mean"]
                if "sound_latent" in reference:  # its sound's latents, cached beside it as a clip's are
                    out["control_sound_latent"] = reference["sound_latent"]
                    out["control_has_sound"] = reference["has_sound"]
        if self.index.text:
            out.update(read_entry(self.index.text_paths[out["caption"]]))
        return out


def collate_cached(samples: list[dict]) -> dict:
    """Every tensor of a sample (pixels or latents, the family's text tensors, the crop fields) stacked; a clip's
    sound read from its file (not cached) as collate_video stacks it."""
    batch = {
        name: stack_references(samples, name)
        if name.startswith("control_")
        else torch.stack([s[name] for s in samples])
        for name, value in samples[0].items()
        if torch.is_tensor(value) and name != "sound"  # has_sound: a tensor from the latent entry, else a bool
    }
    batch.update(collate_loss_terms(samples))
    batch.update(stack_sounds(samples))
    if "control_has_sound" in samples[0] and not torch.is_tensor(samples[0]["control_has_sound"]):  # read, not cached
        batch["control_has_sound"] = torch.tensor([s["control_has_sound"] for s in samples], dtype=torch.bool)
    batch.update(
        caption=[s["caption"] for s in samples],
        sample_id=[s["sample_id"] for s in samples],
        index=torch.tensor([s["index"] for s in samples], dtype=torch.long),
    )
    return batch


class CachedSpeechDataset(Dataset):
    """Like dstune.data.audio.SpeechDataset, but each item carries its cached `codes` instead of the audio."""

    def __init__(self, records: list[AudioRecord], paths: dict[str, Path]):
        self.records = [r for r in records for _ in range(r.repeats)]
        self.paths = paths

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        codes = read_entry(self.paths[record.sample_id])["codes"]
        codes = codes if codes.is_floating_point() else codes.long()  # codec codes, or a family's float latents
        return {
            "index": index,
            "sample_id": record.sample_id,
            "codes": codes,
            "text": record.caption,
            "speaker": record.speaker,
        }

    @staticmethod
    def collate(samples: list[dict]) -> dict:
        return {
            "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
            "sample_ids": [s["sample_id"] for s in samples],
            "codes": [s["codes"] for s in samples],
            "texts": [s["text"] for s in samples],
            "speakers": [s["speaker"] for s in samples],
        }
