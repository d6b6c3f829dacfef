"""output.lora_format: every LoRA family x every format it offers, on the tiny built-in models (shared test cache).

Each test builds the family, adds LoRA adapters with random A and B (B is zero after init, which would hide a
swapped or dropped tensor), exports them, and loads the file back through diffusers' own loader
(`pipe.load_lora_weights`, which runs diffusers' kohya/ComfyUI conversion for non-diffusers keys). Every adapter
the loader put into the denoiser must be one we trained, every trained adapter must be there, and each must hold the
same A and B with the same scale (alpha / rank), so the layer's update scale * B @ A is the trained one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dstune.families.lora import LORA_WEIGHT_FILE, apply_train_mode, export_lora
from dstune.pretrained import build_model
from dstune.spec.load import SpecSource, validate_data
from dstune.spec.models import SECTIONS_BY_FAMILY, FlowModelSpec
from dstune.models.sd.spec import SdModelSpec
from dstune.models.sdxl.spec import SdxlModelSpec
from dstune.validate import validate_spec
from dstune.world import world_from_flags
from loaded_models import CACHE_DIR

MODELS = {  # name -> (model section, pipeline class)
    "sd": (lambda: SdModelSpec(family="sd", train="lora", lora={"rank": 2, "alpha": 6}), "StableDiffusionPipeline"),
    "sdxl": (
        lambda: SdxlModelSpec(
            family="sdxl", train="lora", lora={"rank": 3, "alpha": 1.5, "target_modules": ["to_q", "to_v", "conv1"]}
        ),
        "StableDiffusionXLPipeline",
    ),
    "sd3": (
        lambda: FlowModelSpec(family="flow", pretrained="builtin:tiny-flow", train="lora", lora={"rank": 2}),
        "StableDiffusion3Pipeline",
    ),
    "flux": (
        lambda: FlowModelSpec(
            family="flow", pretrained="builtin:tiny-flux", train="lora", lora={"rank": 2, "alpha": 4}
        ),
        "FluxPipeline",
    ),
    "qwen-image": (
        lambda: FlowModelSpec(
            family="flow", pretrained="builtin:tiny-qwen-image", train="lora", lora={"rank": 2, "alpha": 3}
        ),
        "QwenImagePipeline",
    ),
    "z-image": (
        lambda: FlowModelSpec(
            family="flow", pretrained="builtin:tiny-z-image", train="lora", lora={"rank": 3, "alpha": 2}
        ),
        "ZImagePipeline",
    ),
    "flux2": (
        lambda: FlowModelSpec(
            family="flow", pretrained="builtin:tiny-flux2", train="lora", lora={"rank": 2, "alpha": 8}
        ),
        "Flux2KleinPipeline",
    ),
}
CASES = [(name, fmt) for name, (make, _) in MODELS.items() for fmt in SECTIONS_BY_FAMILY[make().family].LORA_FORMATS]


@pytest.fixture(scope="module")
def trained() -> dict:
    """name -> (model spec, built, adapter state dict with random A and B)."""
    out = {}
    for name, (make, _) in MODELS.items():
        spec = make()
        built = build_model(spec, CACHE_DIR, "cpu")
        apply_train_mode(built, spec, seed=1)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for param in built.trainable.parameters():
                if param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=generator))
        state = {k: v.clone() for k, v in built.trainable.state_dict().items() if ".lora_" in k}
        out[name] = (spec, built, state)
    return out


def _adapters(module: torch.nn.Module) -> dict:
    """layer name -> (A, B, scale) of every peft LoRA layer in `module` (whatever its adapter's name)."""
    found = {}
    for name, layer in module.named_modules():
        if hasattr(layer, "lora_A") and len(layer.lora_A):
            (adapter,) = list(layer.lora_A)
            found[name] = (
                layer.lora_A[adapter].weight.detach(),
                layer.lora_B[adapter].weight.detach(),
                float(layer.scaling[adapter]),
            )
    return found


@pytest.mark.parametrize("name,lora_format", CASES)
def test_exported_lora_loads_back_through_diffusers_with_every_adapter_weight(trained, tmp_path, name, lora_format):
    import diffusers

    spec, built, state = trained[name]
    out = export_lora(built, state, tmp_path / "lora", spec, "raw", lora_format)
    info = json.loads((out / "dstune_lora.json").read_text())
    assert (
        info["format"] == lora_format
        and info["key_scheme"] == SECTIONS_BY_FAMILY[spec.family].LORA_FORMATS[lora_format]
    )
    with safe_open(str(out / LORA_WEIGHT_FILE), "pt") as handle:
        keys = list(handle.keys())
    if info["key_scheme"] == "kohya":
        assert all(
            k.startswith("lora_unet_") and k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in keys
        )
    else:
        assert all(k.startswith(("unet.", "transformer.")) for k in keys)

    pipe = getattr(diffusers, MODELS[name][1]).from_pretrained(built.folder)
    pipe.load_lora_weights(out)
    loaded = _adapters(pipe.unet if hasattr(pipe, "unet") else pipe.transformer)
    expected = _adapters(built.trainable)
    assert set(loaded) == set(expected) and len(expected) > 0
    for layer, (a, b, scale) in expected.items():
        got_a, got_b, got_scale = loaded[layer]
        assert got_scale == pytest.approx(scale), layer
        assert torch.equal(got_a, a) and torch.equal(got_b, b), layer


def test_default_format_is_kohya_for_unet_families_and_diffusers_for_flow(trained, tmp_path):
    for name, scheme in (("sd", "kohya"), ("sd3", "diffusers")):
        spec, built, state = trained[name]
        out = export_lora(built, state, tmp_path / name, spec)
        assert json.loads((out / "dstune_lora.json").read_text())["key_scheme"] == scheme


def _validate(model: dict, output: dict):
    data = {
        "model": model,
        "train": {"micro_batch_size": 1, "max_steps": 2},
        "output": output,
        "data": {"path": "builtin:tones" if model["family"] in ("tts_lm", "speecht5") else "builtin:shapes"},
    }
    source = SpecSource("spec.yaml", {"output.lora_format": 9})
    return validate_spec(validate_data(data, source), source, world_from_flags(num_gpus=1))


@pytest.mark.parametrize(
    "model,lora_format,message",
    [
        (
            {"family": "flow", "train": "lora"},
            "kohya",
            "not a LoRA format of model.family flow; choices: diffusers, comfyui",
        ),
        ({"family": "sd"}, "kohya", "applies to model.train: lora, but model.train is 'full'"),
        ({"family": "speecht5"}, "diffusers", "model.family speecht5 has no LoRA training"),
        ({"family": "tts_lm", "train": "lora"}, "kohya", "not a LoRA format of model.family tts_lm; choices: peft"),
    ],
)
def test_validate_refuses_a_format_the_family_does_not_have(model, lora_format, message):
    from dstune.spec.load import SpecError

    with pytest.raises(SpecError) as err:
        _validate(model, {"lora_format": lora_format})
    assert "spec.yaml:9: output.lora_format: " in str(err.value) and message in str(err.value)
    _validate({"family": "sd", "train": "lora"}, {"lora_format": "comfyui"})  # a format sd has


def test_layers_kohya_names_cannot_carry_are_refused_before_training():
    """SDXL's add_embedding.linear_1 becomes lora_unet_add_embedding_linear_1, which diffusers' kohya reader turns
    into add.embedding.linear: the file would load without that adapter. Refused when the adapters are added."""
    from dstune.families.base import FamilyError

    spec = SdxlModelSpec(family="sdxl", train="lora", lora={"rank": 2, "target_modules": ["to_q", "linear_1"]})
    built = build_model(spec, CACHE_DIR, "cpu")
    with pytest.raises(
        FamilyError,
        match=r"output.lora_format kohya: kohya's key scheme cannot name 1 adapted layer"
        r"\(s\) .*add_embedding.linear_1 \(read back as add.embedding.linear\).*"
        r"output.lora_format: diffusers",
    ):
        apply_train_mode(built, spec, seed=0)
    again = build_model(spec, CACHE_DIR, "cpu")
    assert "LoRA rank 2" in apply_train_mode(again, spec, seed=0, lora_format="diffusers")
