"""The image-caption torch Dataset: decode, resize, crop, flip, caption dropout, collate.

Indices are positions in the expanded list (a sample with repeats=3 owns three consecutive indices).
Every random choice for a sample (crop offset, flip, caption dropout) comes from its own generator seeded by
(seed, epoch, index), never from global RNG state, so the result is the same whatever the worker count, rank or
world size. The epoch reaches worker processes because dstune's loader copies the dataset into fresh workers at
the start of every epoch (persistent_workers is off; see dstune.data.loader).

Bad files. Checking every image up front is too slow for big sets, so there are two layers:
  1. `find_bad_images(records, rank, world_size)`: a quick PIL `verify()` (header and structure, PNG checksums)
     of this rank's share, run once before training. The caller gathers the bad ids from all ranks and drops them
     from every rank's records with `without_samples`, then plans on what is left, so all ranks agree.
  2. Whatever slips through (JPEG `verify()` does not decode pixel data): with data.skip_bad_files the dataset
     deterministically substitutes the next readable sample (index + 1, + 2, ...) and logs the file once per
     process, so an epoch never crashes; without it, `BadSampleError` names the file and the reason.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import operator

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from dstune.data.index import DataError, SampleRecord
from dstune.data.shapes import render_shape
from dstune.spec.models import DataSpec

log = logging.getLogger("dstune.data")
_SAMPLE_SALT = 0x1_3A6E  # separates per-sample streams from the sampler's order stream (same seed)
_MAX_SUBSTITUTE_TRIES = 64
_VERIFY_DECODE_SIZE = 64  # JPEG draft size for full_decode checks: every byte is still read
_DECODE_ERRORS = (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError)


class BadSampleError(DataError):
    """An image that cannot be read. Built from one message so it survives DataLoader's worker re-raise."""

    def __init__(self, message: str, path: str | None = None):
        self.path = path
        super().__init__("data.path", _without_worker_traceback(message, "data.path"))


def _without_worker_traceback(message: str, key: str) -> str:
    """A DataLoader worker re-raises as BadSampleError("Caught BadSampleError in DataLoader worker ... Traceback");
    keep only our own message so the user sees one clean line."""
    marker = f"{BadSampleError.__module__}.{BadSampleError.__qualname__}: "
    if message.startswith("Caught ") and marker in message:
        message = message.rsplit(marker, 1)[1].rstrip("\n")
        if message.startswith(f"{key}: "):
            message = message[len(key) + 2:]
    return message


def sample_rng(seed: int, epoch: int, index: int, stream: int = 0) -> np.random.Generator:
    """The generator for one sample's random choices. Stream 0 is the data transforms; other users (a family's
    per-sample noise, say) pass their own stream number so their draws are independent of the crops and flips."""
    return np.random.default_rng([_SAMPLE_SALT, stream, seed, epoch, index])


def _open_rgb(path: str, resolution: int) -> Image.Image:
    with Image.open(path) as image:
        if image.format == "JPEG":
            image.draft("RGB", (resolution, resolution))  # DCT downscale while decoding: much faster for big JPEGs
        image = ImageOps.exif_transpose(image)  # phone photos store their rotation in EXIF
        if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
            # Transparent pixels have arbitrary colours; composite onto white as an image viewer would show them.
            rgba = image.convert("RGBA")
            canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(canvas, rgba).convert("RGB")
        return image.convert("RGB")


def resize_and_crop(image: Image.Image, resolution: int, crop_x: float, crop_y: float, flip: bool) -> Image.Image:
    """Shorter side to `resolution` (Lanczos), then a square crop at fractions crop_x, crop_y of the free room."""
    width, height = image.size
    scale = resolution / min(width, height)
    new_size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
    if new_size != image.size:
        image = image.resize(new_size, Image.Resampling.LANCZOS)
    left = min(int(crop_x * (new_size[0] - resolution + 1)), new_size[0] - resolution)
    top = min(int(crop_y * (new_size[1] - resolution + 1)), new_size[1] - resolution)
    image = image.crop((left, top, left + resolution, top + resolution))
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float32 (3, H, W) in [-1, 1]."""
    array = np.asarray(image, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)


class ImageCaptionDataset(torch.utils.data.Dataset):
    def __init__(self, data: DataSpec, records: list[SampleRecord], seed: int):
        if not records:
            raise DataError("data.path", "the dataset has no samples")
        self.data = data
        self.records = list(records)
        self.seed = seed
        self.epoch = 0
        self._ends = list(itertools.accumulate(r.repeats for r in self.records))  # expanded index -> record
        self._logged_bad: set[str] = set()

    def __len__(self) -> int:
        return self._ends[-1]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def record_at(self, index: int) -> SampleRecord:
        return self.records[bisect.bisect_right(self._ends, index)]

    def load_image(self, record: SampleRecord) -> Image.Image:
        """The record's image as RGB; raises BadSampleError naming the file and the reason."""
        if record.image_path is None:
            number = int(record.sample_id.rsplit("/", 1)[1])
            return render_shape(number, self.data.resolution)[0]
        try:
            return _open_rgb(record.image_path, self.data.resolution)
        except _DECODE_ERRORS as err:
            reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
            raise BadSampleError(
                f"cannot read image {record.image_path} (sample {record.sample_id}): {reason}. Replace or delete "
                "the file, or set data.skip_bad_files: true to skip unreadable images.", record.image_path) from None

    def _readable(self, index: int) -> tuple[SampleRecord, Image.Image]:
        """The record at `index` and its image; with skip_bad_files, the next readable one instead of a bad one."""
        record = self.record_at(index)
        try:
            return record, self.load_image(record)
        except BadSampleError as first_error:
            if not self.data.skip_bad_files:
                raise
            last = first_error
        tries = min(_MAX_SUBSTITUTE_TRIES, len(self))
        for step in range(1, tries):
            if record.image_path not in self._logged_bad:
                self._logged_bad.add(record.image_path)
                log.warning("skipping unreadable image (data.skip_bad_files): %s", last.message)
            record = self.record_at((index + step) % len(self))
            try:
                return record, self.load_image(record)
            except BadSampleError as err:
                last = err
        raise BadSampleError(f"no readable image among {tries} samples from index {index}; "
                             f"last problem: {last.message}")

    def __getitem__(self, index: int) -> dict:
        index = operator.index(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range 0..{len(self) - 1}")
        # Always draw all four numbers, in this order, so switching one option does not shift the others.
        flip_draw, dropout_draw, crop_x, crop_y = sample_rng(self.seed, self.epoch, index).random(4)
        record, image = self._readable(index)
        if self.data.center_crop:
            crop_x = crop_y = 0.5
        flip = self.data.random_flip and flip_draw < 0.5
        image = resize_and_crop(image, self.data.resolution, crop_x, crop_y, flip)
        caption = "" if dropout_draw < self.data.caption_dropout else record.caption
        return {"pixel_values": to_tensor(image), "caption": caption, "sample_id": record.sample_id, "index": index}


def collate(samples: list[dict]) -> dict:
    """Samples -> one batch with the same keys as a sample (as torch's default_collate would name them):
    pixel_values (B, 3, R, R) float32; caption and sample_id lists of str; index (B,) LongTensor."""
    return {
        "pixel_values": torch.stack([s["pixel_values"] for s in samples]),
        "caption": [s["caption"] for s in samples],
        "sample_id": [s["sample_id"] for s in samples],
        "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
    }


def find_bad_images(
    records: list[SampleRecord], rank: int = 0, world_size: int = 1, full_decode: bool = False
) -> list[tuple[SampleRecord, str]]:
    """Check this rank's share (records[rank::world_size]): (record, reason) for each unreadable image.

    Default: PIL `verify()`, which catches missing, non-image, unknown-format and structurally broken files (and
    truncated PNGs) without decoding pixels. full_decode=True also decodes the pixels (JPEGs at reduced scale),
    which catches truncated JPEG/BMP data too, at several times the cost. Gather all ranks' results before
    excluding anything."""
    bad = []
    for record in records[rank::world_size]:
        if record.image_path is None:
            continue
        try:
            with Image.open(record.image_path) as image:
                image.verify()
            if full_decode:
                _open_rgb(record.image_path, _VERIFY_DECODE_SIZE)
        except _DECODE_ERRORS as err:
            bad.append((record, getattr(err, "strerror", None) or str(err) or type(err).__name__))
    return bad


def without_samples(records: list[SampleRecord], sample_ids) -> list[SampleRecord]:
    """`records` minus the given sample ids, order kept (the sampler's order depends only on what remains)."""
    drop = set(sample_ids)
    return [r for r in records if r.sample_id not in drop]
