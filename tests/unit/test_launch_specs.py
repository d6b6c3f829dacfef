"""Every shipped example spec validates with the flags on its first line, and its golden DeepSpeed JSON in
ds_configs/ is exactly what `dstune compile` makes of it today."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from dstune.cli import main

REPO = Path(__file__).resolve().parents[2]
HEADER = "# validate: dstune validate "
SPECS = sorted(p for p in (REPO / "launch").rglob("*") if p.suffix in (".yaml", ".yml"))
REGENERATE = "the launch spec or the compiler changed: run `make ds-configs` and review the diff"


def test_launch_holds_example_specs():
    names = {p.name for p in SPECS}
    assert len(SPECS) >= 6 and "sd-tiny-demo.yaml" in names, names


def header_flags(spec: Path) -> list[str]:
    """`# validate: dstune validate launch/x.yaml --num-gpus 8` -> ["--num-gpus", "8"]; the path must be this file."""
    first = spec.read_text().splitlines()[0]
    assert first.startswith(HEADER), f"{spec}: the first line must be '{HEADER}{spec.relative_to(REPO)} FLAGS'"
    path, *flags = shlex.split(first[len(HEADER):])
    assert path == str(spec.relative_to(REPO)), f"{spec}: its header names {path}"
    return flags


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_example_validates_and_matches_its_golden_ds_config(spec, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    flags = header_flags(spec)
    code = main(["validate", str(spec.relative_to(REPO)), *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ASSUMED" not in out, "example headers name the world they are planned for"
    assert "\nMemory" in out and "per GPU" in out and "unknown" not in out.split("\nMemory")[1][:80], out
    compiled = tmp_path / "ds.json"
    assert main(["compile", str(spec.relative_to(REPO)), *flags, "-o", str(compiled)]) == 0
    golden = REPO / "ds_configs" / f"{spec.stem}.json"
    assert golden.exists(), f"{golden.relative_to(REPO)} is missing: {REGENERATE}"
    assert json.loads(compiled.read_text()) == json.loads(golden.read_text()), REGENERATE
    assert compiled.read_text() == golden.read_text(), REGENERATE  # same bytes: golden files are never hand-edited


def test_every_golden_ds_config_has_its_spec():
    stems = {p.stem for p in SPECS}
    orphans = [p.name for p in (REPO / "ds_configs").glob("*.json") if p.stem not in stems]
    assert not orphans, f"ds_configs/ files without a launch/ spec (delete them): {orphans}"


def test_the_demo_uses_only_built_in_model_and_data():
    text = (REPO / "launch" / "sd-tiny-demo.yaml").read_text()
    assert "builtin:tiny-sd" in text and "builtin:shapes" in text
    assert "--num-samples" not in header_flags(REPO / "launch" / "sd-tiny-demo.yaml")
