"""Whether an image file can be trained on, cheaply and torch-free: what `dstune validate` opens for every image of
the dataset, and what every rank checks of its share before step 1 (dstune.data.images.find_bad_images).

    image_problem(path) -> reason or None
    image_file_issues(data, records, source, show_progress) -> [SpecIssue]   validate's error or warning

PIL's verify() reads the header and structure (and a PNG's chunk checksums up to its end chunk) without decoding
pixels, so it misses a JPEG cut short: its scan data simply ends. A complete JPEG ends with the end-of-image marker
(FF D9); a file whose tail does not is decoded at 1/8 scale (every byte is still read, a few ms), which fails on a
truncated one and passes one that merely carries data after the marker (a camera trailer, a motion photo's video).
Other formats than PNG and JPEG (WebP, BMP, GIF, TIFF) are decoded whole: verify() checks little of them.
"""

from __future__ import annotations

from typing import Iterable, Optional

from dstune.progress import CountProgress
from dstune.spec.load import SpecIssue, SpecSource

JPEG_END = b"\xff\xd9"
TAIL_BYTES = 64  # a complete JPEG's marker is within this many bytes of the end, after any zero/space padding
DRAFT_SIDE = 64  # decode size of the fallback check: the DCT scales down by 8 at most, every byte is read
BAD_FILES_LISTED = 20  # files named one per line in the message; the rest counted


def image_problem(path: str) -> Optional[str]:
    """Why the image at `path` cannot be read (missing, not an image, broken structure, cut short), or None."""
    from PIL import Image, UnidentifiedImageError

    errors = (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError)
    try:
        with Image.open(path) as image:
            kind = image.format
            image.verify()
        if kind == "JPEG" and _ends_with_marker(path):
            return None
        if kind != "PNG":
            with Image.open(path) as image:
                if kind == "JPEG":
                    image.draft("RGB", (DRAFT_SIDE, DRAFT_SIDE))
                image.load()
    except errors as err:
        return getattr(err, "strerror", None) or str(err) or type(err).__name__
    return None


def _ends_with_marker(path: str) -> bool:
    with open(path, "rb") as handle:
        handle.seek(0, 2)
        handle.seek(max(0, handle.tell() - TAIL_BYTES))
        return handle.read().rstrip(b"\x00 \r\n\t").endswith(JPEG_END)


def record_problem(record) -> Optional[str]:
    """Why a dataset record (dstune.data.index.SampleRecord) cannot be trained on: its image or, for an edit pair,
    its source image; None for a readable one or a built-in sample (rendered, not read)."""
    if record.image_path is None:
        return None
    problem = image_problem(record.image_path)
    for path in record.control_paths if problem is None else ():
        problem = image_problem(path)
        if problem:
            return f"source image {path}: {problem}"
    return problem


def find_unreadable(records: Iterable, show_progress: bool = False) -> list[tuple[object, str]]:
    """(record, reason) for each record whose image (or source image) cannot be read, in order."""
    records = list(records)
    progress = CountProgress("data.path: checked", "images", len(records)) if show_progress else None
    bad = []
    for done, record in enumerate(records, 1):
        problem = record_problem(record)
        if problem is not None:
            bad.append((record, problem))
        if progress is not None:
            progress.update(done)
    return bad


def image_file_issues(data, records: list, source: SpecSource, show_progress: bool = True) -> list[SpecIssue]:
    """validate's verdict on every image of `records` (training and held-out): unreadable ones are an error naming
    them, or with data.skip_bad_files a warning with their count (training skips the same files)."""
    bad = find_unreadable(records, show_progress)
    if not bad:
        return []
    listing = "\n  ".join(f"{record.image_path}: {reason}" for record, reason in bad[:BAD_FILES_LISTED])
    more = f"\n  ... and {len(bad) - BAD_FILES_LISTED} more" if len(bad) > BAD_FILES_LISTED else ""
    if data.skip_bad_files:
        return [
            source.issue(
                "data.skip_bad_files",
                f"{len(bad)} of {len(records)} image(s) cannot be read and are "
                f"skipped (each replaced by the next readable sample):\n  {listing}{more}",
                severity="warning",
            )
        ]
    return [
        source.issue(
            "data.path",
            f"{len(bad)} of {len(records)} image(s) cannot be read, and training would "
            f"stop on them before step 1:\n  {listing}{more}\nReplace or delete them, or set "
            "data.skip_bad_files: true to train without them.",
        )
    ]
