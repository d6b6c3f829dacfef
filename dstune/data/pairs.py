"""Edit / control training pairs: which source (control) image goes with each target image. No torch, no decoding.

Two ways to name a target's source, both counted by `dstune validate`:
  - `data.control_dir`: a folder of sources with the targets' relative paths and stems, any image extension
    (`target/5_cats/a.png` pairs with `control/5_cats/a.jpg`); a relative control_dir is taken from data.path, so
    `../control` is the folder beside it (and data.eval.path's own `../control` for a held-out folder);
  - in metadata.jsonl, a `control_file_name` per line (relative to data.path), which wins over data.control_dir.

Several references per sample (the multi-image edit models): data.control_dir as a list of folders, reference k
from the k-th folder by the same rule, or `control_file_name` as a list of files. Every target needs every
reference: a target missing one stops the run with the sample, the reference's number and what was looked for (or,
with data.skip_bad_files, is left out with a warning); sources that no target uses are a warning with their names.
Reference 1 keeps the single reference's names (`control_values` in a batch, `#control` in the cache); reference
k > 1 adds `_k` to the batch keys and k to the cache suffix (`control_values_2`, `#control2`).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from dstune.spec.data_sections import reference_key  # noqa: F401 (the batch keys, named with data.control_dir)
from dstune.spec.reference_sizes import own_reference_size  # noqa: F401 (data.reference_size own's rule)

CONTROL_FIELD = "control_file_name"  # the metadata.jsonl field naming a target's source image
CONTROL_SUFFIX = "#control"  # a source's id in the latent cache: its target's sample_id + this
_NAMES_LISTED = 5


class DataError(ValueError):
    """A dataset that cannot be used. `key` is the dotted spec key to fix; `message` says what, where and how."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


def reference_suffix(number: int) -> str:
    """The cache id suffix of a target's reference `number` (0-based): `#control`, `#control2`, ..."""
    return CONTROL_SUFFIX if number == 0 else f"{CONTROL_SUFFIX}{number + 1}"


def is_reference(sample_id: str) -> bool:
    """A cache id of a reference (its target's id + `#control`, `#control2`, ...)."""
    return CONTROL_SUFFIX in sample_id


def target_of(sample_id: str) -> str:
    """A cache id -> the id of the target it belongs to (a reference's `#controlK` suffix removed)."""
    return sample_id.split(CONTROL_SUFFIX, 1)[0]


def control_root(data_root: Path, control_dir: str) -> Path:
    """data.control_dir as a folder: absolute, or relative to the dataset folder."""
    path = Path(os.path.expanduser(control_dir))
    return Path(os.path.normpath(path if path.is_absolute() else data_root / path))


def list_controls(root: Path, extensions: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """(relative path without extension -> file, [stems that two files share]) of every image under `root`."""
    found: dict[str, str] = {}
    clashes = []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or not name.lower().endswith(extensions):
                continue
            path = os.path.join(folder, name)
            stem = PurePosixPath(Path(path).relative_to(root).as_posix()).with_suffix("").as_posix()
            if stem in found:
                clashes.append(f"{stem} ({Path(found[stem]).name}, {name})")
            else:
                found[stem] = path
    return found, clashes


def stem_of(sample_id: str) -> str:
    return PurePosixPath(sample_id).with_suffix("").as_posix()


def references_of(record, folders: list) -> tuple[tuple, str | None]:
    """(a dataset record's references, None or what is missing: `reference k: the file looked for`). `folders`:
    (folder, {relative stem: file}) per data.control_dir folder; a record naming its own (metadata.jsonl) keeps them."""
    if record.control_paths:  # named in metadata.jsonl
        paths = record.control_paths
        missing = [(k, f"{path} does not exist") for k, path in enumerate(paths) if not os.path.isfile(path)]
    else:
        stem = stem_of(record.sample_id)
        paths = tuple(controls.get(stem) for _, controls in folders)
        missing = [
            (k, f"no {stem}.* in {folder}") for k, ((folder, _), path) in enumerate(zip(folders, paths)) if path is None
        ]
    if not missing:
        return paths, None
    if len(paths) == 1:
        return paths, None if paths[0] is None else missing[0][1]
    return paths, "; ".join(f"reference {k + 1}: {why}" for k, why in missing)


def reference_count_problem(records: list) -> str | None:
    """Why records naming different numbers of references cannot train together (a batch stacks each
    reference), or None."""
    odd = [r.sample_id for r in records if len(r.control_paths) != len(records[0].control_paths)]
    if not odd:
        return None
    return (
        f"{records[0].sample_id} has {len(records[0].control_paths)} reference(s) in `{CONTROL_FIELD}` but "
        f"{listing(odd)} another number: every target needs the same number of references, in the same order."
    )


def control_outside(root: Path, data) -> None:
    """A folder-layout dataset takes every image under data.path as a target, so the references must live
    elsewhere."""
    for folder in data.control_dirs:
        control = control_root(root, folder).resolve()
        if control == root.resolve() or control.is_relative_to(root.resolve()):
            raise DataError(
                "data.control_dir",
                f"{control} is inside data.path {root}, whose images are all trained as "
                "targets. Keep the sources in a sibling folder (e.g. control_dir: ../control).",
            )


def reference_folders(root: Path, data, extensions: tuple) -> list[tuple[Path, dict[str, str]]]:
    """data.control_dir's folders, each with its images (relative stem -> file); DataError for a folder that is
    not one, or names shared by two files."""
    found = []
    for folder in (control_root(root, one) for one in data.control_dirs):
        if not folder.is_dir():
            raise DataError(
                "data.control_dir",
                f"{folder} is not a folder. Give the folder of source images "
                "(absolute, or relative to data.path, e.g. ../control).",
            )
        controls, clashes = list_controls(folder, extensions)
        if clashes:
            raise DataError(
                "data.control_dir",
                f"{len(clashes)} source names in {folder} have two image files, so "
                f"the pairing is ambiguous: {listing(clashes)}. Keep one file per name.",
            )
        found.append((folder, controls))
    return found


def listing(names: list[str]) -> str:
    """The first few names, then how many more."""
    shown = ", ".join(names[:_NAMES_LISTED])
    return shown + (f", ... and {len(names) - _NAMES_LISTED} more" if len(names) > _NAMES_LISTED else "")


def unpaired_message(unpaired: list[str], total: int, where: str) -> str:
    return (
        f"{len(unpaired)} of {total} target images have no source (control) image: {listing(unpaired)}. Looked "
        f"for {where}. Add their sources or remove the targets, or set data.skip_bad_files: true to train "
        "without them."
    )


def orphans_warning(orphans: list[str], root: Path) -> str:
    return f"{len(orphans)} source images in {root} have no target image and are not used: {listing(sorted(orphans))}"
