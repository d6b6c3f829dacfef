"""SD3-class and Flux.1-class models (their cards and classes, dstune.models.sd3_flux) and their built-in tiny models,
on the real (tiny) components: no mocks. Their loss against diffusers' training examples:
test_sd3_flux_loss_parity.py; the flow core's shared pieces: tests/unit/test_flow_core.py.

The built-in models are built into the shared test cache (the dist tests reuse them): ~25 s the first time, for
the one 16-channel VAE both share.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of
from dstune.families.base import FamilyError
from dstune.models.sd3_flux.card import FLUX_CARD, SD3_CARD
from dstune.models.sd3_flux.model import SD3, Flux
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_settings
from tiny_batches import shape_batch

NAMES = {"sd3": "tiny-flow", "flux": "tiny-flux"}
CARDS = {"sd3": SD3_CARD, "flux": FLUX_CARD}
CLASSES = {"sd3": SD3, "flux": Flux}


@pytest.fixture(scope="module")
def folders() -> dict[str, Path]:
    return {kind: tiny.ensure_builtin_model(name, CACHE_DIR) for kind, name in NAMES.items()}


@pytest.fixture(scope="module")
def built(folders) -> dict:
    return {
        kind: build_model(FlowModelSpec(family="flow", pretrained=f"builtin:{name}"), CACHE_DIR, "cpu")
        for kind, name in NAMES.items()
    }


def _batch(indices: list[int]) -> dict:
    return shape_batch(indices)


def _loss(built, indices, seed=0, step=3):
    return built.loss(built.trainable, built.encode_batch(_batch(indices)), seed, step)


# ---------------------------------------------------------------------------------------- built-in models


def test_builtins_are_pipelines_of_their_class_with_a_trained_16_channel_vae(folders, built):
    for kind, folder in folders.items():
        index = json.loads((folder / "model_index.json").read_text())
        assert index["_class_name"] == {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}[kind]
        assert card_of("flow", folder) is CARDS[kind] and built[kind].card is CARDS[kind]
        assert type(built[kind]) is CLASSES[kind]
        facts = json.loads((folder / tiny.BUILTIN_MARKER).read_text())
        assert facts["family"] == "flow" and facts["vae_reconstruction_mse"] < 0.02  # a random VAE gives ~0.3
        assert json.loads((folder / "vae" / "config.json").read_text())["latent_channels"] == 16
        assert facts["transformer_parameters"] < 300_000


def test_unsupported_and_mismatched_folders_are_refused_clearly(folders, tmp_path):
    other = tmp_path / "pixart"
    shutil.copytree(folders["sd3"], other)
    config_path = other / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "_class_name": "PixArtTransformer2DModel"}))
    with pytest.raises(
        FamilyError,
        match=r"PixArtTransformer2DModel is not supported.*SD3Transformer2DModel.*"
        r"FluxTransformer2DModel",
    ):
        card_of("flow", other)
    config_path.write_text(json.dumps({**config, "joint_attention_dim": 48}))
    with pytest.raises(FamilyError, match=r"joint_attention_dim 48 != 64"):
        build_model(FlowModelSpec(family="flow", pretrained=str(other)), tmp_path, "cpu")
    unet_pipeline = tmp_path / "sd"
    unet_pipeline.mkdir()
    (unet_pipeline / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]})
    )
    with pytest.raises(FamilyError, match="no transformer/ subfolder.*use model.family sd"):
        card_of("flow", unet_pipeline)
    shutil.rmtree(other / "text_encoder_3")
    with pytest.raises(FamilyError, match="no `text_encoder_3` component"):
        build_model(FlowModelSpec(family="flow", pretrained=str(other)), tmp_path, "cpu")


# ------------------------------------------------------------------------------------------------ the loss


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_encoded_shapes_and_loss(built, kind):
    model = built[kind]
    encoded = model.encode_batch(_batch([0, 1]))
    width, pooled = {"sd3": (64, 64), "flux": (32, 32)}[kind]
    sequence = {"sd3": 77 + model.max_sequence_length, "flux": model.max_sequence_length}[kind]
    assert encoded["latent_mean"].shape == (2, 16, 16, 16)
    assert encoded["encoder_hidden_states"].shape == (2, sequence, width)
    assert encoded["pooled_projections"].shape == (2, pooled)
    model.trainable.zero_grad()
    value = model.loss(model.trainable, encoded, 0, 1)
    assert value.shape == () and torch.isfinite(value)
    value.backward()
    assert all(p.grad is not None for p in model.trainable.parameters() if p.requires_grad)
    model.trainable.zero_grad()


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_cached_text_tensors_train_like_encoded_ones(built, kind):
    """What the text cache stores (encode_text, one caption at a time) gives the loss of encoding in the step;
    embeddings cached with another max_sequence_length are refused, not silently used."""
    model, batch = built[kind], _batch([5, 6])
    stored = [model.encode_text([caption]) for caption in batch["caption"]]
    assert set(stored[0]) == set(model.card.text_tensors)
    cached = {**batch, **{name: torch.cat([s[name] for s in stored]) for name in model.card.text_tensors}}
    with torch.no_grad():
        direct = model.loss(model.trainable, model.encode_batch(batch), 0, 2)
        from_cache = model.loss(model.trainable, model.encode_batch(cached), 0, 2)
    assert from_cache.item() == pytest.approx(direct.item(), rel=1e-5)
    stale = {**cached, "encoder_hidden_states": cached["encoder_hidden_states"][:, :-4]}
    with pytest.raises(ValueError, match="cached with another max_sequence_length"):
        model.encode_batch(stale)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_loss_of_a_batch_is_the_mean_of_its_samples_losses(built, kind):
    """Every draw is per sample: how samples are split over ranks and micro batches changes nothing."""
    with torch.no_grad():
        both = _loss(built[kind], [4, 11])
        alone = (_loss(built[kind], [4]) + _loss(built[kind], [11])) / 2
    assert both.item() == pytest.approx(alone.item(), rel=1e-5)


def test_flux_guidance_and_shift_reach_the_model(built, folders):
    with torch.no_grad():
        reference = _loss(built["flux"], [2])
        assert _loss(with_settings(built["flux"], guidance=1.0), [2]).item() != reference.item()
    shifted = build_model(FlowModelSpec(family="flow", pretrained="builtin:tiny-flux", shift=1.0), CACHE_DIR, "cpu")
    assert torch.allclose(shifted.train_sigmas, torch.arange(1000, 0, -1) / 1000)  # shift 1: unshifted
    assert torch.allclose(built["sd3"].train_sigmas[500], torch.tensor(3 * 0.5 / (1 + 2 * 0.5)), atol=1e-3)


# ------------------------------------------------------------------------------------ sampling and export


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_sample_and_export_reload_with_the_pipeline(built, kind, tmp_path):
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    model = built[kind]
    images = model.sample(model.trainable, ["a red circle", "a blue square"], SampleSpec(steps=2), 32)
    assert [image.size for image in images] == [(32, 32), (32, 32)] and model.trainable.training
    state = {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}
    first = next(iter(state))
    state[first] += 1.0  # "trained" weights
    out = model.export(state, tmp_path / "export")
    assert torch.equal(load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")[first], state[first])
    pipe = DiffusionPipeline.from_pretrained(out)
    assert type(pipe).__name__ == {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}[kind]
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        "a red circle",
        num_inference_steps=2,
        height=32,
        width=32,
        output_type="np",
        max_sequence_length=model.max_sequence_length,
    ).images[0]
    assert image.shape == (32, 32, 3)
    with pytest.raises(FamilyError, match="do not fit the transformer"):
        model.export({k: v for k, v in state.items() if k != first}, tmp_path / "bad")


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_lora_export_loads_into_the_pipeline_with_the_trained_effect(kind, tmp_path, monkeypatch):
    """model.train: lora on the transformer: the exported LoRA file, loaded by the pipeline's load_lora_weights,
    reproduces the trained module's loss exactly (and differs from the base model's). Its dstune_lora.json names
    the base folder absolutely, although the run named its cache by a relative path."""
    import os

    from diffusers import DiffusionPipeline

    from dstune.families.lora import apply_train_mode, export_lora

    spec = FlowModelSpec(family="flow", pretrained=f"builtin:{NAMES[kind]}", train="lora")
    monkeypatch.chdir(CACHE_DIR.parent)
    model = build_model(spec, os.path.relpath(CACHE_DIR), "cpu")
    assert "training: LoRA rank 16" in apply_train_mode(model, spec, seed=0)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:  # B starts at zero: "train" it
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    encoded = model.encode_batch(_batch([1]))
    state = {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}
    out = export_lora(model, state, tmp_path / "lora", spec)
    pipe = DiffusionPipeline.from_pretrained(model.folder)
    with torch.no_grad():
        base_loss = model.loss(pipe.transformer, encoded, 0, 1)
        pipe.load_lora_weights(out)
        trained, loaded = (model.loss(module, encoded, 0, 1) for module in (model.trainable, pipe.transformer))
    assert loaded.item() == pytest.approx(trained.item(), rel=1e-6) and loaded.item() != base_loss.item()
    info = json.loads((out / "dstune_lora.json").read_text())
    assert info["base_folder"] == str(Path(model.folder).absolute()) and Path(info["base_folder"]).is_absolute()
