"""A diffusers pipeline folder read as files, torch-free: its model_index.json, a component's config.json, and which
components it lacks. The cards' offline checks (validate and start-up alike) and the torch side read folders so."""

from __future__ import annotations

import json
from pathlib import Path

from dstune.families.base import FamilyError

MODEL_INDEX = "model_index.json"


def read_model_index(folder: Path) -> dict:
    """The parsed model_index.json of a diffusers pipeline folder, or FamilyError saying why not."""
    path = folder / MODEL_INDEX
    if not path.is_file():
        raise FamilyError(
            f"{folder}: no {MODEL_INDEX}, so this is not a diffusers pipeline folder. Give a folder written by "
            "`pipeline.save_pretrained(...)` (model_index.json plus one subfolder per component), a hub id that is "
            "already downloaded, or a built-in model (builtin:tiny-sd)."
        )
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
    model_index.json must list, or None for any) listed in model_index.json and present as a subfolder."""
    problems = []
    for name, expected in components.items():
        entry = index.get(name)
        listed = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if listed is None or not (folder / name).is_dir():
            problems.append(f"no `{name}` component (model_index.json entry and {name}/ subfolder)")
        elif expected is not None and listed != expected:
            problems.append(f"`{name}` is a {listed}; expected {expected}")
    return problems
