"""A model is one unit: each model's names appear only in its own folder (dstune/models/<name>/) and the registry,
and the registry's derived tables are what the rest of dstune uses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from dstune.models import registry

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dstune"
REGISTRY_FILES = {PACKAGE / "models" / "registry.py"}


def _mentions(unit) -> list[str]:
    pattern = re.compile(rf"(?<![\w])(?:{unit.names})(?![\w])", re.IGNORECASE)
    own = PACKAGE / "models" / unit.name
    return sorted(str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")
                  if own not in path.parents and path not in REGISTRY_FILES and pattern.search(path.read_text()))


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
