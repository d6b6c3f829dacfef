"""`dstune validate` of the reference-image models at real size, offline (their configs are stored with dstune): a
folder of (reference, target) pairs for FLUX.1 Kontext [dev], FLUX.2 [dev] and FLUX.2 [klein] image-to-image
validates and plans both pictures; a sample whose reference is missing is named, with the file looked for, in
either layout (data.control_dir, metadata.jsonl `control_file_name`), and validate exits 1."""

from __future__ import annotations

import json

import pytest
import yaml
from PIL import Image

from dstune.cli import main

MODELS = ("black-forest-labs/FLUX.1-Kontext-dev", "black-forest-labs/FLUX.2-dev", "black-forest-labs/FLUX.2-klein-4B")


def _pairs(root, names=("a", "b", "c")) -> None:
    for name in names:
        for folder in ("target", "control"):
            (root / folder).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (64, 64), (40, 80, 120)).save(root / folder / f"{name}.png")
        (root / "target" / f"{name}.txt").write_text(f"make {name} red")


def _validate(tmp_path, capsys, model: str, data: dict) -> tuple[int, str, dict]:
    spec = {
        "model": {"family": "flow", "pretrained": model, "train": "lora", "gradient_checkpointing": True},
        "data": {"resolution": 1024, "allow_upscaling": True, "cache": {"latents": True}, **data},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "epochs": 1, "precision": "bf16"},
        "deepspeed": {"zero_stage": 3},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["validate", str(path), "--num-gpus", "2"])
    text = capsys.readouterr()
    plan = {}
    if code == 0:
        assert main(["validate", str(path), "--num-gpus", "2", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
    return code, text.out + text.err, plan


@pytest.mark.parametrize("model", MODELS)
def test_a_folder_of_pairs_validates_and_plans_the_references(tmp_path, capsys, model):
    _pairs(tmp_path)
    code, out, plan = _validate(
        tmp_path, capsys, model, {"path": str(tmp_path / "target"), "control_dir": "../control"}
    )
    assert code == 0, out
    assert "3 source/target pairs" in out
    # the same targets alone (FLUX.2 text-to-image; Kontext's transformer and VAE as FLUX.1 [dev]'s): half the
    # latent cache, since the references' latents are cached beside the targets'
    alone = "black-forest-labs/FLUX.1-dev" if "Kontext" in model else model
    code, out, targets = _validate(tmp_path, capsys, alone, {"path": str(tmp_path / "target")})
    assert code == 0, out
    assert plan["memory"]["cache_disk_bytes"] == 2 * targets["memory"]["cache_disk_bytes"] > 0


@pytest.mark.parametrize("model", MODELS)
def test_a_sample_missing_its_reference_is_named_with_the_file_looked_for(tmp_path, capsys, model):
    _pairs(tmp_path)
    (tmp_path / "control" / "b.png").unlink()
    code, out, _ = _validate(tmp_path, capsys, model, {"path": str(tmp_path / "target"), "control_dir": "../control"})
    assert code == 1
    assert "data.control_dir" in out and "1 of 3 target images have no source (control) image: b.png" in out
    assert f"Looked for a file with the same relative path and name in {tmp_path / 'control'}" in out
    (tmp_path / "target" / "src").mkdir()
    for name in "ac":  # the metadata layout: each line names its reference, b's is not there
        (tmp_path / "control" / f"{name}.png").rename(tmp_path / "target" / "src" / f"{name}.png")
    lines = [{"file_name": f"{n}.png", "text": n, "control_file_name": f"src/{n}.png"} for n in "abc"]
    (tmp_path / "target" / "metadata.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code, out, _ = _validate(tmp_path, capsys, model, {"path": str(tmp_path / "target")})
    assert code == 1 and "data.path" in out
    assert f"b.png ({tmp_path / 'target' / 'src' / 'b.png'} does not exist)" in out
    assert "Traceback" not in out
