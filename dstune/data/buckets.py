"""Aspect-ratio buckets (`data.buckets`): which (width, height) sizes exist, and which one each image trains at.

No torch and no pixel decoding: an image's bucket comes from the size in its header (PIL opens files lazily; the
EXIF orientation is honoured, since the dataset rotates phone photos upright before cropping). `dstune validate`
and training both assign through `assign_buckets`, so the plan and the loader agree. The grouped sampler
(dstune.data.groups) then keeps every global batch inside one bucket.

Generated buckets (no `sizes` given): with area A = resolution^2 and step s, the square (resolution rounded down
to s), and every landscape width w = square + s, + 2s, ... with the tallest height h (a multiple of s) such that
w x h <= A, mirrored into the portrait (h, w); sizes whose width/height lies in [min_aspect, max_aspect] are
kept. Like kohya's and SimpleTuner's buckets, every bucket has (about) the pixel area of the square one, so a
batch costs about the same whatever its shape.
Assignment: the bucket whose aspect ratio is nearest to the image's, compared on a log scale (so 2:1 and 1:2 are
equally far from 1:1); ties go to the larger area, then the smaller width.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from dstune.data.groups import key_label
from dstune.data.index import DataError, SampleRecord
from dstune.data.pairs import own_reference_size

LATENT_MULTIPLE = 8  # the sd VAE downsamples by 8: a side that is a multiple of 8 gives a whole latent grid
EXIF_ORIENTATION_TAG = 0x0112
_SWAPPING_ORIENTATIONS = (5, 6, 7, 8)  # transposed or rotated by 90 degrees: width and height swap
_memo: dict = {}


def bucket_name(size: tuple[int, int]) -> str:
    """ "WxH": how plans and reports name a bucket (dstune.data.groups.key_label of the (width, height) key)."""
    return key_label(tuple(size))


def generate_buckets(resolution: int, min_aspect: float, max_aspect: float, step: int) -> list[tuple[int, int]]:
    """Equal-area (width, height) buckets around resolution x resolution, sorted by aspect ratio. Landscape sizes
    are generated and mirrored into portrait ones, so 1:2 and 2:1 buckets are exact mirrors."""
    area = resolution * resolution
    square = resolution // step * step
    sizes = {(square, square)} if square else set()
    widest = max(max_aspect, 1 / min_aspect)
    width = square + step
    while True:
        height = area // width // step * step
        if height < step or width / height > widest:
            break
        if width / height <= max_aspect:
            sizes.add((width, height))
        if height / width >= min_aspect:
            sizes.add((height, width))
        width += step
    return sorted(sizes, key=lambda s: (s[0] / s[1], s[0]))


def bucket_sizes(data) -> list[tuple[int, int]]:
    """The buckets of a DataSpec with buckets enabled: explicit `sizes`, or generated."""
    spec = data.buckets
    if spec.sizes:
        return sorted({tuple(size) for size in spec.sizes}, key=lambda s: (s[0] / s[1], s[0]))
    return generate_buckets(data.resolution, spec.min_aspect, spec.max_aspect, spec.step)


def nearest_bucket(width: int, height: int, sizes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest (log scale) to width/height."""
    aspect = math.log(width / height)
    return min(sizes, key=lambda s: (round(abs(math.log(s[0] / s[1]) - aspect), 12), -s[0] * s[1], s[0]))


def header_size(path: str) -> tuple[int, int]:
    """(width, height) as the image will be shown, from its header only: EXIF rotations by 90 degrees swap them."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
        try:
            orientation = image.getexif().get(EXIF_ORIENTATION_TAG)
        except (OSError, ValueError, SyntaxError):  # a broken EXIF block: the dataset's exif_transpose ignores it too
            orientation = None
    return (height, width) if orientation in _SWAPPING_ORIENTATIONS else (width, height)


def upscaling_warning(records: Sequence[SampleRecord], data) -> str | None:
    """The warning for training images smaller than what they are cropped to (data.resolution's square, or their
    bucket), which the loader upscales; None when there are none or data.allow_upscaling accepts them. Headers only
    (no pixels decoded); unreadable files are left to the checks that report them."""
    if data.allow_upscaling:
        return None
    sizes = bucket_sizes(data) if data.buckets.enabled else None
    small, largest, example, total = 0, 1.0, "", 0
    for record in records:
        if record.image_path is None:  # built-in samples are rendered at data.resolution
            continue
        total += 1
        try:
            width, height = header_size(record.image_path)
        except Exception:  # noqa: BLE001 - PIL raises many types for a bad header; other checks name the file
            continue
        target = nearest_bucket(width, height, sizes) if sizes else (data.resolution, data.resolution)
        factor = max(target[0] / width, target[1] / height) if sizes else data.resolution / min(width, height)
        if factor > 1.0:
            small += 1
            if factor > largest:
                largest, example = factor, f"{record.sample_id} ({width}x{height})"
    if not small:
        return None
    into = "their buckets" if sizes else f"data.resolution {data.resolution}"
    return (
        f"{small} of {total} images are smaller than {into} and will be upscaled (up to {largest:.1f}x, e.g. "
        f"{example}), which blurs what the model learns. Set data.allow_upscaling: true to accept this, or lower "
        "data.resolution."
    )


def _record_bucket(record: SampleRecord, sizes, square, skip_bad_files: bool) -> tuple[tuple[int, int], str | None]:
    """(bucket, problem or None) of one record."""
    if record.image_path is None:  # built-in samples are rendered square
        return nearest_bucket(1, 1, sizes), None
    from PIL import Image

    try:
        width, height = header_size(record.image_path)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        if not skip_bad_files:
            raise DataError(
                "data.path",
                f"cannot read the size of image {record.image_path} (sample "
                f"{record.sample_id}): {reason}. Replace or delete the file, or set "
                "data.skip_bad_files: true to skip unreadable images.",
            ) from None
        return square, f"{record.sample_id}: {reason}"
    return nearest_bucket(width, height, sizes), None


def assign_buckets(records: Sequence[SampleRecord], data) -> tuple[list[tuple[int, int]], list[str]]:
    """(bucket of each record, in record order; unreadable files, placed in the square-most bucket). Raises
    DataError for an unreadable header without data.skip_bad_files. Remembered per process: validate and the
    loader of the same run read each header once."""
    sizes = bucket_sizes(data)
    memo_key = (
        tuple(sizes),
        data.skip_bad_files,
        tuple((r.sample_id, r.image_path, _mtime(r.image_path)) for r in records),
    )
    if memo_key not in _memo:
        square = nearest_bucket(1, 1, sizes)
        results = [_record_bucket(r, sizes, square, data.skip_bad_files) for r in records]
        _memo.clear()  # one dataset per process is the rule; do not grow without bound
        _memo[memo_key] = ([b for b, _ in results], [p for _, p in results if p])
    buckets, problems = _memo[memo_key]
    return list(buckets), list(problems)


def record_sizes(records: Sequence[SampleRecord], data) -> tuple[list[tuple[int, int]] | None, list[str]]:
    """(the (width, height) each record trains at, in record order, or None when every sample is data.resolution's
    square without buckets; unreadable headers). With data.sets, each set's own resolution and buckets: a set
    without buckets trains at its resolution's square, so sets at several sizes are groups as buckets are."""
    if data.sets is None:
        return assign_buckets(records, data) if data.buckets.enabled else (None, [])
    specs = data.set_specs()
    if all(not one.buckets.enabled and one.resolution == data.resolution for one in specs):
        return None, []
    sizes: list = [None] * len(records)
    problems: list[str] = []
    for number, one in enumerate(specs):
        members = [i for i, record in enumerate(records) if record.set_index == number]
        if one.buckets.enabled:
            found, bad = assign_buckets([records[i] for i in members], one)
            problems += bad
        else:
            found = [(one.resolution, one.resolution)] * len(members)
        for i, size in zip(members, found):
            sizes[i] = size
    return sizes, problems


def sample_buckets(records: Sequence[SampleRecord], data) -> dict[str, tuple[int, int]] | None:
    """sample_id -> the (width, height) it trains at (record_sizes), or None at data.resolution's square (for the
    latent cache's keys)."""
    sizes = record_sizes(records, data)[0]
    return None if sizes is None else {record.sample_id: size for record, size in zip(records, sizes)}


def _mtime(path: str | None) -> float | None:
    try:
        return os.stat(path).st_mtime if path else None
    except OSError:
        return None


def index_keys(records: Sequence[SampleRecord], record_buckets: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The bucket of every dataset index (a record with repeats=3 owns three consecutive indices)."""
    return [bucket for record, bucket in zip(records, record_buckets) for _ in range(record.repeats)]


def bucket_counts(records: Sequence[SampleRecord], record_buckets) -> dict[str, int]:
    """{"WxH": samples (repeats included)}, for the plan: every bucket, empty ones left out, sorted by aspect."""
    counts: dict[tuple[int, int], int] = {}
    for record, bucket in zip(records, record_buckets):
        counts[bucket] = counts.get(bucket, 0) + record.repeats
    return {bucket_name(b): counts[b] for b in sorted(counts, key=lambda s: (s[0] / s[1], s[0]))}


def reference_size_problem(records: Sequence[SampleRecord], data, micro_batch: int | None) -> str | None:
    """data.reference_size own at a micro batch above 1 (None: not fixed, may be): a micro batch stacks each
    reference, so within a bucket every sample's reference k must train at one size. What differs (the first
    two samples of each differing (bucket, reference)), else None. Headers only."""
    if data.reference_size != "own" or micro_batch == 1 or not any(r.control_paths for r in records):
        return None
    sizes = record_sizes(records, data)[0] or [(data.resolution, data.resolution)] * len(records)
    first: dict[tuple, tuple] = {}
    differ = []
    for record, target in zip(records, sizes):
        for number, path in enumerate(record.control_paths):
            try:
                own = own_reference_size(header_size(path), target)
            except (OSError, ValueError, SyntaxError):
                continue  # an unreadable file: the file check names it
            seen = first.setdefault((target, number), (own, record.sample_id))
            if seen[0] != own and len(differ) < 3:
                differ.append(
                    f"reference {number + 1} of {seen[1]} trains at {seen[0][0]}x{seen[0][1]}, of "
                    f"{record.sample_id} at {own[0]}x{own[1]}"
                )
    if not differ:
        return None
    return (
        f"references keep their own sizes (data.reference_size: own) and differ within a bucket: {'; '.join(differ)}. "
        "A micro batch stacks each reference, so set train.micro_batch_size: 1 (raise "
        "gradient_accumulation_steps for the same global batch), give the references of each bucket one aspect "
        "ratio, or set data.reference_size: target. See docs/data.md."
    )


def own_size_pictures(records: Sequence[SampleRecord], data) -> list[tuple] | None:
    """data.reference_size own: every distinct (target size, reference 1's size, ...) of the samples, in (width,
    height) pixels, from the headers (what the sequence-parallel checks count, each picture by its own size); None
    when the references are sized with their targets or there are none."""
    if data.reference_size != "own" or not any(r.control_paths for r in records):
        return None
    sizes = record_sizes(records, data)[0] or [(data.resolution, data.resolution)] * len(records)
    found = {}
    for record, target in zip(records, sizes):
        try:
            found[(target, *(own_reference_size(header_size(p), target) for p in record.control_paths))] = None
        except (OSError, ValueError, SyntaxError):
            continue  # an unreadable file: the file check names it
    return list(found) or None
