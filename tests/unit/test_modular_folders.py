"""Diffusers modular pipeline folders (modular_model_index.json, no model_index.json) in the core: read as any pipeline
folder's index, rendered through their blocks around parts dstune holds, exported with the components' entries
pointing at the export (so the modular pipeline loads the trained weights, never the source's), and, where no model
dstune trains the folder's class, refused by `dstune validate` with what it is. The folders are written by
diffusers' own MiniMaxH3ModularPipeline.save_pretrained around its real classes at tiny sizes (MiniMax-H3 ships only
as a modular pipeline, and dstune.models.minimax_h3 trains it)."""

from __future__ import annotations

import json
import shutil
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


class TokenTypes:
    """What the MiniMax-H3 text step asks of its Qwen3VLProcessor for a text-only prompt (create_mm_token_type_ids):
    transformers cannot build that processor without torchvision, which this environment cannot import."""

    def __init__(self, tokenizer):
        self.image, self.video = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])

    def create_mm_token_type_ids(self, rows):
        return [[1 if token == self.image else 2 if token == self.video else 0 for token in row] for row in rows]


@pytest.fixture(scope="module")
def whole_folder(tmp_path_factory):
    """A complete tiny MiniMax-H3 modular folder (builtin:tiny-minimax-h3's transformer and VAEs, a Qwen3-VL of 51 text
    layers: the pipeline reads hidden state 50), and the processor stand-in it renders with."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines import MiniMaxH3Blocks
    from transformers import Qwen3VLForConditionalGeneration

    from dstune.builtin.common import deterministic_cpu
    from dstune.builtin.parts import tiny_qwen3_vl_config, tiny_qwen_tokenizer
    from dstune.models.minimax_h3.builtin import TINY_AUDIO_VAE, TINY_TRANSFORMER, TINY_VAE

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]}
    )
    with deterministic_cpu(1, 1):
        parts = dict(
            transformer=MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER),
            vae=AutoencoderKLMiniMaxH3(**TINY_VAE),
            audio_vae=AutoencoderKLMiniMaxH3Audio(**TINY_AUDIO_VAE),
            text_encoder=Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer, 16, 51)),
        )
    pipeline = MiniMaxH3Blocks().init_pipeline()
    pipeline.update_components(
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
        tokenizer=tokenizer,
        **parts,
    )
    folder = tmp_path_factory.mktemp("minimax-h3-whole") / "base"
    pipeline.save_pretrained(str(folder), overwrite_modular_index=True)
    return folder, TokenTypes(tokenizer)


def render(folder, transformer, processor):
    """One t2va render (2 steps, the shortest clip the pipeline makes: 120 frames, rounded up to 124) through the
    core's modular_pipeline around the folder's own loaded parts and `transformer`."""
    import torch
    from diffusers import ModularPipeline

    from dstune.families.modular import modular_pipeline

    loaded = ModularPipeline.from_pretrained(str(folder))
    loaded.load_components(dtype=torch.float32)
    parts = {
        name: getattr(loaded, name)
        for name in ("vae", "audio_vae", "text_encoder", "tokenizer", "scheduler", "audio_scheduler")
    }
    pipeline = modular_pipeline(folder, {**parts, "transformer": transformer, "processor": processor})
    state = pipeline(
        prompt="a red square",
        num_frames=120,
        height=32,
        width=32,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        output=None,
    )
    return state.values["videos"], state.values["audio"]


def test_a_modular_index_reads_as_a_pipeline_index(modular_folder):
    from dstune.families.folders import is_modular, modular_entries, read_model_index

    assert is_modular(modular_folder)
    index = read_model_index(modular_folder)
    assert index["transformer"] == ["diffusers", "MiniMaxH3Transformer3DModel"]
    assert index["_class_name"] == "MiniMaxH3ModularPipeline" and index["_blocks_class_name"] == "MiniMaxH3Blocks"
    assert modular_entries(modular_folder)["transformer"]["pretrained_model_name_or_path"] == str(modular_folder)


def test_an_export_loads_with_the_trained_weights_and_renders_them(whole_folder, tmp_path):
    import torch
    from diffusers import ModularPipeline, MiniMaxH3Transformer3DModel

    from dstune.families.diffusion import export_pipeline_folder
    from dstune.families.folders import modular_entries

    folder, processor = whole_folder
    base = MiniMaxH3Transformer3DModel.from_pretrained(folder, subfolder="transformer")
    trained = MiniMaxH3Transformer3DModel.from_pretrained(folder, subfolder="transformer")
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)))
    out = export_pipeline_folder(folder, tmp_path / "export", "transformer", trained)

    entries = modular_entries(out)
    assert entries["transformer"]["pretrained_model_name_or_path"] == str(out.resolve())
    assert {entry["pretrained_model_name_or_path"] for name, entry in entries.items() if (out / name).is_dir()} == {
        str(out.resolve())
    }  # no component of the export loads from the source
    loaded = ModularPipeline.from_pretrained(str(out))
    loaded.load_components(names=["transformer"], dtype=torch.float32)
    for name, value in trained.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[name], value), name

    base_video, base_audio = render(folder, base, processor)
    video, audio = render(out, loaded.transformer, processor)
    assert video.shape == base_video.shape and audio.shape == base_audio.shape
    assert (video - base_video).abs().max() > 1e-3  # the trained weights render, not the source's


def test_the_folder_is_what_diffusers_writes_for_a_modular_pipeline(modular_folder):
    assert (modular_folder / "modular_model_index.json").is_file()
    assert not (modular_folder / "model_index.json").exists()
    assert (modular_folder / "transformer" / "config.json").is_file()


def validate_lines(capsys, tmp_path, folder, family):
    spec = {
        "model": {"family": family, "pretrained": str(folder), "train": "lora"},
        "data": {"path": "builtin:moving-shapes" if family == "video" else "builtin:shapes"},
        "train": {"micro_batch_size": 1, "max_steps": 2},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    capsys.readouterr()
    code = main(["validate", str(path), "--num-gpus", "1"])
    out, err = capsys.readouterr()
    text = out + err
    assert "Traceback" not in text and "internal error" not in text, text
    return code, [line for line in text.splitlines() if line.startswith("error:")], text


def test_validate_refuses_a_modular_pipeline_folder_no_model_trains_saying_what_it_is(capsys, tmp_path, modular_folder):
    """A modular folder whose pipeline class no model dstune trains (here MiniMax-H3's folder relabelled as diffusers'
    EchoModularPipeline, which exists only as a modular pipeline)."""
    other = tmp_path / "echo"
    shutil.copytree(modular_folder, other)
    index = json.loads((other / "modular_model_index.json").read_text())
    index["_class_name"] = "EchoModularPipeline"
    (other / "modular_model_index.json").write_text(json.dumps(index))
    code, [line], text = validate_lines(capsys, tmp_path, other, "video")
    assert code == 1, text
    assert "spec.yaml:3: model.pretrained:" in line, line  # model: / family: / pretrained:
    assert (
        f"{other} is a diffusers modular pipeline (EchoModularPipeline in modular_model_index.json, no model_index.json)"
    ) in line, line
    assert "docs/family-flow.md, 'Modular pipelines'" in line, line
    assert "video: WanPipeline" in line and "MiniMaxH3ModularPipeline" in line, line  # what dstune does train
    assert "neither model_index.json" not in line, line


def test_a_modular_folder_a_model_trains_is_that_models_family(capsys, tmp_path, modular_folder):
    """MiniMax-H3's modular folder is the video family's (dstune.models.minimax_h3): model.family flow is refused
    naming the family that trains it."""
    code, [line], text = validate_lines(capsys, tmp_path, modular_folder, "flow")
    assert code == 1, text
    assert "is a MiniMaxH3ModularPipeline (modular_model_index.json), which model.family video trains" in line, line


def test_the_memory_plan_reads_a_modular_folder_as_a_pipeline_folder(modular_folder):
    """The plan's folder facts (dstune.families.denoiser_facts.pipeline_folder, what the cards' count reads) take a
    modular folder's classes from modular_model_index.json, and its transformer is counted from its stored config as
    any pipeline's (here against the real class's own count)."""
    from diffusers import MiniMaxH3Transformer3DModel

    from dstune.families.denoiser_facts import pipeline_folder
    from dstune.families.folders import component_problems
    from dstune.memory.counts import count_component

    folder = pipeline_folder(str(modular_folder))
    assert folder.index["transformer"] == ["diffusers", "MiniMaxH3Transformer3DModel"]
    assert folder.index["_class_name"] == "MiniMaxH3ModularPipeline"
    assert component_problems(modular_folder, folder.index, {"transformer": "MiniMaxH3Transformer3DModel"}) == []
    assert component_problems(modular_folder, folder.index, {"vae": None}) == [
        "no `vae` component (modular_model_index.json entry and vae/ subfolder)"
    ]
    params, _, _ = count_component(str(modular_folder / "transformer" / "config.json"))
    real = MiniMaxH3Transformer3DModel.from_pretrained(modular_folder, subfolder="transformer")
    assert params == sum(parameter.numel() for parameter in real.parameters())
