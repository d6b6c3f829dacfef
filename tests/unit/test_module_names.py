"""`deepspeed dstune/train.py` puts dstune/ first on sys.path, so a module there named like the standard library or
a dependency (logging.py, types.py, torch.py ...) would replace it for the whole process."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dstune"
DEPENDENCIES = {
    "torch",
    "deepspeed",
    "diffusers",
    "transformers",
    "yaml",
    "pydantic",
    "rich",
    "safetensors",
    "accelerate",
    "peft",
    "numpy",
    "PIL",
    "pytest",
    "hypothesis",
    "tokenizers",
    "huggingface_hub",
}


def declared_dependencies() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].replace("-", "_").lower() for r in requirements}


def shadowing_names() -> set[str]:
    return set(sys.stdlib_module_names) | DEPENDENCIES | declared_dependencies()


def module_names() -> dict[str, Path]:
    """Every importable name directly under dstune/ and its subpackages: module stems and package folders."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        if "__pycache__" not in path.parts and not path.stem.startswith("__"):
            names.setdefault(path.stem, path)
    for path in PACKAGE.rglob("__init__.py"):
        if path.parent != PACKAGE:
            names.setdefault(path.parent.name, path.parent)
    return names


def test_finds_the_modules():
    assert {"cli", "plan", "validate", "startup"} <= set(module_names())


def test_no_module_shadows_the_standard_library_or_a_dependency():
    bad = {
        name: str(path.relative_to(REPO))
        for name, path in module_names().items()
        if name in shadowing_names() or name.lower() in shadowing_names()
    }
    assert not bad, f"rename these (under `deepspeed dstune/train.py` they shadow the module of that name): {bad}"


def test_the_check_would_catch_the_classic_mistakes():
    assert {"logging", "types", "io", "profile", "torch", "yaml", "PIL", "deepspeed"} <= shadowing_names()


def imported_name(path: Path) -> str:
    """The module name pytest imports a test file under: its basename, qualified by the packages (folders with an
    __init__.py) it sits in, as pytest's default import mode puts the first folder above them on sys.path."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def test_test_files_have_unique_module_names():
    """tests/ is not a package, so pytest imports each test file by its basename (qualified by the packages it is in:
    tests/unit/models/<unit>/ are): two files of one name (one in tests/unit, one in tests/dist) stop collection of
    the whole suite."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        name = imported_name(path)
        if name in seen:
            clashes.append(f"{seen[name].relative_to(REPO)} and {path.relative_to(REPO)}")
        seen.setdefault(name, path)
    assert not clashes, "rename one of: " + "; ".join(clashes)


def test_a_test_in_a_unit_folder_is_imported_under_its_package(tmp_path):
    (tmp_path / "unit" / "models" / "wan").mkdir(parents=True)
    for folder in ("models", "models/wan"):
        (tmp_path / "unit" / folder / "__init__.py").write_text("")
    assert imported_name(tmp_path / "unit" / "models" / "wan" / "test_wan.py") == "models.wan.test_wan"
    assert imported_name(tmp_path / "unit" / "test_wan.py") == "test_wan"
