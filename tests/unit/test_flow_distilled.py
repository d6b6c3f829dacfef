"""Distilled checkpoints (dstune.families.flow_distilled) on builtin:tiny-krea2 (Raw) and tiny-krea2-turbo, in one
process: `sample.pretrained` renders the trained LoRA on the Turbo folder's transformer (compared with a render
made here by diffusers alone: Krea2Pipeline.from_pretrained(turbo) + load_lora_weights of the exported file), and
`model.training_adapter` is fused into the frozen base, left out of the exported LoRA file and of the samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dstune import builtin as tiny
from dstune.families.base import FamilyError
from dstune.families.flow_distilled import attach_sampling_denoiser
from dstune.families.lora import adapter_state_dict, apply_train_mode, export_lora
from dstune.families.randomness import sample_generator
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR

PROMPTS = ["a red circle", "a blue square"]
SAMPLES = SampleSpec(prompts=PROMPTS, steps=2, guidance=0.0, seed=3)


def _lora_model(**extra) -> FlowModelSpec:
    return FlowModelSpec(
        family="flow",
        pretrained="builtin:tiny-krea2",
        train="lora",
        lora={"rank": 4, "target_modules": ["to_q", "to_v"]},
        **extra,
    )


def _trained(model: FlowModelSpec):
    """The model built and made trainable as startup does, its adapters moved off their zero start (as training
    would), so that the LoRA changes what renders."""
    built = build_model(model, CACHE_DIR, "cpu")
    apply_train_mode(built, model, 0)
    with torch.no_grad():
        for number, (name, param) in enumerate(built.trainable.named_parameters()):
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(number)) * 1.0)
    return built


def _lora_state(built) -> dict:
    return {name: p.detach().clone() for name, p in built.trainable.named_parameters() if ".lora_" in name}


def _render(pipeline) -> list:
    generators = [sample_generator(SAMPLES.seed, 0, number, "sample") for number in range(len(PROMPTS))]
    return pipeline(
        prompt=PROMPTS,
        height=32,
        width=32,
        num_inference_steps=SAMPLES.steps,
        guidance_scale=SAMPLES.guidance,
        generator=generators,
        output_type="np",
    ).images


def _as_arrays(images) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.stack([np.asarray(image, dtype=np.float32) / 255 for image in images]))


def test_samples_come_from_the_turbo_folder_with_the_trained_lora(tmp_path):
    from diffusers import Krea2Pipeline

    model = _lora_model()
    built = _trained(model)
    turbo = tiny.ensure_builtin_model("tiny-krea2-turbo", CACHE_DIR)
    own_samples = built.sample(built.trainable, PROMPTS, SAMPLES, 32)
    attach_sampling_denoiser(built, turbo, model)
    samples = _as_arrays(built.sample(built.trainable, PROMPTS, SAMPLES, 32))
    lora = export_lora(built, adapter_state_dict(_lora_state(built)), tmp_path / "lora", model)
    reference = Krea2Pipeline.from_pretrained(turbo)
    turbo_alone = torch.from_numpy(_render(reference)).float()
    reference.load_lora_weights(lora)
    expected = torch.from_numpy(_render(reference)).float()
    assert samples.shape == expected.shape == (2, 32, 32, 3)
    assert (samples - expected).abs().max() <= 1.5 / 255  # the PNG's 8-bit rounding
    assert (samples - _as_arrays(own_samples)).abs().max() > 0.05  # not the Raw transformer's render
    assert (samples - turbo_alone).abs().max() > 4 / 255  # and the LoRA is on it


def test_a_folder_of_another_model_or_other_shapes_is_refused(tmp_path):
    model = _lora_model()
    built = build_model(model, CACHE_DIR, "cpu")
    with pytest.raises(FamilyError, match="QwenImagePipeline folder") as refused:
        attach_sampling_denoiser(built, tiny.ensure_builtin_model("tiny-qwen-image", CACHE_DIR), model)
    assert "QwenImageTransformer2DModel" in str(refused.value) and "sample.pretrained" in str(refused.value)
    other = tmp_path / "krea2-wider"
    shutil.copytree(tiny.ensure_builtin_model("tiny-krea2-turbo", CACHE_DIR), other)
    config = json.loads((other / "transformer" / "config.json").read_text())
    config["intermediate_size"] = 96
    (other / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(FamilyError, match=r"other shapes: intermediate_size 96 \(trained: 64\)"):
        attach_sampling_denoiser(built, other, model)


def test_training_adapter_is_fused_for_training_and_left_out_of_the_lora_file_and_the_samples(tmp_path):
    from diffusers import Krea2Pipeline

    adapter_spec = FlowModelSpec(
        family="flow", pretrained="builtin:tiny-krea2", train="lora", lora={"rank": 2, "target_modules": ["ff.up"]}
    )
    adapter_run = _trained(adapter_spec)
    adapter = export_lora(adapter_run, adapter_state_dict(_lora_state(adapter_run)), tmp_path / "adapter", adapter_spec)
    raw = tiny.ensure_builtin_model("tiny-krea2", CACHE_DIR)
    base = Krea2Pipeline.from_pretrained(raw).transformer
    model = _lora_model(training_adapter=str(adapter / "pytorch_lora_weights.safetensors"))
    built = _trained(model)
    weights = dict(built.trainable.named_parameters())
    up = "transformer_blocks.0.ff.up.weight"
    assert not torch.equal(weights[up], base.state_dict()[up])  # fused: the frozen base carries the adapter
    assert torch.equal(
        weights["transformer_blocks.0.attn.to_k.weight"], base.state_dict()["transformer_blocks.0.attn.to_k.weight"]
    )
    written = load_file(
        export_lora(built, adapter_state_dict(_lora_state(built)), tmp_path / "run", model)
        / "pytorch_lora_weights.safetensors"
    )
    assert written and not any("ff.up" in key for key in written)
    assert {key.split(".")[-3] for key in written} == {"to_q", "to_v"}
    attach_sampling_denoiser(built, raw, model, "model.pretrained")  # what startup does for a training adapter
    assert torch.equal(built.sampling_denoiser.module.state_dict()[up].float(), base.state_dict()[up].float())


def test_a_training_adapter_that_does_not_fit_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file(
        {
            "transformer.nothing_here.lora_A.weight": torch.ones(2, 4),
            "transformer.nothing_here.lora_B.weight": torch.ones(4, 2),
        },
        str(path),
    )
    with pytest.raises(FamilyError, match="model.training_adapter"):
        build_model(_lora_model(training_adapter=str(path)), CACHE_DIR, "cpu")


# ------------------------------------------------------------------------------------------- dstune validate


def _validate(capsys, tmp_path: Path, model: dict, **sections) -> tuple[int, str]:
    import yaml

    from dstune.cli import main

    spec = {
        "model": {"family": "flow", "train": "lora", **model},
        "data": {"path": "builtin:shapes"},
        "train": {"micro_batch_size": 1, "max_steps": 2},
        **sections,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    code = main(["validate", str(path), "--num-gpus", "1"])
    out, err = capsys.readouterr()
    return code, " ".join((out + err).split())  # the table folds long values (tmp paths) at the console's width


def test_validate_says_what_trains_on_which_weights_and_what_the_samples_use(capsys, tmp_path):
    adapter = tmp_path / "adapter.safetensors"
    adapter.write_bytes(b"")  # validate names it; only startup reads it
    code, text = _validate(
        capsys,
        tmp_path,
        {"pretrained": "builtin:tiny-krea2-turbo", "training_adapter": str(adapter)},
        sample={"prompts": ["a red circle"]},
    )
    assert code == 0, text
    assert "fused into the frozen transformer" in text and "training adapter is left out" in text
    assert "builtin:tiny-krea2-turbo's transformer with the trained LoRA, without the training adapter" in text
    code, text = _validate(
        capsys,
        tmp_path,
        {"pretrained": "builtin:tiny-krea2"},  # train on Raw, sample on Turbo
        sample={"prompts": ["a red circle"], "pretrained": "builtin:tiny-krea2-turbo"},
    )
    assert code == 0, text
    assert "builtin:tiny-krea2-turbo's transformer with the trained LoRA (sample.pretrained)" in text
    assert "guidance 0 (Krea2Pipeline's value for a distilled (is_distilled) folder" in text


@pytest.mark.parametrize(
    "model, sections, expected",
    [
        (
            {"pretrained": "builtin:tiny-krea2"},
            {"sample": {"prompts": ["x"], "pretrained": "builtin:tiny-qwen-image"}},
            "sample.pretrained: builtin:tiny-qwen-image cannot render the LoRA trained on builtin:tiny-krea2: it is a "
            "QwenImagePipeline folder",
        ),
        (
            {"pretrained": "builtin:tiny-krea2", "train": "full"},
            {"sample": {"pretrained": "builtin:tiny-krea2-turbo"}},
            "sample.pretrained renders the trained LoRA on another folder's transformer: it needs model.family flow with "
            "model.train: lora",
        ),
        (
            {"pretrained": "builtin:tiny-krea2-turbo", "training_adapter": "adapter.safetensors"},
            {"deepspeed": {"zero_stage": 3}},
            "model.training_adapter is fused into the whole frozen transformer",
        ),
        (
            {"pretrained": "builtin:tiny-krea2"},
            {"sample": {"prompts": ["x"], "pretrained": "builtin:tiny-krea3"}},
            "sample.pretrained: builtin:tiny-krea3 is not a built-in model (did you mean builtin:tiny-krea2",
        ),
        (
            {"pretrained": "builtin:tiny-krea2"},
            {"output": {"lora_format": "comfyui"}},
            "output.lora_format: 'comfyui' writes diffusers' key names, which comfyui's Krea 2 loader is not known to map",
        ),
    ],
    ids=["another-model", "full-training", "adapter-under-zero3", "unknown-builtin", "krea2-comfyui-format"],
)
def test_validate_refuses_mismatched_distilled_settings(capsys, tmp_path, model, sections, expected):
    code, text = _validate(capsys, tmp_path, model, **sections)
    assert code == 1 and expected in text, text
