"""A diffusers pipeline folder read as files, torch-free: its index (model_index.json, or modular_model_index.json for a
modular pipeline), a component's config.json, and which components it lacks. The cards' offline checks (validate and
start-up alike) and the torch side read folders so.

A modular pipeline (diffusers' ModularPipeline.save_pretrained) lists each component as [library, class, its load
spec] instead of [library, class]; read_model_index gives both kinds in the second form (the load specs are
modular_entries'), so a card reads a modular folder's classes and components as any other pipeline folder's."""

from __future__ import annotations

import json
from pathlib import Path

from dstune.families.base import FamilyError

MODEL_INDEX = "model_index.json"
MODULAR_INDEX = "modular_model_index.json"  # what diffusers' ModularPipeline.save_pretrained writes instead


def is_modular(folder: Path) -> bool:
    """Whether `folder` is a diffusers modular pipeline: a modular_model_index.json and no model_index.json."""
    folder = Path(folder)
    return (folder / MODULAR_INDEX).is_file() and not (folder / MODEL_INDEX).is_file()


def index_path(folder: Path) -> Path:
    """The file that lists a pipeline folder's components: model_index.json, else modular_model_index.json."""
    return folder / (MODULAR_INDEX if is_modular(folder) else MODEL_INDEX)


def read_model_index(folder: Path) -> dict:
    """The parsed index of a diffusers pipeline folder (model_index.json, or a modular pipeline's
    modular_model_index.json with each component entry cut to [library, class]), or FamilyError saying why not."""
    folder = Path(folder)
    path = index_path(folder)
    if not path.is_file():
        raise FamilyError(
            f"{folder}: no {MODEL_INDEX} (nor {MODULAR_INDEX}), so this is not a diffusers pipeline folder. Give a "
            "folder written by `pipeline.save_pretrained(...)` (model_index.json plus one subfolder per "
            "component), a hub id that is already downloaded, or a built-in model (builtin:tiny-sd)."
        )
    return class_entries(_read_index_file(path))


def class_entries(index: dict) -> dict:
    """A parsed pipeline index with each modular component entry ([library, class, load spec]) cut to
    [library, class], as model_index.json lists components; other keys unchanged."""
    return {name: _class_entry(entry) for name, entry in index.items()}


def modular_entries(folder: Path) -> dict[str, dict]:
    """A modular pipeline folder's component load specs (name -> {pretrained_model_name_or_path, subfolder, ...}),
    as modular_model_index.json lists them; FamilyError when the file is not a JSON object."""
    index = _read_index_file(Path(folder) / MODULAR_INDEX)
    return {name: dict(entry[2]) for name, entry in index.items() if _is_modular_entry(entry)}


def _is_modular_entry(entry) -> bool:
    return isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict)


def _class_entry(entry):
    return entry[:2] if _is_modular_entry(entry) else entry


def _read_index_file(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FamilyError(f"{path}: cannot read it as JSON ({err})") from None
    if not isinstance(index, dict):
        raise FamilyError(f"{path}: expected a JSON object, found {type(index).__name__}")
    return index


def read_component_config(folder: Path, name: str) -> dict:
    """`folder/name/config.json` of a pipeline component; FamilyError naming the file when it is not JSON."""
    path = folder / name / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FamilyError(f"{path}: cannot read it as JSON ({err})") from None


def component_problems(folder: Path, index: dict, components: dict) -> list[str]:
    """Why a pipeline folder lacks what a model needs: each component of `components` (name -> the class
    model_index.json must list, or None for any) listed in the folder's index and present as a subfolder."""
    problems = []
    listing = index_path(Path(folder)).name
    for name, expected in components.items():
        entry = index.get(name)
        listed = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if listed is None or not (folder / name).is_dir():
            problems.append(f"no `{name}` component ({listing} entry and {name}/ subfolder)")
        elif expected is not None and listed != expected:
            problems.append(f"`{name}` is a {listed}; expected {expected}")
    return problems
