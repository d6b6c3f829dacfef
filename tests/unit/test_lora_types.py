"""model.lora.type dora, lokr and loha on the tiny built-ins, like tests/unit/test_lora_formats.py does for
LoRA: each type is added through peft, given random values in every adapter tensor (peft zeroes one factor, which
would hide a dropped tensor), exported in each format of its family, and loaded back by the loader its users have:
diffusers' `load_lora_weights` (DoRA in diffusers' keys), peft's
`PeftModel.from_pretrained` (LoKr and LoHa's adapter folder); DoRA in kohya's or ComfyUI's keys is refused before
training (their dora_scale normalises otherwise than peft's DoRA). Every adapted layer of the loaded model must give the
trained layer's output. LoKr and LoHa in kohya's keys have no loader here (ComfyUI reads them): their file is
applied by the LyCORIS arithmetic ComfyUI documents (kron(w1, w2) and (w1_a w1_b) * (w2_a w2_b), scaled by alpha
over the inner size of a split factor, 1 otherwise)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dstune.families.lora import LORA_WEIGHT_FILE, PEFT_ADAPTER_FILE, adapted_layer, apply_train_mode, export_lora
from dstune.models.sd.spec import SdModelSpec
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
TYPES = ("dora", "lokr", "loha")
MODELS = {  # name -> (model section for a type, pipeline class, its denoiser's attribute)
    "sd": (
        lambda kind: SdModelSpec(family="sd", train="lora", lora={"type": kind, "rank": 2, "alpha": 6}),
        "StableDiffusionPipeline",
        "unet",
    ),
    "flux": (
        lambda kind: FlowModelSpec(
            family="flow", pretrained="builtin:tiny-flux", train="lora", lora={"type": kind, "rank": 2, "alpha": 4}
        ),
        "FluxPipeline",
        "transformer",
    ),
}
CASES = [  # flow models' files have diffusers keys only; DoRA has no kohya file (refused, below)
    (model, kind, fmt)
    for model in MODELS
    for kind in TYPES
    for fmt in ("diffusers", "kohya")
    if not (model == "flux" and fmt == "kohya") and not (kind == "dora" and fmt == "kohya")
]


def _trained(model: str, kind: str, lora_format: str = "diffusers"):
    spec = MODELS[model][0](kind)
    built = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(built, spec, seed=1, lora_format=lora_format)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in built.trainable.named_parameters():
            if param.requires_grad:  # DoRA's magnitude stays near the weight norms it starts from
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(param * (1 + 0.1 * noise) if "magnitude" in name else 0.2 * noise)
    state = {k: v.clone() for k, v in built.trainable.state_dict().items()}
    return spec, built, state


def _adapted_layers(module: torch.nn.Module) -> dict:
    """layer path -> the layer, for every peft tuner layer in `module` (LoRA, DoRA, LoKr, LoHa)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {
        name.removeprefix("base_model.model."): layer
        for name, layer in module.named_modules()
        if isinstance(layer, BaseTunerLayer)
    }


def _outputs(layers: dict, inputs: dict) -> dict:
    with torch.no_grad():
        return {name: layer(inputs[name]) for name, layer in layers.items()}


def _inputs(layers: dict) -> dict:
    generator = torch.Generator().manual_seed(3)
    return {
        name: torch.randn(3, layer.get_base_layer().in_features, generator=generator) for name, layer in layers.items()
    }


def _lycoris_weight(tensors: dict, key: str, base: torch.Tensor) -> torch.Tensor:
    """The merged weight ComfyUI computes from one layer's LoKr / LoHa tensors."""
    alpha = float(tensors[f"{key}.alpha"])
    if f"{key}.hada_w1_a" in tensors:
        w1 = tensors[f"{key}.hada_w1_a"] @ tensors[f"{key}.hada_w1_b"]
        w2 = tensors[f"{key}.hada_w2_a"] @ tensors[f"{key}.hada_w2_b"]
        return base + w1 * w2 * (alpha / tensors[f"{key}.hada_w1_b"].shape[0])
    dim = None
    w1 = tensors.get(f"{key}.lokr_w1")
    if w1 is None:
        w1, dim = tensors[f"{key}.lokr_w1_a"] @ tensors[f"{key}.lokr_w1_b"], tensors[f"{key}.lokr_w1_b"].shape[0]
    w2 = tensors.get(f"{key}.lokr_w2")
    if w2 is None:
        w2, dim = tensors[f"{key}.lokr_w2_a"] @ tensors[f"{key}.lokr_w2_b"], tensors[f"{key}.lokr_w2_b"].shape[0]
    return base + torch.kron(w1, w2).reshape(base.shape) * (alpha / dim if dim else 1.0)


@pytest.mark.parametrize("model,kind,lora_format", CASES)
def test_each_adapter_type_loads_back_and_gives_the_trained_layers_output(tmp_path, model, kind, lora_format):
    import diffusers

    spec, built, state = _trained(model, kind, lora_format)
    trained = _adapted_layers(built.trainable)
    inputs = _inputs(trained)
    expected = _outputs(trained, inputs)
    assert trained
    out = export_lora(built, state, tmp_path / "lora", spec, "raw", lora_format)
    info = json.loads((out / "dstune_lora.json").read_text())
    assert info["adapter"] == kind
    pipeline = getattr(diffusers, MODELS[model][1]).from_pretrained(built.folder)
    denoiser = getattr(pipeline, MODELS[model][2])
    if kind in ("lokr", "loha") and lora_format == "kohya":
        tensors = load_file(out / LORA_WEIGHT_FILE)
        assert all(k.startswith("lora_unet_") for k in tensors)
        base = dict(denoiser.named_modules())
        got = {}
        for name in trained:
            key = "lora_unet_" + name.replace(".", "_")
            weight = _lycoris_weight(tensors, key, base[name].weight.detach())
            got[name] = torch.nn.functional.linear(inputs[name], weight, base[name].bias)
    elif kind in ("lokr", "loha"):
        from peft import PeftModel

        assert info["key_scheme"] == "peft" and (out / PEFT_ADAPTER_FILE).is_file()
        loaded = PeftModel.from_pretrained(denoiser, str(out / "adapter"))
        got = _outputs(_adapted_layers(loaded), inputs)
    else:
        pipeline.load_lora_weights(out)
        got = _outputs(_adapted_layers(denoiser), inputs)
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lokr_and_loha_refuse_loras_dropout(kind):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="rank and module dropout"):
        SdModelSpec(family="sd", train="lora", lora={"type": kind, "dropout": 0.1})


def test_every_type_draws_the_same_adapters_from_the_same_seed():
    for kind in TYPES:
        first, second = (_first_adapters(kind) for _ in range(2))
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), kind
        assert {adapted_layer(k) for k in first}


def _first_adapters(kind: str) -> dict:
    torch.manual_seed(len(kind) * 1000 + torch.randint(0, 1000, ()).item())  # another global RNG state each time
    spec = MODELS["sd"][0](kind)
    built = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(built, spec, seed=5, lora_format="diffusers")
    return {k: p.detach().clone() for k, p in built.trainable.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("model,lora_format", [("sd", "kohya"), ("sd", "comfyui"), ("flux", "comfyui")])
def test_dora_in_kohyas_or_comfyuis_keys_is_refused_before_training(model, lora_format):
    from dstune.families.base import FamilyError

    spec = MODELS[model][0]("dora")
    built = build_model(spec, CACHE_DIR, "cpu")
    with pytest.raises(FamilyError, match="output.lora_format: diffusers"):
        apply_train_mode(built, spec, seed=1, lora_format=lora_format)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lokr_and_loha_for_comfyui_on_a_flow_model_are_refused_with_the_format_that_works(kind):
    from dstune.families.base import FamilyError

    spec = MODELS["flux"][0](kind)
    built = build_model(spec, CACHE_DIR, "cpu")
    with pytest.raises(FamilyError, match="kohya's \\(LyCORIS\\) keys"):
        apply_train_mode(built, spec, seed=1, lora_format="comfyui")
