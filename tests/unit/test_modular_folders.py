"""A diffusers modular pipeline folder (modular_model_index.json, no model_index.json) is refused by `dstune validate`
(and so before any rank builds a model) with what it is and where the missing pieces are written down, instead of
"not a model folder". MiniMax-H3 ships only as a modular pipeline (docs/family-minimax-h3.md; docs/family-flow.md, "Modular
pipelines"); the folder here is written by diffusers' own MiniMaxH3ModularPipeline.save_pretrained around its real
transformer and schedulers at tiny sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dstune.cli import main


@pytest.fixture(scope="module")
def modular_folder(tmp_path_factory) -> Path:
    import torch
    from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    torch.manual_seed(0)
    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=32,
        hidden_size=32,
        num_layers=1,
        num_refiner_layers=1,
        ffn_dim=32,
        in_channels=4,
        audio_in_channels=4,
        text_dim=8,
        freq_dim=16,
        time_embed_hidden_dim=16,
        time_embed_dim=16,
        rope_freq_dim=4,
    )
    pipeline = MiniMaxH3Blocks().init_pipeline()
    pipeline.update_components(
        transformer=transformer,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    folder = tmp_path_factory.mktemp("minimax-h3")
    pipeline.save_pretrained(str(folder), overwrite_modular_index=True)
    return folder


def test_the_folder_is_what_diffusers_writes_for_a_modular_pipeline(modular_folder):
    assert (modular_folder / "modular_model_index.json").is_file()
    assert not (modular_folder / "model_index.json").exists()
    assert (modular_folder / "transformer" / "config.json").is_file()


@pytest.mark.parametrize("family", ["video", "flow"])
def test_validate_refuses_a_modular_pipeline_folder_saying_what_it_is(capsys, tmp_path, modular_folder, family):
    spec = {
        "model": {"family": family, "pretrained": str(modular_folder), "train": "lora"},
        "data": {"path": "builtin:moving-shapes" if family == "video" else "builtin:shapes"},
        "train": {"micro_batch_size": 1, "max_steps": 2},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    capsys.readouterr()
    code = main(["validate", str(path), "--num-gpus", "1"])
    out, err = capsys.readouterr()
    text = out + err
    assert code == 1, text
    assert "Traceback" not in text and "internal error" not in text, text
    [line] = [line for line in text.splitlines() if line.startswith("error:")]
    assert "spec.yaml:3: model.pretrained:" in line, line  # model: / family: / pretrained:
    assert (
        f"{modular_folder} is a diffusers modular pipeline (MiniMaxH3ModularPipeline in modular_model_index.json, "
        "no model_index.json)"
    ) in line, line
    assert "docs/family-flow.md, 'Modular pipelines'" in line, line
    assert "video: WanPipeline" in line and "LTX2Pipeline" in line, line  # what dstune does train
    assert "neither model_index.json" not in line, line
