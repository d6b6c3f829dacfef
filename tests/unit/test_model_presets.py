"""`dstune init --model NAME`: one spec per model dstune trains, with its real defaults, that validates as printed and
fits the GPUs its header names.

The list of models (each card's presets, dstune.registry.presets) is checked against the spec's family union
and the built-in models."""

from __future__ import annotations

import re

import pytest
import yaml

from dstune.builtin import BUILTIN_MODELS
from dstune.cli import main
from dstune.spec.models import AUDIO_FAMILIES, FAMILIES, VIDEO_FAMILIES
from dstune import registry


# built-ins whose model has no `init` preset, and why (a preset validates offline from configs stored with dstune)
WITHOUT_PRESET = {
    "tiny-ltx2-5": "LTX-2.5 has no one folder to store: its text encoder is a Gemma 4 of the user's choosing "
    "(docs/family-ltx2.md), so validate reads its configs from the user's download",
}


def test_every_family_and_every_builtin_model_has_its_model():
    assert set(FAMILIES) == {preset.family for preset in registry.presets()}
    builtins = [preset.builtin for preset in registry.presets()] + list(WITHOUT_PRESET)
    assert sorted(builtins) == sorted(BUILTIN_MODELS), "each built-in model is the tiny twin of exactly one model"
    for preset in registry.presets():
        assert BUILTIN_MODELS[preset.builtin].family == preset.family, preset.name
    assert len(set([preset.name for preset in registry.presets()])) == len(registry.presets())


def init_model(capsys, tmp_path, name: str):
    path = tmp_path / f"{name}.yaml"
    assert main(["init", "--model", name, "-o", str(path)]) == 0
    capsys.readouterr()
    return path, yaml.safe_load(path.read_text())


def validate(capsys, *args: str) -> tuple[int, str]:
    code = main(["validate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("preset", registry.presets(), ids=lambda p: p.name)
def test_init_model_prints_the_models_defaults_and_validates_as_printed(capsys, tmp_path, monkeypatch, preset):
    path, spec = init_model(capsys, tmp_path, preset.name)
    assert spec["model"]["family"] == preset.family and spec["model"]["pretrained"] == preset.pretrained
    for dotted, value in preset.values.items():
        section, *keys = dotted.split(".")
        node = spec[section]
        for key in keys:
            node = node[key]
        assert node == value, dotted
    # only the family's keys: no speech keys for pictures, no picture or video keys for speech, no video for images
    if preset.family in AUDIO_FAMILIES:
        assert not {"resolution", "video", "buckets", "random_flip"} & set(spec["data"])
        assert not {"guidance", "steps"} & set(spec["sample"] or {})
    else:
        assert not {"min_clip_seconds", "speaker_balance", "duration_bucket_seconds"} & set(spec["data"])
        assert ("video" in spec["data"]) == (preset.family in VIDEO_FAMILIES)
    # as printed, on the GPUs its header names: the published checkpoint is not on this machine, so the plan is
    # offline, its size counted from the configs stored with dstune (an empty hub cache: never this machine's)
    header = re.search(
        rf"^# Sized for \d+ GPUs of .*: `dstune validate {path.name} (--num-gpus \d+ --gpu-memory \S+)` "
        r"says it fits",
        path.read_text(),
        re.M,
    )
    assert header, path.read_text()[:600]
    assert header.group(1) == f"--num-gpus {preset.num_gpus} --gpu-memory {preset.gpu_memory}"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    code, text = validate(capsys, path, *header.group(1).split(), "--num-samples", "1000", "--require-fit")
    assert code == 0, text
    assert f"--gpu-memory         {preset.gpu_memory.removesuffix('GB')} GB: fits" in text, text
    monkeypatch.delenv("HF_HUB_CACHE")
    # pointed at the built-in tiny model of the same layout, whose configs validate checks the keys against
    data = (
        "builtin:tones"
        if preset.family in AUDIO_FAMILIES
        else "builtin:moving-shapes"
        if preset.family in VIDEO_FAMILIES
        else "builtin:shapes"
    )
    tiny = ["--set", f"model.pretrained=builtin:{preset.builtin}", "--set", f"data.path={data}"]
    if "data.control_dir" in preset.values:  # built-in data has no source images to pair: the data stays planned
        tiny = tiny[:2] + ["--num-samples", "1000"]
    code, text = validate(capsys, path, "--num-gpus", "2", *tiny)
    assert code == 0, text


def test_init_with_an_unknown_model_lists_the_models_and_exits_2(capsys):
    code = main(["init", "--model", "nope"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "unknown model 'nope'" in err
    for preset in registry.presets():
        assert f"  {preset.name} " in err and preset.pretrained in err


def test_init_model_list_prints_the_models(capsys):
    assert main(["init", "--model", "list"]) == 0
    out, _ = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines()[1:]] == [preset.name for preset in registry.presets()]


def test_init_model_and_family_together_is_a_usage_error(capsys):
    assert main(["init", "--model", "flux", "--family", "flow"]) == 2
    assert "not both" in capsys.readouterr().err
