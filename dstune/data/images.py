"""The image-caption torch Dataset: decode, resize, crop, flip, caption dropout, collate.

Indices are positions in the expanded list (a sample with repeats=3 owns three consecutive indices).
Every random choice for a sample (crop offset, flip, caption dropout) comes from its own generator seeded by
(seed, epoch, index), never from global RNG state, so the result is the same whatever the worker count, rank or
world size. The epoch reaches worker processes because dstune's loader copies the dataset into fresh workers at
the start of every epoch (persistent_workers is off; see dstune.data.loader).

Bad files, in two layers:
  1. `find_bad_images(records, rank, world_size)`: dstune.data.image_check's check (PIL `verify()`, and JPEGs cut
     short) of this rank's share, run once before training; `dstune validate` makes the same check of every file.
     The caller gathers the bad files from all ranks: it stops naming them, or with data.skip_bad_files reports them
     (the dataset then substitutes them, below), so the plan's numbers stay what validate printed.
  2. Whatever slips through (pixel data broken inside a complete file): with data.skip_bad_files the dataset
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

from dstune.data.buckets import header_size, record_sizes
from dstune.data.groups import weighted_places
from dstune.data.image_check import find_unreadable
from dstune.data.index import DataError, SampleRecord
from dstune.data.pairs import is_reference, own_reference_size, reference_key
from dstune.data.synthetic import render_shape
from dstune.spec.models import DataSpec

log = logging.getLogger("dstune.data")
_SAMPLE_SALT = 0x1_3A6E  # separates per-sample streams from the sampler's order stream (same seed)
_MAX_SUBSTITUTE_TRIES = 64
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
            message = message[len(key) + 2 :]
    return message


def sample_rng(seed: int, epoch: int, index: int, stream: int = 0) -> np.random.Generator:
    """The generator for one sample's random choices. Stream 0 is the data transforms; other users (a family's
    per-sample noise, say) pass their own stream number so their draws are independent of the crops and flips."""
    return np.random.default_rng([_SAMPLE_SALT, stream, seed, epoch, index])


def _open_rgb(path: str, resolution) -> Image.Image:
    """`resolution`: the side of the square, or (width, height) of the bucket, the image will be cropped to."""
    width, height = (resolution, resolution) if isinstance(resolution, int) else resolution
    with Image.open(path) as image:
        if image.format == "JPEG":
            image.draft("RGB", (width, height))  # DCT downscale while decoding: much faster for big JPEGs
        image = ImageOps.exif_transpose(image)  # phone photos store their rotation in EXIF
        if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
            # Transparent pixels have arbitrary colours; composite onto white as an image viewer would show them.
            rgba = image.convert("RGBA")
            canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(canvas, rgba).convert("RGB")
        return image.convert("RGB")


def resize_and_crop(image: Image.Image, resolution, crop_x: float, crop_y: float, flip: bool) -> Image.Image:
    """Resize (Lanczos) to cover `resolution` - a square side, or a bucket's (width, height) - keeping the aspect
    ratio, then crop that size at fractions crop_x, crop_y of the free room."""
    new_size, (left, top, right, bottom) = crop_geometry(image.size, resolution, crop_x, crop_y)
    if new_size != image.size:
        image = image.resize(new_size, Image.Resampling.LANCZOS)
    image = image.crop((left, top, right, bottom))
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image


def resize_whole(image: Image.Image, size: tuple[int, int], flip: bool) -> Image.Image:
    """The whole image resized (Lanczos) to exactly `size` (width, height), no crop; flipped or not."""
    if image.size != tuple(size):
        image = image.resize(tuple(size), Image.Resampling.LANCZOS)
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image


def _unreadable_reference(path: str, record: SampleRecord, err: Exception) -> "BadSampleError":
    reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return BadSampleError(
        f"cannot read source image {path} (of sample {record.sample_id}): {reason}. Replace or delete it, or set "
        "data.skip_bad_files: true.",
        path,
    )


def crop_geometry(size: tuple[int, int], resolution, crop_x: float, crop_y: float):
    """resize_and_crop's arithmetic: (resized (width, height), crop box (left, top, right, bottom)) for an image
    of `size` (width, height) cropped to `resolution` (a square side, or a bucket's (width, height))."""
    target_w, target_h = (resolution, resolution) if isinstance(resolution, int) else resolution
    width, height = size
    scale = max(target_w / width, target_h / height)
    new_size = (max(target_w, round(width * scale)), max(target_h, round(height * scale)))
    left = min(int(crop_x * (new_size[0] - target_w + 1)), new_size[0] - target_w)
    top = min(int(crop_y * (new_size[1] - target_h + 1)), new_size[1] - target_h)
    return new_size, (left, top, left + target_w, top + target_h)


# The UNet with size/crop time ids conditions on each sample's original size and crop position (diffusers' reference script
# train_text_to_image_sdxl.py: original_sizes and crop_top_lefts). Every batch carries both, so the numbers are the
# crop really made; families that do not use them ignore the two keys.
def crop_fields(
    record: SampleRecord, decoded_size: tuple[int, int], resolution, crop_x: float, crop_y: float, flip: bool
) -> dict:
    """{"original_size": LongTensor([height, width]) of the file as shown (before any resize or JPEG draft
    decoding), "crop_top_left": LongTensor([top, left]) of the crop in the resized image}, for an image decoded at
    `decoded_size` (width, height). A flipped crop's left is measured in the flipped image, where it really sits."""
    new_size, (left, top, right, _) = crop_geometry(decoded_size, resolution, crop_x, crop_y)
    if flip:
        left = new_size[0] - right
    if record.image_path is None:
        original = decoded_size
    else:
        original = header_size(record.image_path)
    return {
        "original_size": torch.tensor([original[1], original[0]], dtype=torch.long),
        "crop_top_left": torch.tensor([top, left], dtype=torch.long),
    }


def decoded_size(record: SampleRecord, resolution, rendered_side: int) -> tuple[int, int]:
    """The (width, height) `load_image(record, resolution)` decodes the record at, from the header alone (JPEG draft
    scale included): what the cache's loader needs to know the crop without decoding the pixels. Built-in samples
    are rendered at `rendered_side` (data.resolution) whatever the target size."""
    if record.image_path is None:
        return (rendered_side, rendered_side)
    width, height = (resolution, resolution) if isinstance(resolution, int) else resolution
    shown = header_size(record.image_path)
    with Image.open(record.image_path) as image:
        stored = image.size
        if image.format == "JPEG":
            image.draft("RGB", (width, height))
        decoded = image.size
    return decoded if shown == stored else (decoded[1], decoded[0])


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
        self.record_sizes = self.bucket_of_records()  # data.buckets: each record's (width, height), else None
        self.set_specs = data.set_specs()  # each set's settings (data.sets), or [data]
        self.masked = data.masked  # every sample carries a loss mask (ones where its set has none)
        self.own_references = data.reference_size == "own"  # each reference at its own size (dstune.data.pairs)

    def __len__(self) -> int:
        return self._ends[-1]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def record_at(self, index: int) -> SampleRecord:
        return self.records[bisect.bisect_right(self._ends, index)]

    def bucket_of_records(self) -> list | None:
        """The (width, height) each record trains at (its bucket from its header, or its set's square: data.sets),
        or None when all train at data.resolution's square (dstune.data.buckets.record_sizes)."""
        return record_sizes(self.records, self.data)[0]

    def target_size(self, index: int):
        """What sample `index` is cropped to: data.resolution, or its bucket's (width, height). Decided by the index,
        not by a substitute for an unreadable file, so a batch of one bucket keeps one size."""
        if self.record_sizes is None:
            return self.data.resolution
        return self.record_sizes[bisect.bisect_right(self._ends, index)]

    def rendered_side(self, record: SampleRecord) -> int:
        """The side a built-in sample is rendered at: its set's resolution (data.resolution with data.path)."""
        return self.set_specs[record.set_index].resolution

    def set_numbers(self) -> list[int] | None:
        """The set number of every index (data.sets, for the sampler's interleaving), or None with data.path."""
        if self.data.sets is None:
            return None
        return [record.set_index for record in self.records for _ in range(record.repeats)]

    def set_places(self) -> list[int] | None:
        """With set weights (data.sets), each set's places per epoch (dstune.data.groups.weighted_places); else None."""
        if self.data.sets is None or self.data.sets[0].weight is None:
            return None
        samples = [0] * len(self.data.sets)
        for record in self.records:
            samples[record.set_index] += record.repeats
        return weighted_places(samples, [item.weight for item in self.data.sets])

    def set_fields(self, record: SampleRecord) -> dict:
        """With data.sets, the sample's `loss_weight`, `prior` (its set's role is regularization) and `preserve`
        (preservation); else {}."""
        if self.data.sets is None:
            return {}
        item = self.data.sets[record.set_index]
        return {
            "loss_weight": item.loss_weight,
            "prior": item.role == "regularization",
            "preserve": item.role == "preservation",
        }

    def caption_of(self, record: SampleRecord, dropout_draw: float) -> str:
        """The caption trained: empty when the draw falls under its set's caption_dropout."""
        return "" if dropout_draw < self.set_specs[record.set_index].caption_dropout else record.caption

    def loss_mask(self, record: SampleRecord, decoded: tuple[int, int], size, crop_x: float, crop_y: float, flip: bool):
        """{"loss_mask": (1, H, W) in [0, 1]} cut exactly as the image decoded at `decoded` (width, height) is cut
        to `size`; ones where the sample has no mask (an image without one, or without alpha); {} unmasked runs."""
        if not self.masked:
            return {}
        mask = read_mask(record, self.set_specs[record.set_index].alpha_mask)
        width, height = (size, size) if isinstance(size, int) else size
        if mask is None:
            return {"loss_mask": torch.ones(1, height, width)}
        if mask.size != decoded:  # a mask file of another size, or an image decoded at a JPEG draft scale
            mask = mask.resize(decoded, Image.Resampling.BILINEAR)
        cut = resize_and_crop(mask, size, crop_x, crop_y, flip)
        return {"loss_mask": torch.from_numpy(np.asarray(cut, dtype=np.float32) / 255.0).unsqueeze(0)}

    def cache_mask(self, record: SampleRecord, size, flip: bool) -> torch.Tensor | None:
        """What the latent cache stores beside the record's latents: its mask at the centre crop (None unmasked)."""
        if not self.masked:
            return None
        decoded = decoded_size(record, size or self.data.resolution, self.rendered_side(record))
        return self.loss_mask(record, decoded, size or self.data.resolution, 0.5, 0.5, flip)["loss_mask"]

    def group_keys(self) -> list | None:
        """The bucket of every index (for the grouped sampler), or None without data.buckets."""
        if self.record_sizes is None:
            return None
        return [self.target_size(index) for index in range(len(self))]

    def load_image(self, record: SampleRecord, size=None) -> Image.Image:
        """The record's image as RGB; raises BadSampleError naming the file and the reason. `size`: what it will be
        cropped to (default data.resolution), so JPEGs decode at a reduced scale that still covers it."""
        if record.image_path is None:
            number = int(record.sample_id.rsplit("/", 1)[1])
            return render_shape(number, self.rendered_side(record))[0]
        try:
            return _open_rgb(record.image_path, size or self.data.resolution)
        except _DECODE_ERRORS as err:
            reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
            raise BadSampleError(
                f"cannot read image {record.image_path} (sample {record.sample_id}): {reason}. Replace or delete "
                "the file, or set data.skip_bad_files: true to skip unreadable images.",
                record.image_path,
            ) from None

    def cache_pixels(self, record: SampleRecord, size, flip: bool) -> torch.Tensor:
        """What the latent cache encodes for the record: its centre crop at `size`, flipped or not (a reference
        with data.reference_size own: the whole image resized to `size`, its own size)."""
        if self.own_references and is_reference(record.sample_id):
            return to_tensor(resize_whole(self.load_image(record, size), size, flip))
        return to_tensor(resize_and_crop(self.load_image(record, size), size or self.data.resolution, 0.5, 0.5, flip))

    def reference_sizes(self, record: SampleRecord, size) -> list[tuple[int, int]]:
        """data.reference_size own: the (width, height) each of the record's references trains at, for its target's
        `size` (from the files' headers; BadSampleError naming an unreadable one)."""
        found = []
        for path in record.control_paths:
            try:
                found.append(own_reference_size(header_size(path), size))
            except _DECODE_ERRORS as err:
                raise _unreadable_reference(path, record, err) from None
        return found

    def control_pixels(self, record: SampleRecord, size, crop_x: float, crop_y: float, flip: bool):
        """Edit pairs: each of the record's references resized and cropped exactly as its target (to the target's
        size: data.resolution or its bucket, same crop fractions, same flip), or with data.reference_size own
        resized whole to its own size (dstune.spec.reference_sizes.own_reference_size) and flipped with its target, as
        (3, H, W) tensors keyed `control_values`, `control_values_2`, ... (dstune.data.pairs.reference_key); {}
        unpaired."""
        found = {}
        own = self.reference_sizes(record, size) if self.own_references else None
        for number, path in enumerate(record.control_paths):
            try:
                image = _open_rgb(path, own[number] if own else size)
            except _DECODE_ERRORS as err:
                raise _unreadable_reference(path, record, err) from None
            sized = (
                resize_whole(image, own[number], flip) if own else resize_and_crop(image, size, crop_x, crop_y, flip)
            )
            found[reference_key("control_values", number)] = to_tensor(sized)
        return found

    def _readable(self, index: int) -> tuple[SampleRecord, Image.Image]:
        """The record at `index` and its image; with skip_bad_files, the next readable one instead of a bad one."""
        record, size = self.record_at(index), self.target_size(index)
        try:
            return record, self.load_image(record, size)
        except BadSampleError as first_error:
            if not self.data.skip_bad_files:
                raise
            last = first_error
        tries = min(_MAX_SUBSTITUTE_TRIES, len(self))
        for step in range(1, tries):
            if record.image_path not in self._logged_bad:
                self._logged_bad.add(record.image_path)
                log.warning("skipping unreadable image (data.skip_bad_files): %s", last.message)
            if self.target_size((index + step) % len(self)) != size:
                continue  # with data.buckets the substitute comes from the same bucket, as from the cache
            record = self.record_at((index + step) % len(self))
            try:
                return record, self.load_image(record, size)
            except BadSampleError as err:
                last = err
        raise BadSampleError(
            f"no readable image among {tries} samples from index {index}; last problem: {last.message}"
        )

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
        geometry = crop_fields(record, image.size, self.target_size(index), crop_x, crop_y, flip)
        control = self.control_pixels(record, self.target_size(index), crop_x, crop_y, flip)
        mask = self.loss_mask(record, image.size, self.target_size(index), crop_x, crop_y, flip)
        image = resize_and_crop(image, self.target_size(index), crop_x, crop_y, flip)
        return {
            "pixel_values": to_tensor(image),
            "caption": self.caption_of(record, dropout_draw),
            "sample_id": record.sample_id,
            "index": index,
            **geometry,
            **control,
            **mask,
            **self.set_fields(self.record_at(index)),  # the set of the index, not of a substitute's
        }


def collate(samples: list[dict]) -> dict:
    """Samples -> one batch with the same keys as a sample (as torch's default_collate would name them):
    pixel_values (B, 3, R, R) float32; caption and sample_id lists of str; index (B,) LongTensor;
    original_size and crop_top_left (B, 2) LongTensors (see crop_fields); edit pairs add control_values (and
    control_values_2, ... for more references) like pixel_values; masked runs loss_mask (B, 1, H, W), data.sets loss_weight (B,), prior and preserve (B,) bool."""
    references = [key for key in samples[0] if key.startswith("control_values")]
    control = {key: stack_references(samples, key) for key in references}
    return {
        **control,
        **collate_loss_terms(samples),
        "pixel_values": torch.stack([s["pixel_values"] for s in samples]),
        "caption": [s["caption"] for s in samples],
        "sample_id": [s["sample_id"] for s in samples],
        "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
        "original_size": torch.stack([s["original_size"] for s in samples]),
        "crop_top_left": torch.stack([s["crop_top_left"] for s in samples]),
    }


def stack_references(samples: list[dict], key: str) -> torch.Tensor:
    """One reference of every sample stacked; ValueError naming the samples when their sizes differ (references at
    their own sizes: `validate` refuses such a dataset at a micro batch above 1, see docs/data.md)."""
    shapes = {tuple(s[key].shape[-2:]) for s in samples}
    if len(shapes) > 1:
        sizes = ", ".join(f"{s['sample_id']}: {s[key].shape[-1]}x{s[key].shape[-2]}" for s in samples)
        raise ValueError(
            f"{key}: the references of one micro batch have different sizes ({sizes}); references at their own "
            "sizes (data.reference_size: own) train one size per micro batch: set train.micro_batch_size: 1 (and "
            "raise gradient_accumulation_steps), or give references of one aspect ratio. See docs/data.md."
        )
    return torch.stack([s[key] for s in samples])


def collate_loss_terms(samples: list[dict]) -> dict:
    """The loss terms of a batch's samples (dstune.families.loss_terms): masks stacked, the sets' weights and roles
    as (B,) tensors; {} where the samples have none."""
    out = {}
    if "loss_mask" in samples[0]:
        out["loss_mask"] = torch.stack([s["loss_mask"] for s in samples])
    if "loss_weight" in samples[0]:
        out["loss_weight"] = torch.tensor([s["loss_weight"] for s in samples], dtype=torch.float32)
        out["prior"] = torch.tensor([s["prior"] for s in samples], dtype=torch.bool)
        out["preserve"] = torch.tensor([s["preserve"] for s in samples], dtype=torch.bool)
    return out


def read_mask(record: SampleRecord, alpha: bool) -> Image.Image | None:
    """The record's loss mask as an 8-bit grey image at its file's size (EXIF rotation applied, as to the image):
    its mask file (data.mask_dir), or with `alpha` its alpha channel; None when it has neither."""
    path = record.mask_path or (record.image_path if alpha else None)
    if path is None:
        return None
    try:
        with Image.open(path) as image:
            image = ImageOps.exif_transpose(image)
            if record.mask_path is not None:
                return image.convert("L")
            has_alpha = image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info)
            return image.convert("RGBA").getchannel("A") if has_alpha else None
    except _DECODE_ERRORS as err:
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise BadSampleError(
            f"cannot read the loss mask {path} (of sample {record.sample_id}): {reason}. Replace or delete it.", path
        ) from None


def find_bad_images(records: list[SampleRecord], rank: int = 0, world_size: int = 1) -> list[tuple[SampleRecord, str]]:
    """Check this rank's share (records[rank::world_size]): (record, reason) for each unreadable image, by the same
    check `dstune validate` makes (dstune.data.image_check: PIL's verify(), plus a truncated JPEG caught by its
    missing end-of-image marker and a 1/8-scale decode). Gather all ranks' results before excluding anything."""
    return find_unreadable(records[rank::world_size])


def without_samples(records: list[SampleRecord], sample_ids) -> list[SampleRecord]:
    """`records` minus the given sample ids, order kept (the sampler's order depends only on what remains)."""
    drop = set(sample_ids)
    return [r for r in records if r.sample_id not in drop]
