"""The model section's folders checked offline, torch-free: what `dstune validate` can say about them before launch.

    locate(reference) -> Location            where a folder key points (dstune.pretrained resolves the same way)
    model_folder_issues(spec, source, num_samples) -> [SpecIssue]   (num_samples: --num-samples, for offline plans)

Per key: a `builtin:` name must be a built-in (else the list of them and the nearest name); a local path must exist
(shown as resolved); a hub id (`org/name`) missing from the local Hugging Face cache is a warning with the download
command, since dstune never downloads and the run would stop at start-up. The folder of a key that names the model
itself (the section's MODEL_FOLDER_FIELDS) must hold a class the family trains (its models' cards, folder_classes): a
diffusers folder's model_index.json `_class_name` or a transformers folder's config.json `architectures`; when it
does not, the family that does train it is named. A built-in is checked through its stored configs, and so is a hub
id that is not downloaded but whose configs are stored with dstune.
"""

from __future__ import annotations

import difflib
import json
import os
import typing
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Optional

from dstune import registry
from dstune.hf import HUB_ID, NotAvailableLocally, hub_snapshot
from dstune.memory.counts import BUILTIN_FOLDERS, SizesUnknown, config_folder
from dstune.spec.load import SpecIssue, SpecSource
from dstune.spec.models import MODEL_SECTIONS, is_single_file
from dstune.spec.section import BUILTIN_PREFIX

MODEL_INDEX, CONFIG = "model_index.json", "config.json"
MODULAR_INDEX = "modular_model_index.json"  # what diffusers' ModularPipeline.save_pretrained writes instead


@dataclass(frozen=True)
class Location:
    """kind: "builtin" (a known built-in; path None: built at start-up), "unknown-builtin", "folder", "file",
    "hub" (path: the local snapshot), "hub-missing" (a hub id not in the local cache), "missing" (no such path)."""

    kind: str
    path: Optional[Path] = None
    problem: str = ""  # why a hub id is not usable here (hf's reason)


def locate(reference: str) -> Location:
    """Where a model reference points, without building or downloading anything."""
    if reference.startswith(BUILTIN_PREFIX):
        known = reference[len(BUILTIN_PREFIX) :] in BUILTIN_FOLDERS
        return Location("builtin" if known else "unknown-builtin")
    path = Path(reference).expanduser()
    if path.exists():
        return Location("folder" if path.is_dir() else "file", path.resolve())
    if not HUB_ID.fullmatch(reference):
        return Location("missing", path.absolute())
    try:
        return Location("hub", hub_snapshot(reference))
    except NotAvailableLocally as err:
        return Location("hub-missing", path.absolute(), str(err))


def builtin_name_problem(reference: str) -> str:
    """Why `builtin:NAME` is not a built-in model: the list of them and the nearest names."""
    name = reference[len(BUILTIN_PREFIX) :]
    longer = sorted(known for known in BUILTIN_FOLDERS if name and known.startswith(name))  # tiny-qwen: -image...
    close = longer[:2] or difflib.get_close_matches(name, BUILTIN_FOLDERS, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(BUILTIN_PREFIX + c for c in close)}?)" if close else ""
    names = ", ".join(BUILTIN_PREFIX + n for n in sorted(BUILTIN_FOLDERS))
    return f"{reference} is not a built-in model{hint}. Known built-in models: {names}."


def folder_classes(folder: Path) -> tuple[str, list[str]]:
    """(the file that names the model's class, the class names) of a model folder; ValueError saying why there are
    none. A diffusers pipeline names its class in model_index.json (a modular pipeline in modular_model_index.json),
    a transformers model in config.json."""
    for name, key in ((MODEL_INDEX, "_class_name"), (MODULAR_INDEX, "_class_name"), (CONFIG, "architectures")):
        path = folder / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get(key)
        except (OSError, ValueError, AttributeError) as err:
            raise ValueError(f"{path} cannot be read as JSON ({err})") from None
        classes = [value] if isinstance(value, str) else [v for v in value or [] if isinstance(v, str)]
        if not classes:
            raise ValueError(f"{path} names no {key}")
        return name, classes
    raise ValueError(
        f"{folder} holds neither {MODEL_INDEX} (a diffusers pipeline) nor {CONFIG} (a transformers "
        "model), so it is not a model folder"
    )


def modular_pipeline_problem(shown: str, name: str) -> str:
    """Why a diffusers modular pipeline folder (modular_model_index.json, no model_index.json) whose class no model
    of dstune's trains is refused: what it is, and where the modular format's support is written down."""
    return (
        f"{shown} is a diffusers modular pipeline ({name} in {MODULAR_INDEX}, no {MODEL_INDEX}), and no model "
        f"dstune trains is a {name} (dstune loads, samples and exports modular pipelines of the models it trains: "
        "docs/family-flow.md, 'Modular pipelines')"
    )


def family_of(section) -> str:
    """The model.family value of a model section class."""
    return typing.get_args(section.model_fields["family"].annotation)[0]


def families_training(class_name: str) -> list[str]:
    """The model.family values one of whose models trains folders of class `class_name` (its card's
    folder_classes)."""
    return [
        family_of(section)
        for section in MODEL_SECTIONS
        if any(fnmatchcase(class_name, pattern) for pattern in registry.family_classes(family_of(section)))
    ]


def trained_classes_text() -> str:
    """What dstune trains, per family, for messages."""
    return "; ".join(
        f"{family_of(section)}: {', '.join(registry.family_classes(family_of(section)))}" for section in MODEL_SECTIONS
    )


def class_problem(model, field: str, folder: Path, shown: str) -> Optional[tuple[str, str]]:
    """(dotted key, why) when the model folder `folder` (shown as `shown`) is not one model.family trains: the key
    is model.family when another family trains it, else model.<field>. None when it fits."""
    key = f"model.{field}"
    try:
        file_name, classes = folder_classes(folder)
    except ValueError as err:
        return key, f"{err}. dstune trains {trained_classes_text()}."
    family = model.family
    if any(family in families_training(name) for name in classes):
        return None
    what = " / ".join(classes)
    fits = sorted({other for name in classes for other in families_training(name)})
    if not fits and file_name == MODULAR_INDEX:
        return key, f"{modular_pipeline_problem(shown, what)}. dstune trains {trained_classes_text()}."
    if not fits:
        return key, (
            f"{shown} is a {what} ({file_name}), which no dstune family trains. dstune trains "
            f"{trained_classes_text()}. Point {key} at one of those."
        )
    return "model.family", (
        f"{shown} is a {what} ({file_name}), which model.family {' or '.join(fits)} trains, not {family} "
        f"({', '.join(registry.family_classes(family))}). Set model.family: {fits[0]}, or point {key} at a {family} "
        "model."
    )


def model_folder_issues(spec, source: SpecSource, num_samples: Optional[int] = None) -> list[SpecIssue]:
    """Every folder and file key of spec.model, checked offline. When validating for another machine (data.path is
    not here and --num-samples stands in for it), a local path that is missing here is a warning."""
    data_path = spec.data.path
    offline = (
        num_samples is not None
        and not data_path.startswith(BUILTIN_PREFIX)
        and not os.path.exists(os.path.expanduser(data_path))
    )
    model = spec.model
    section = type(model)
    issues: list[SpecIssue] = []
    for field in section.MODEL_FOLDER_FIELDS:
        reference = getattr(model, field, None)
        if reference:
            issues += _model_folder(model, field, reference, source, offline)
    pretrained = locate(model.pretrained)
    for field, subfolder in section.COMPANION_FOLDERS.items():
        reference = getattr(model, field, None)
        if reference:
            issues += _reference_issues(field, reference, locate(reference), source, offline)
        elif pretrained.kind in ("folder", "hub") and not (pretrained.path / subfolder).is_dir():
            issues.append(
                source.issue(
                    f"model.{field}",
                    f"unset, so it is read from {pretrained.path / subfolder}, "
                    f"which does not exist: set model.{field} to its folder (or hub id), or put "
                    f"it in {subfolder}/ of model.pretrained",
                )
            )
    for field in section.FILE_FIELDS:
        reference = getattr(model, field, None)
        if reference and not Path(reference).expanduser().is_file():
            issues.append(_missing(field, "file", reference, source, offline))
    return issues


def _model_folder(model, field: str, reference: str, source: SpecSource, offline: bool) -> list[SpecIssue]:
    location = locate(reference)
    if field == "pretrained" and is_single_file(reference):  # a checkpoint file: its base_pipeline is the folder
        return [] if location.kind == "file" else [_missing(field, "checkpoint file", reference, source, offline)]
    issues = _reference_issues(field, reference, location, source, offline)
    if any(issue.severity == "error" for issue in issues):
        return issues
    try:  # the configs: the folder, the local snapshot, a built-in's stored ones or a hub model's stored with dstune
        folder = location.path if location.kind in ("folder", "hub") else config_folder(reference)[0]
    except SizesUnknown:
        return issues  # a hub id neither downloaded nor stored: start-up checks it once it is there
    problem = class_problem(model, field, folder, str(folder) if location.kind == "folder" else reference)
    return issues + ([source.issue(*problem)] if problem else [])


def _reference_issues(
    field: str, reference: str, location: Location, source: SpecSource, offline: bool
) -> list[SpecIssue]:
    key = f"model.{field}"
    if location.kind == "unknown-builtin":
        return [source.issue(key, builtin_name_problem(reference))]
    if location.kind == "missing":
        return [_missing(field, "folder", reference, source, offline)]
    if location.kind == "file":
        return [
            source.issue(
                key, f"{location.path} is a file; model.{field} must be a folder (or a hub id, or a built-in model)"
            )
        ]
    download = f"`hf download {reference}` (or `huggingface-cli download {reference}`)"
    if location.kind == "hub-missing" and offline:
        return [
            source.issue(
                key,
                f"{reference} is not in this machine's Hugging Face cache. dstune never downloads: "
                f"on the machines that train, run {download} before launching, or start-up stops there.",
                severity="warning",
            )
        ]
    if location.kind == "hub-missing":
        return [
            source.issue(
                key,
                (
                    f"{reference} is not in the local Hugging Face cache (nor a folder here: {location.path}). dstune never "
                    f"downloads, so the run would stop at start-up on every rank, before step 1. Download it first: "
                    f"{download}, or set model.{field} to a local folder."
                ),
                severity="warning",
            )
        ]
    return []


def _missing(field: str, what: str, reference: str, source: SpecSource, offline: bool) -> SpecIssue:
    path = Path(reference).expanduser().absolute()
    if offline:
        return source.issue(
            f"model.{field}",
            f"{what} {path} is not on this machine (validating offline for another "
            "one, as data.path is not here either): start-up checks it there",
            severity="warning",
        )
    relative = "" if Path(reference).expanduser().is_absolute() else f" (relative to {os.getcwd()})"
    other = ", or use a hub id already downloaded or a built-in model" if what == "folder" else ""
    return source.issue(f"model.{field}", f"{what} {path} does not exist{relative}. Fix the path{other}.")
