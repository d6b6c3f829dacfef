"""The dataset index: which samples exist, their captions and repeat counts. No torch, no image decoding.

`dstune validate` counts samples through this module, so it only lists files and reads small text files.
A sample's identity (`sample_id`) is its path relative to the dataset root (`shapes/000123` for the built-in set):
caches and logs key on it, never on a position.

Layouts:
  - folder (kohya-ss sd-scripts): images with same-stem caption files; a subfolder named `N_name` (N a positive
    integer) repeats every image under it N times, the nearest such folder counting; other folders repeat once.
  - jsonl (Hugging Face imagefolder): `metadata.jsonl` at the root, one `{"file_name": ..., "text": ...}` per line.
  - builtin:shapes: synthetic coloured shapes (dstune.data.synthetic), made on the fly from the sample number;
    builtin:moving-shapes the same as clips (video families), builtin:moving-shapes-av those clips with a sound track.
Video families (index_dataset(..., video=True)) list video files as well as images, in either layout.
Edit / control pairs (data.control_dir, metadata.jsonl `control_file_name`): dstune.data.pairs; a paired record
carries its reference images' paths in `control_paths`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from dstune.data.pairs import (  # noqa: F401 (DataError: defined there, imported from here)
    DataError,
    control_outside,
    reference_folders,
    CONTROL_FIELD,
    control_root,
    list_controls,
    reference_suffix,
    reference_count_problem,
    references_of,
    listing,
    orphans_warning,
    stem_of,
    unpaired_message,
)
from dstune.data.survey import caption_hint, extensions_under, found_text
from dstune.data.synthetic import MOVING_SHAPES_NUM_SAMPLES, SHAPES_NUM_SAMPLES, moving_shape, shape_sample
from dstune.spec.models import DataSpec
from dstune.spec.section import BUILTIN_PREFIX, VIDEO_FAMILY

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")
METADATA_FILE = "metadata.jsonl"
CLIP_BUILTINS = ("moving-shapes", "moving-shapes-av")  # the built-in datasets of clips (video families)
BUILTIN_DATASETS = {"shapes": SHAPES_NUM_SAMPLES, **dict.fromkeys(CLIP_BUILTINS, MOVING_SHAPES_NUM_SAMPLES)}
BUILTIN_CAPTIONS = {
    "shapes": lambda i: shape_sample(i).caption,
    **dict.fromkeys(CLIP_BUILTINS, lambda i: moving_shape(i).caption),
}
_REPEAT_FOLDER = re.compile(r"^(\d+)_(.+)$")
_EXAMPLES_IN_WARNING = 3


@dataclass(frozen=True)
class SampleRecord:
    sample_id: str  # path relative to the dataset root (posix), or "shapes/000123" for the built-in set
    image_path: str | None  # None for built-in samples, which are generated rather than read
    caption: str
    repeats: int  # times the sample appears in one epoch (kohya `N_name` folders x the set's repeats)
    # edit / control training: the reference (source) images of this target, in order (dstune.data.pairs)
    control_paths: tuple[str, ...] = ()
    set_index: int = 0  # data.sets: the number of the record's set (0 with data.path)
    mask_path: str | None = None  # masked loss: the record's mask file (data.mask_dir), None: alpha or no mask

    @property
    def control_path(self) -> str | None:
        """The first reference (the source of a one-reference edit pair), None unpaired."""
        return self.control_paths[0] if self.control_paths else None


@dataclass(frozen=True)
class IndexResult:
    records: list[SampleRecord]
    warnings: list[str] = field(default_factory=list)  # one self-contained line each
    skipped: list[str] = field(default_factory=list)  # "path: reason", only with data.skip_bad_files
    held_out: list[SampleRecord] = field(default_factory=list)  # data.eval's samples (never in `records`)

    @property
    def num_samples(self) -> int:
        """Samples one epoch draws from: every repeat counts."""
        return sum(r.repeats for r in self.records)

    @property
    def num_pairs(self) -> int:
        """Targets with a source image (edit / control training); 0 for an unpaired dataset."""
        return sum(1 for r in self.records if r.control_path is not None)


def control_records(records: list[SampleRecord]) -> list[SampleRecord]:
    """Each reference image of each paired record as a record of its own (id: the target's + its reference
    suffix, `#control`, `#control2`, ...; no repeats; its file, no mask), which is how the latent cache stores
    reference latents beside the targets'. A clip's keeps its frames, place and size (its reference is read as the
    clip's frames are) and its one reference (dstune.data.video.VideoCaptionDataset.reference_clip)."""
    return [
        dataclasses.replace(
            r,
            sample_id=r.sample_id + reference_suffix(number),
            image_path=path,
            repeats=0,
            mask_path=None,
            control_paths=(path,),
        )
        for r in records
        for number, path in enumerate(r.control_paths)
    ]


def builtin_name(path: str) -> str | None:
    """`builtin:shapes` -> "shapes"; any other path -> None."""
    return path[len(BUILTIN_PREFIX) :] if path.startswith(BUILTIN_PREFIX) else None


def builtin_of(sample_id: str) -> str:
    """The built-in dataset a built-in record (no file) comes from: `moving-shapes/000003`, or in data.sets
    `name/moving-shapes/000003`, -> "moving-shapes"."""
    return sample_id.rsplit("/", 2)[-2]


def is_builtin_clip(sample_id: str) -> bool:
    """Whether a built-in record (no file) is a clip of several frames rather than a still shape."""
    return builtin_of(sample_id) in CLIP_BUILTINS


def is_builtin_clip_with_sound(sample_id: str) -> bool:
    """Whether a built-in record is a clip with a sound track (builtin:moving-shapes-av)."""
    return sample_id.split("/", 1)[0] == CLIP_BUILTINS[1]


def is_video_file(path: str) -> bool:
    return path.lower().endswith(VIDEO_EXTENSIONS)


def list_samples(data: DataSpec, video: bool = False) -> list[SampleRecord]:
    return index_dataset(data, video=video).records


def count_samples(data: DataSpec) -> int:
    """The number of samples an epoch draws from (sum of repeats). Reads no caption and no image."""
    return index_dataset(data, read_captions=False).num_samples


def index_dataset(data: DataSpec, read_captions: bool = True, video: bool = False) -> IndexResult:
    """The training samples in a deterministic (sorted) order, with warnings, and data.eval's held-out samples
    (`held_out`: each once, repeats 1). Raises DataError for unusable datasets. `video`: a video family's dataset,
    which lists video files (VIDEO_EXTENSIONS) beside the images.

    read_captions=False leaves every caption "" (counting only needs to know which files exist).

    data.sets: each set indexed with its own settings (data.set_specs()), its records' ids prefixed by the set's
    name (`name/rel`, so two sets' files never share a cache entry), their repeats multiplied by the set's, in the
    sets' order; a DataError names the set's key (`data.sets.N.path`)."""
    result = (
        _index_sets(data, read_captions, video) if data.sets is not None else _index_all(data, read_captions, video)
    )
    if data.eval is None:
        return result
    if data.eval.fraction is not None:
        records, held_out = held_out_split(result.records, data.eval.fraction)
        return dataclasses.replace(result, records=records, held_out=held_out)
    try:
        held = _index_all(data.model_copy(update={"path": data.eval.path, "eval": None}), read_captions)
    except DataError as err:
        raise DataError("data.eval.path", err.message) from None
    held_out = [dataclasses.replace(record, repeats=1) for record in held.records]
    return dataclasses.replace(
        result, warnings=result.warnings + [f"data.eval.path: {w}" for w in held.warnings], held_out=held_out
    )


def _index_sets(data: DataSpec, read_captions: bool, video: bool = False) -> IndexResult:
    records, warnings, skipped = [], [], []
    for number, (item, one) in enumerate(zip(data.sets, data.set_specs())):
        try:
            found = _index_all(one, read_captions, video)
        except DataError as err:
            raise DataError(
                err.key.replace("data.", f"data.sets.{number}.", 1), f"({item.label}) {err.message}"
            ) from None
        records += [
            dataclasses.replace(
                r,
                sample_id=f"{item.label}/{r.sample_id}",
                repeats=r.repeats * item.repeats,
                set_index=number,
            )
            for r in found.records
        ]
        warnings += [f"data.sets.{number} ({item.label}): {w}" for w in found.warnings]
        skipped += found.skipped
    return IndexResult(records, warnings, skipped)


def set_counts(records: list[SampleRecord], num_sets: int) -> list[tuple[int, int]]:
    """(files, samples per epoch, repeats counted) of each set of data.sets, in the sets' order."""
    files, samples = [0] * num_sets, [0] * num_sets
    for record in records:
        files[record.set_index] += 1
        samples[record.set_index] += record.repeats
    return list(zip(files, samples))


def held_out_split(records: list[SampleRecord], fraction: float) -> tuple[list[SampleRecord], list[SampleRecord]]:
    """(training records, held-out records): round(fraction x records) of them, at least one, held out, chosen by
    the smallest hash of their sample id, so adding images to the folder never moves a held-out image back into
    training (unless a new one hashes lower). Held-out records keep the dataset's order and are evaluated once
    each (repeats 1)."""
    if len(records) < 2:
        raise DataError(
            "data.eval.fraction",
            f"the dataset has {len(records)} image(s): holding some out would leave "
            "nothing to train on. Add images, or give a separate folder as data.eval.path.",
        )
    count = min(len(records) - 1, max(1, round(fraction * len(records))))
    ranked = sorted(
        range(len(records)),
        key=lambda i: hashlib.blake2b(f"dstune/eval/{records[i].sample_id}".encode(), digest_size=8).digest(),
    )
    chosen = set(ranked[:count])
    training = [record for i, record in enumerate(records) if i not in chosen]
    held_out = [dataclasses.replace(record, repeats=1) for i, record in enumerate(records) if i in chosen]
    return training, held_out


def _index_all(data: DataSpec, read_captions: bool, video: bool = False) -> IndexResult:
    name = builtin_name(data.path)
    if name is not None:
        return _index_builtin(name)
    root = _dataset_root(data.path)
    has_metadata = (root / METADATA_FILE).is_file()
    if data.format == "jsonl" or (data.format == "auto" and has_metadata):
        if not has_metadata:
            raise DataError(
                "data.format",
                f"format 'jsonl' needs {root / METADATA_FILE} (one JSON object per line "
                "with `file_name` and `text`); it does not exist. For images with .txt captions use "
                "format 'folder' (or 'auto').",
            )
        result = _index_jsonl(root, data.skip_bad_files)
    else:
        control_outside(root, data)
        extensions = IMAGE_EXTENSIONS + (VIDEO_EXTENSIONS if video else ())
        result = _index_folder(root, _normalised_extension(data.caption_extension), read_captions, extensions)
    result = _masked(_paired(result, root, data, video), root, data, video)
    if not result.records:
        kinds = "video or image" if video else "image"
        what = (
            METADATA_FILE
            if data.format == "jsonl" or has_metadata
            else f"{kinds} files ({', '.join(IMAGE_EXTENSIONS + (VIDEO_EXTENSIONS if video else ()))})"
        )
        found = extensions_under(root)
        clips = sum(found[extension] for extension in VIDEO_EXTENSIONS)
        advice = (
            f"This model trains on images; the video models (model.family {VIDEO_FAMILY}: `dstune init --model "
            "list` names them) train on clips. Or point"
            if clips and not video
            else "Point"
        )
        raise DataError(
            "data.path",
            f"no usable samples in {root}: looked for {what}, found {found_text(found)}. {advice} data.path at "
            "the folder holding the images (subfolders are searched too).",
        )
    return result


def _index_builtin(name: str) -> IndexResult:
    if name not in BUILTIN_DATASETS:
        known = ", ".join(f"builtin:{n}" for n in sorted(BUILTIN_DATASETS))
        raise DataError("data.path", f"unknown built-in dataset 'builtin:{name}'. Known built-ins: {known}.")
    records = [
        SampleRecord(sample_id=f"{name}/{i:06d}", image_path=None, caption=BUILTIN_CAPTIONS[name](i), repeats=1)
        for i in range(BUILTIN_DATASETS[name])
    ]
    return IndexResult(records)


def _dataset_root(path: str) -> Path:
    root = Path(os.path.expanduser(path))
    if not root.exists():
        raise DataError(
            "data.path",
            f"{path} does not exist. Give the folder holding your images, or "
            f"{BUILTIN_PREFIX}shapes for the built-in synthetic set.",
        )
    if not root.is_dir():
        raise DataError(
            "data.path",
            f"{path} is a file, not a folder. Give the folder holding the images "
            f"(with {METADATA_FILE} or same-name caption files).",
        )
    return root


def _normalised_extension(extension: str) -> str:
    if not extension.strip(". "):
        raise DataError(
            "data.caption_extension", f"{extension!r} is not a file extension; use e.g. '.txt' or '.caption'"
        )
    return extension if extension.startswith(".") else "." + extension


# ------------------------------------------------------------------------------------------------ folder (kohya)


def _repeats_of(folder_name: str, rel_folder: str) -> int | None:
    """`5_dog` -> 5; a folder without the `N_` prefix -> None (inherits its parent's repeats)."""
    match = _REPEAT_FOLDER.match(folder_name)
    if match is None:
        return None
    repeats = int(match.group(1))
    if repeats < 1:
        raise DataError(
            "data.path",
            f"folder {rel_folder}: repeat count {repeats} must be at least 1 (kohya "
            f"`N_name` folders repeat their images N times); rename it, e.g. to 1_{match.group(2)}.",
        )
    return repeats


def _walk_images(root: Path, extensions: tuple[str, ...] = IMAGE_EXTENSIONS):
    """Yield (relative posix path, absolute path, repeats) for every file with one of `extensions` (images), sorted,
    following symlinked folders once."""
    seen_real: set[str] = set()

    def walk(folder: Path, rel: PurePosixPath, repeats: int):
        real = os.path.realpath(folder)
        if real in seen_real:  # a symlink loop, or the same folder linked twice
            return
        seen_real.add(real)
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
        for entry in entries:
            if entry.name.startswith("."):  # .ipynb_checkpoints, .DS_Store, editor files
                continue
            if entry.is_dir():
                sub_rel = rel / entry.name
                sub_repeats = _repeats_of(entry.name, str(sub_rel))
                yield from walk(Path(entry.path), sub_rel, sub_repeats or repeats)
            elif entry.is_file() and entry.name.lower().endswith(extensions):
                yield str(rel / entry.name), entry.path, repeats

    yield from walk(root, PurePosixPath(), 1)


def _read_caption(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as err:
        raise DataError(
            "data.path", f"caption file {path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8."
        ) from None
    except OSError as err:
        raise DataError("data.path", f"caption file {path} cannot be read: {err.strerror}") from None
    # Multi-line captions are joined rather than cut to the first line, so no text is silently lost.
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _index_folder(
    root: Path, caption_extension: str, read_captions: bool, extensions: tuple[str, ...] = IMAGE_EXTENSIONS
) -> IndexResult:
    records, uncaptioned = [], []
    for rel, path, repeats in _walk_images(root, extensions):
        caption_path = os.path.splitext(path)[0] + caption_extension
        caption = ""
        if not os.path.isfile(caption_path):
            uncaptioned.append(rel)
        elif read_captions:
            caption = _read_caption(caption_path)
        records.append(SampleRecord(sample_id=rel, image_path=path, caption=caption, repeats=repeats))
    warnings = []
    if uncaptioned:
        examples = ", ".join(uncaptioned[:_EXAMPLES_IN_WARNING]) + (
            ", ..." if len(uncaptioned) > _EXAMPLES_IN_WARNING else ""
        )
        beside = caption_hint([os.path.join(root, rel) for rel in uncaptioned], caption_extension)
        warnings.append(
            f"{len(uncaptioned)} of {len(records)} images have no {caption_extension} caption file and "
            f"train with an empty caption ({examples}){beside}"
        )
    return IndexResult(records, warnings)


# ------------------------------------------------------------------------------------------------ jsonl


def _parse_metadata_line(line: str, where: str) -> tuple[str, str, tuple | None]:
    """One metadata.jsonl line -> (file_name, text, its control_file_name(s) as a tuple or None), or DataError naming file:line and
    the problem."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(
            "data.path",
            f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be "
            'one object like {"file_name": "a.png", "text": "a caption"}',
        ) from None
    if not isinstance(entry, dict):
        raise DataError(
            "data.path", f"{where}: expected a JSON object with `file_name` and `text`, got {type(entry).__name__}"
        )
    missing = [k for k in ("file_name", "text") if k not in entry]
    if missing:
        raise DataError(
            "data.path",
            f"{where}: missing {' and '.join(f'`{k}`' for k in missing)} (keys present: "
            f"{', '.join(sorted(entry)) or 'none'})",
        )
    file_name, text = entry["file_name"], entry["text"]
    if not isinstance(file_name, str) or not file_name.strip():
        raise DataError("data.path", f"{where}: `file_name` must be a non-empty string, got {file_name!r}")
    if not isinstance(text, str):
        raise DataError("data.path", f"{where}: `text` must be a string, got {type(text).__name__} {text!r}")
    control = entry.get(CONTROL_FIELD)
    references = [control] if isinstance(control, str) else control
    if control is not None and not (references and isinstance(references, list) and all(map(_named, references))):
        raise DataError(
            "data.path",
            f"{where}: `{CONTROL_FIELD}` (the reference image of an edit pair) must be a non-empty string, or a "
            f"list of them for several references, got {control!r}",
        )
    control = None if control is None else tuple(references)
    return file_name, text, control


def _named(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _relative_file(file_name: str, where: str) -> str:
    rel = PurePosixPath(file_name.replace("\\", "/"))
    if rel.is_absolute() or ".." in rel.parts:
        raise DataError(
            "data.path",
            f"{where}: file_name {file_name!r} must be a path inside the dataset folder (relative, no '..')",
        )
    return str(rel)


def _index_jsonl(root: Path, skip_bad_files: bool) -> IndexResult:
    metadata = root / METADATA_FILE
    records, skipped, first_line_of = [], [], {}
    try:
        lines = metadata.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError("data.path", f"{metadata} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{metadata}:{number}"
        file_name, text, control = _parse_metadata_line(line, where)
        rel = _relative_file(file_name, where)
        if rel in first_line_of:
            raise DataError(
                "data.path",
                f"{where}: {rel} is already listed on line {first_line_of[rel]}; list each "
                "image once (copy the file to train it with a second caption)",
            )
        first_line_of[rel] = number
        path = root / rel
        if not path.is_file():
            if not skip_bad_files:
                raise DataError(
                    "data.path",
                    f"{where}: image {path} does not exist. Fix the file_name, or set "
                    "data.skip_bad_files: true to leave such lines out.",
                )
            skipped.append(f"{path}: listed on line {number} but does not exist")
            continue
        controls = () if control is None else tuple(str(root / _relative_file(one, where)) for one in control)
        records.append(
            SampleRecord(sample_id=rel, image_path=str(path), caption=text.strip(), repeats=1, control_paths=controls)
        )
    warnings = []
    if skipped:
        warnings.append(
            f"{len(skipped)} lines of {metadata} name missing images and are left out "
            f"(data.skip_bad_files): {'; '.join(skipped[:_EXAMPLES_IN_WARNING])}"
        )
    return IndexResult(records, warnings, skipped)


# ------------------------------------------------------------------------------------------------ loss masks


def _masked(result: IndexResult, root: Path, data: DataSpec, video: bool = False) -> IndexResult:
    """data.mask_dir: each record's mask file (same relative path and name, any image extension; for a video
    family a video file too: a clip's mask image weights every frame, a mask video each frame its own); a record
    without one trains whole, which a warning counts. The folder must not lie inside data.path (its files would
    train)."""
    if data.mask_dir is None:
        return result
    folder = control_root(root, data.mask_dir)
    if not folder.is_dir():
        raise DataError(
            "data.mask_dir",
            f"{folder} is not a folder. Give the folder of loss masks (absolute, or relative to data.path, e.g. "
            "../masks).",
        )
    if folder.resolve() == root.resolve() or folder.resolve().is_relative_to(root.resolve()):
        raise DataError(
            "data.mask_dir",
            f"{folder} is inside data.path {root}, whose images all train. Keep the masks in a sibling folder "
            "(e.g. mask_dir: ../masks).",
        )
    masks, clashes = list_controls(folder, IMAGE_EXTENSIONS + (VIDEO_EXTENSIONS if video else ()))
    if clashes:
        raise DataError(
            "data.mask_dir",
            f"{len(clashes)} mask names in {folder} have two files: {listing(clashes)}. Keep one file per name.",
        )
    records = [dataclasses.replace(r, mask_path=masks.get(stem_of(r.sample_id))) for r in result.records]
    unmasked = [r.sample_id for r in records if r.mask_path is None]
    warnings = list(result.warnings)
    if unmasked:
        warnings.append(
            f"{len(unmasked)} of {len(records)} {'samples' if video else 'images'} have no mask in {folder} and train "
            f"whole: {listing(unmasked)}"
        )
    return dataclasses.replace(result, records=records, warnings=warnings)


# ------------------------------------------------------------------------------------------- edit / control pairs


def _paired(result: IndexResult, root: Path, data: DataSpec, video: bool = False) -> IndexResult:
    """Each record's references (metadata.jsonl `control_file_name`, else data.control_dir's files of the same
    relative stem, one per folder; for a video family a clip too: an in-context reference). A target missing one: DataError naming the sample and the file looked for (with
    data.skip_bad_files: left out, a warning)."""
    named = any(r.control_paths for r in result.records)
    if data.control_dir is None and not named:
        return result
    extensions = IMAGE_EXTENSIONS + (VIDEO_EXTENSIONS if video else ())
    folders = reference_folders(root, data, extensions)
    where = f"`{CONTROL_FIELD}` in {root / METADATA_FILE}"
    if folders:
        shown = ", ".join(str(folder) for folder, _ in folders)
        where = f"a file with the same relative path and name in {shown} (any of {', '.join(extensions)})"
    records, unpaired, used = [], [], set()
    for record in result.records:
        paths, missing = references_of(record, folders)
        if missing is not None or None in paths or not paths:
            unpaired.append(record.sample_id if missing is None else f"{record.sample_id} ({missing})")
            continue
        used.update(paths)
        records.append(dataclasses.replace(record, control_paths=tuple(paths)))
    if reference_count_problem(records):  # a batch stacks each reference: every target needs as many
        raise DataError("data.path", reference_count_problem(records))
    warnings = list(result.warnings)
    if unpaired:
        if not data.skip_bad_files:
            raise DataError(
                "data.control_dir" if data.control_dir else "data.path",
                unpaired_message(unpaired, len(result.records), where),
            )
        warnings.append("left out (data.skip_bad_files): " + unpaired_message(unpaired, len(result.records), where))
    for folder, controls in folders:
        orphans = [os.path.relpath(path, folder) for path in controls.values() if path not in used]
        if orphans:
            warnings.append(orphans_warning(orphans, folder))
    return dataclasses.replace(result, records=records, warnings=warnings)
