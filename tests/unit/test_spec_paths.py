"""One rule for relative paths: in the spec file, from the spec file's folder; on the command line (--set), from the
current directory; data.control_dir from data.path; ambiguous ones are warned about (dstune/spec/paths.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from dstune.cli import main
from dstune.spec.load import load_spec


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """tmp/specs holds the spec; the command runs in tmp/cwd."""
    specs, cwd = tmp_path / "specs", tmp_path / "cwd"
    specs.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return specs, cwd


def line_of(path: Path, text: str) -> int:
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def write_spec(specs: Path, **sections) -> Path:
    spec = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": {"resolution": 32},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4},
    }
    for name, values in sections.items():
        spec[name] = {**spec.get(name, {}), **values}
    path = specs / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_paths_written_in_the_spec_are_taken_from_the_spec_files_folder(folders):
    specs, cwd = folders
    (specs / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    path = write_spec(
        specs,
        data={"path": "images", "control_dir": "../source", "cache": {"dir": "cache/{node}"}},
        output={"dir": "runs/a", "cache_dir": "models"},
        deepspeed={"config": "ds.json"},
        model={"pretrained": "some-org/some-model"},
    )
    spec, source = load_spec(Path("..") / "specs" / "spec.yaml")
    assert spec.data.path == str(specs / "images")
    assert spec.data.cache.dir == str(specs / "cache" / "{node}")
    assert spec.output.dir == str(specs / "runs" / "a")
    assert spec.output.cache_dir == str(specs / "models")
    assert spec.deepspeed.config == str(specs / "ds.json")
    assert spec.data.control_dir == "../source"  # relative to data.path, wherever that is
    assert spec.model.pretrained == "some-org/some-model"  # not under the spec's folder: a hub id, as written
    assert source.warnings == []
    assert path.parent == specs


def test_paths_given_with_set_are_taken_from_the_current_directory(folders):
    specs, cwd = folders
    (cwd / "mine.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    path = write_spec(specs, output={"dir": "runs/a"})
    spec, _ = load_spec(path, ["output.dir=runs/b", "deepspeed.config=mine.json", "data.path=images"])
    assert spec.output.dir == "runs/b" and spec.data.path == "images"  # as typed: the shell's directory
    assert spec.deepspeed.config == str(cwd / "mine.json")  # not the spec's folder, as it used to be


def test_a_spec_in_the_current_directory_keeps_its_relative_paths(folders, monkeypatch):
    specs, _ = folders
    monkeypatch.chdir(specs)
    spec, source = load_spec(write_spec(specs, data={"path": "images"}, output={"dir": "runs/a"}).name)
    assert (spec.data.path, spec.output.dir, source.warnings) == ("images", "runs/a", [])


def test_a_path_only_under_the_current_directory_is_warned_about(folders):
    specs, cwd = folders
    (cwd / "images").mkdir()
    (cwd / "local-model").mkdir()
    path = write_spec(specs, data={"path": "images"}, model={"pretrained": "local-model"})
    spec, source = load_spec(path)
    assert spec.data.path == str(specs / "images")
    assert spec.model.pretrained == "local-model"  # may be a hub id: kept, from the current directory
    warnings = {issue.key: issue for issue in source.warnings}
    assert set(warnings) == {"data.path", "model.pretrained"}
    data_warning = warnings["data.path"]
    assert data_warning.severity == "warning" and data_warning.where == f"{path}:{line_of(path, 'path: images')}"
    assert str(specs / "images") in data_warning.message and str(cwd / "images") in data_warning.message
    assert "absolute path" in data_warning.message
    assert str(cwd / "local-model") in warnings["model.pretrained"].message


def test_a_path_under_both_folders_uses_the_spec_folder_and_says_so(folders):
    specs, cwd = folders
    for root in (specs, cwd):
        (root / "images").mkdir()
    (specs / "model").mkdir()
    spec, source = load_spec(write_spec(specs, data={"path": "images"}, model={"pretrained": "model"}))
    assert spec.data.path == str(specs / "images")
    assert spec.model.pretrained == str(specs / "model")  # under the spec's folder: the rule applies
    (warning,) = source.warnings
    assert warning.key == "data.path" and "which is what is used" in warning.message


def test_validate_counts_the_images_beside_the_spec_from_another_directory(folders, capsys):
    specs, cwd = folders
    (specs / "images").mkdir()
    for index in range(8):
        Image.new("RGB", (32, 32), (index * 30, 0, 0)).save(specs / "images" / f"{index}.png")
        (specs / "images" / f"{index}.txt").write_text(f"a red square {index}")
    (cwd / "images").mkdir()  # an empty folder of the same name here: the warning names it, the spec's is used
    path = write_spec(specs, data={"path": "images"})
    code = main(["validate", str(path), "--num-gpus", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    (samples,) = [
        line.split() for line in out.splitlines() if line.split()[:1] == ["samples"] and line.split()[1] != "seen"
    ]
    assert samples[1] == "8"
    where = f"{path}:{line_of(path, 'path: images')}"
    assert f"warning: {where}: data.path: 'images' names {specs / 'images'}" in out


def test_dstune_cache_prints_the_ambiguous_path_warning_too(folders, capsys):
    specs, cwd = folders
    (cwd / "images").mkdir()
    path = write_spec(specs, data={"path": "images"})
    assert main(["cache", str(path), "--verify"]) == 1  # nothing to cache: this spec asks for no cache
    err = capsys.readouterr().err
    assert f"warning: {path}:{line_of(path, 'path: images')}: data.path: 'images' is taken from the spec" in err
    assert str(cwd / "images") in err


def test_built_ins_go_to_one_user_cache_whatever_folder_a_run_starts_from(tmp_path, monkeypatch):
    """output.cache_dir left out: $DSTUNE_CACHE, else $XDG_CACHE_HOME/dstune, else ~/.cache/dstune, the same
    absolute folder from any working folder (never a per-folder .dstune-cache)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "sd"},
                "data": {"path": "builtin:shapes"},
                "train": {"micro_batch_size": 1, "max_steps": 1},
            }
        )
    )
    monkeypatch.delenv("DSTUNE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    found = set()
    for folder in (tmp_path, tmp_path / "elsewhere"):
        folder.mkdir(exist_ok=True)
        monkeypatch.chdir(folder)
        found.add(load_spec(spec)[0].output.cache_dir)
    assert found == {str(tmp_path / "xdg" / "dstune")}
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_spec(spec)[0].output.cache_dir == str(tmp_path / "home" / ".cache" / "dstune")
    monkeypatch.setenv("DSTUNE_CACHE", "shared/cache")  # relative: from where the command runs
    assert load_spec(spec)[0].output.cache_dir == str(tmp_path / "elsewhere" / "shared" / "cache")
    assert load_spec(spec, ["output.cache_dir=mine"])[0].output.cache_dir == "mine"  # written: as given
