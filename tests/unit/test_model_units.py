"""A model is one unit: each model's names appear only in its own folder (dstune/models/<name>/) and the registry,
and the registry's derived tables are what the rest of dstune uses."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from dstune.models import registry

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dstune"
CONSTANT_KEYS = json.loads((PACKAGE / "model_configs" / "activation_constants.json").read_text())["models"]


def _mentions(unit, package: Path = PACKAGE) -> list[str]:
    pattern = re.compile(rf"(?<![\w])(?:{unit.names})(?![\w])", re.IGNORECASE)
    own = package / "models" / unit.name
    registry_files = {package / "models" / "registry.py", package / "models" / "unit.py"}
    return sorted(
        str(path.relative_to(package.parent))
        for path in package.rglob("*.py")
        if own not in path.parents and path not in registry_files and pattern.search(_code(path))
    )


def _code(path: Path) -> str:
    """The file without its units' `names=` patterns (a pattern that says which names are another unit's is not a
    mention of that model) and without the keys of the measured activation constants as string literals (a model
    whose block was not measured names the measured block it is estimated with: the table's key, not its model)."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("names=r"))
    for key in CONSTANT_KEYS:
        text = text.replace(f'"{key}"', '""')
    return text


def test_each_model_is_named_only_in_its_unit_and_the_registry():
    outside = {unit.name: _mentions(unit) for unit in registry.UNITS}
    assert {name: files for name, files in outside.items() if files} == {}


def test_the_registry_imports_no_torch():
    code = "import dstune.models.registry, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_every_unit_folder_is_registered_once():
    folders = {path.parent.name for path in (PACKAGE / "models").glob("*/unit.py")}
    names = [unit.name for unit in registry.UNITS]
    assert sorted(names) == sorted(folders) and len(set(names)) == len(names)


def test_the_check_sees_a_mention_and_ignores_the_unit_and_the_registry(tmp_path):
    """On a copy-shaped package: a mention in a core module is found; the unit's own files and the registry's are
    not counted (so the empty result above means something)."""
    unit = next(unit for unit in registry.UNITS if unit.name == "wan")
    package = tmp_path / "dstune"
    for relative, text in {
        "families/video.py": '"""Trains Wan 2.1 clips."""',
        "models/wan/recipe.py": "WAN = 1",
        "models/registry.py": "from dstune.models.wan.unit import UNIT as WAN",
        "families/flow.py": '"""No video model here; wanted: nothing."""',
    }.items():
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(text + "\n")
    assert _mentions(unit, package) == ["dstune/families/video.py"]


def test_every_builtin_is_its_units_own():
    """A unit's `builtins` names each BuiltinModel by its own name (the table the built-in cache reads)."""
    from dstune.models.unit import load

    wrong = [
        (unit.name, name)
        for unit in registry.UNITS
        for name, where in unit.builtins.items()
        if load(where).name != name
    ]
    assert wrong == []
