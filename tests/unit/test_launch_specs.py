"""Every shipped example spec validates with the flags on its first line, its golden DeepSpeed JSON in ds_configs/
is exactly what `dstune compile` makes of it today, and its golden plan in tests/data/validate_json/ is exactly what
`dstune validate --json` prints for it today."""

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
VALIDATE_JSON = REPO / "tests" / "data" / "validate_json"
REGENERATE_PLAN = (
    "`dstune validate --json` of this spec changed: if the change is intended, run `make validate-json` "
    "and review (and say in the commit) every difference"
)


def test_launch_holds_example_specs():
    names = {p.name for p in SPECS}
    assert len(SPECS) >= 6 and "sd-tiny-demo.yaml" in names, names


def header_flags(spec: Path) -> list[str]:
    """`# validate: dstune validate launch/x.yaml --num-gpus 8` -> ["--num-gpus", "8"]; the path must be this file."""
    first = spec.read_text().splitlines()[0]
    assert first.startswith(HEADER), f"{spec}: the first line must be '{HEADER}{spec.relative_to(REPO)} FLAGS'"
    path, *flags = shlex.split(first[len(HEADER) :])
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


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_validate_json_of_example_matches_its_golden_plan(spec, tmp_path, capsys, monkeypatch):
    """The whole `dstune validate --json` output (plan, DeepSpeed JSON and where each value came from, warnings, memory
    plan with parameter counts, clips) of each example, byte for byte. Checked to be the same on every run and free of
    anything of this machine (no absolute paths: the spec path is relative to the repository; no host RAM, no time;
    the accelerator only decides fp16's check, and the fp16 example names --accelerator cuda). The one input of the
    machine is its local Hugging Face cache: a hub model found there is counted from its downloaded configs and its
    origin says so. The test (and `make validate-json`) therefore looks in an empty hub cache, so the counts always
    come from the configs stored with dstune (dstune/model_configs). Nothing is normalised or left out."""
    import huggingface_hub.constants

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    code = main(["validate", str(spec.relative_to(REPO)), *header_flags(spec), "--json"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    golden = VALIDATE_JSON / f"{spec.stem}.json"
    assert golden.exists(), f"{golden.relative_to(REPO)} is missing: {REGENERATE_PLAN}"
    assert json.loads(printed) == json.loads(golden.read_text()), REGENERATE_PLAN
    assert printed == golden.read_text(), REGENERATE_PLAN


def test_every_golden_plan_has_its_spec():
    stems = {p.stem for p in SPECS}
    orphans = [p.name for p in VALIDATE_JSON.glob("*.json") if p.stem not in stems]
    assert not orphans, f"tests/data/validate_json/ files without a launch/ spec (delete them): {orphans}"


def test_every_golden_ds_config_has_its_spec():
    stems = {p.stem for p in SPECS}
    orphans = [p.name for p in (REPO / "ds_configs").glob("*.json") if p.stem not in stems]
    assert not orphans, f"ds_configs/ files without a launch/ spec (delete them): {orphans}"


def test_the_demo_uses_only_built_in_model_and_data():
    text = (REPO / "launch" / "sd-tiny-demo.yaml").read_text()
    assert "builtin:tiny-sd" in text and "builtin:shapes" in text
    assert "--num-samples" not in header_flags(REPO / "launch" / "sd-tiny-demo.yaml")
