"""The `flow` family (SD3- and Flux-class) and its built-in tiny models, on the real (tiny) components: no mocks.

The built-in models are built into the shared test cache (the dist tests reuse them): ~25 s the first time, for
the one 16-channel VAE both share.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dstune.pretrained import build_model
from dstune import builtin as tiny
from dstune.families import flow
from dstune.families.base import FamilyError
from dstune.families.randomness import sample_generator
from dstune.spec.load import SpecError, SpecSource, validate_data
from dstune.spec.models import FlowModelSpec, SampleSpec
from tiny_batches import shape_batch

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
NAMES = {"sd3": "tiny-flow", "flux": "tiny-flux"}


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
    return flow.loss(built, built.trainable, flow.encode_batch(built, _batch(indices)), seed, step)


# ---------------------------------------------------------------------------------------- built-in models


def test_builtins_are_pipelines_of_their_class_with_a_trained_16_channel_vae(folders):
    for kind, folder in folders.items():
        index = json.loads((folder / "model_index.json").read_text())
        assert index["_class_name"] == {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}[kind]
        assert flow.detect_kind(folder) == kind
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
        flow.detect_kind(other)
    config_path.write_text(json.dumps({**config, "joint_attention_dim": 48}))
    with pytest.raises(FamilyError, match=r"joint_attention_dim 48 != 64"):
        build_model(FlowModelSpec(family="flow", pretrained=str(other)), tmp_path, "cpu")
    unet_pipeline = tmp_path / "sd"
    unet_pipeline.mkdir()
    (unet_pipeline / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]})
    )
    with pytest.raises(FamilyError, match="no transformer/ subfolder.*use model.family sd"):
        flow.detect_kind(unet_pipeline)
    shutil.rmtree(other / "text_encoder_3")
    with pytest.raises(FamilyError, match="no `text_encoder_3` component"):
        flow.detect_kind(other)


# --------------------------------------------------------------------------------------- timestep sampling


def test_timestep_densities_match_their_distributions():
    indices = list(range(4000))
    uniform = flow.timestep_density(FlowModelSpec(family="flow", timestep_sampling="uniform"), 0, 0, indices)
    assert 0 <= uniform.min() and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.02
    settings = FlowModelSpec(family="flow", logit_mean=0.5, logit_std=0.7)
    logits = torch.logit(flow.timestep_density(settings, 0, 0, indices).double())
    assert abs(logits.mean() - 0.5) < 0.05 and abs(logits.std() - 0.7) < 0.05
    mode = flow.timestep_density(FlowModelSpec(family="flow", timestep_sampling="mode", mode_scale=0.8), 0, 0, [5])
    raw = torch.rand(1, generator=sample_generator(0, 0, 5, "timestep"))
    expected = 1 - raw - 0.8 * (torch.cos(torch.pi * raw / 2) ** 2 - 1 + raw)  # diffusers' mode formula
    assert torch.allclose(mode, expected)


def test_a_samples_timestep_depends_only_on_seed_step_and_index():
    settings = FlowModelSpec(family="flow")
    together = flow.timestep_density(settings, 1, 2, [3, 9])
    assert together[1] == flow.timestep_density(settings, 1, 2, [9])[0]
    assert together[0] != flow.timestep_density(settings, 1, 3, [3])[0]


def test_loss_weights_are_the_reference_formulas():
    sigmas = torch.tensor([0.1, 0.5, 0.9])
    assert torch.equal(flow.loss_weights("none", sigmas), torch.ones(3))
    assert torch.allclose(flow.loss_weights("sigma_sqrt", sigmas), sigmas**-2)
    assert torch.allclose(flow.loss_weights("cosmap", sigmas), 2 / (torch.pi * (1 - 2 * sigmas + 2 * sigmas**2)))


def test_spec_refuses_settings_of_another_sampling():
    with pytest.raises(ValueError, match="mode_scale only apply to another timestep_sampling"):
        FlowModelSpec(family="flow", mode_scale=1.0)
    with pytest.raises(ValueError, match="logit_mean, logit_std only apply"):
        FlowModelSpec(family="flow", timestep_sampling="uniform", logit_mean=0.0, logit_std=2.0)
    spec = {
        "model": {"family": "flow"},
        "train": {"micro_batch_size": 2, "max_steps": 2},
        "deepspeed": {"zero_stage": 3, "activation_checkpointing": {"partition_activations": True}},
    }
    with pytest.raises(SpecError, match="not supported for model.family flow.*gradient_checkpointing: true"):
        validate_data(spec, SpecSource("spec.yaml"))


def test_spec_descriptions_name_every_flow_model_and_builtin():
    """`dstune init --family flow` and docs/spec-reference.md are generated from these descriptions: a recipe or a
    built-in added without naming it there is invisible to users."""
    fields = FlowModelSpec.model_fields
    family, pretrained = fields["family"].description, fields["pretrained"].description
    lengths = fields["max_sequence_length"].description
    for recipe in flow.RECIPES.values():
        assert recipe.transformer_class in family, recipe.kind
        assert recipe.pipeline_class in pretrained, recipe.kind
        assert f"{recipe.default_max_sequence_length} (" in lengths, recipe.kind
    flow_builtins = [name for name, model in tiny.BUILTIN_MODELS.items() if model.family == "flow"]
    assert len(flow_builtins) >= len(flow.RECIPES)
    for name in flow_builtins:
        assert f"`builtin:{name}`" in pretrained, name
    from dstune.reference import example_spec

    assert "builtin:tiny-flux2" in example_spec("flow")


# ------------------------------------------------------------------------------------------ Flux packing


def test_flux_packing_round_trips_and_matches_diffusers():
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 6, 10)  # not square: bucketed images
    packed = flow.pack_latents(latents)
    assert packed.shape == (2, 3 * 5, 64)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 6, 10))
    assert torch.equal(flow.unpack_latents(packed, 6, 10), latents)
    assert torch.equal(flow.unpack_latents(packed, 6, 10), FluxPipeline._unpack_latents(packed, 6, 10, 1))
    ids = flow.image_ids(6, 10)
    assert ids.shape == (15, 3)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32))


# ------------------------------------------------------------------------------------------------ the loss


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_encoded_shapes_and_loss(built, kind):
    model = built[kind]
    encoded = flow.encode_batch(model, _batch([0, 1]))
    width, pooled = {"sd3": (64, 64), "flux": (32, 32)}[kind]
    sequence = {"sd3": 77 + model.max_sequence_length, "flux": model.max_sequence_length}[kind]
    assert encoded["latent_mean"].shape == (2, 16, 16, 16)
    assert encoded["encoder_hidden_states"].shape == (2, sequence, width)
    assert encoded["pooled_projections"].shape == (2, pooled)
    model.trainable.zero_grad()
    value = flow.loss(model, model.trainable, encoded, 0, 1)
    assert value.shape == () and torch.isfinite(value)
    value.backward()
    assert all(p.grad is not None for p in model.trainable.parameters() if p.requires_grad)
    model.trainable.zero_grad()


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_cached_text_tensors_train_like_encoded_ones(built, kind):
    """What the text cache stores (cache_text_tensors, one caption at a time) gives the loss of encoding in the step;
    embeddings cached with another max_sequence_length are refused, not silently used."""
    model, batch = built[kind], _batch([5, 6])
    stored = [flow.cache_text_tensors(model, [caption]) for caption in batch["caption"]]
    assert set(stored[0]) == set(flow.TEXT_CACHE_TENSORS)
    cached = {**batch, **{name: torch.cat([s[name] for s in stored]) for name in flow.TEXT_CACHE_TENSORS}}
    with torch.no_grad():
        direct = flow.loss(model, model.trainable, flow.encode_batch(model, batch), 0, 2)
        from_cache = flow.loss(model, model.trainable, flow.encode_batch(model, cached), 0, 2)
    assert from_cache.item() == pytest.approx(direct.item(), rel=1e-5)
    stale = {**cached, "encoder_hidden_states": cached["encoder_hidden_states"][:, :-4]}
    with pytest.raises(ValueError, match="cached with another max_sequence_length"):
        flow.encode_batch(model, stale)


def test_max_sequence_length_is_part_of_every_text_cache_key():
    """A cache built at one max_sequence_length misses at another (the same encoders, other tensors)."""
    from dstune.cache.entries import text_key

    hooks = flow.FAMILY.text_cache
    keys = {
        length: text_key(
            "a red circle",
            hooks.settings(FlowModelSpec(family="flow", max_sequence_length=length)),
            "float32",
            hooks.tensors,
        )
        for length in (32, 64)
    }
    assert keys[32] != keys[64]


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
        built["flux"].settings = FlowModelSpec(family="flow", guidance=1.0)
        try:
            assert _loss(built["flux"], [2]).item() != reference.item()
        finally:
            built["flux"].settings = FlowModelSpec(family="flow")
    shifted = build_model(FlowModelSpec(family="flow", pretrained="builtin:tiny-flux", shift=1.0), CACHE_DIR, "cpu")
    assert torch.allclose(shifted.train_sigmas, torch.arange(1000, 0, -1) / 1000)  # shift 1: unshifted
    assert torch.allclose(built["sd3"].train_sigmas[500], torch.tensor(3 * 0.5 / (1 + 2 * 0.5)), atol=1e-3)


# ------------------------------------------------------------------------------------ sampling and export


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_sample_and_export_reload_with_the_pipeline(built, kind, tmp_path):
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    model = built[kind]
    images = flow.sample(model, model.trainable, ["a red circle", "a blue square"], SampleSpec(steps=2), 32)
    assert [image.size for image in images] == [(32, 32), (32, 32)] and model.trainable.training
    state = {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}
    first = next(iter(state))
    state[first] += 1.0  # "trained" weights
    out = flow.export(model, state, tmp_path / "export")
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
        flow.export(model, {k: v for k, v in state.items() if k != first}, tmp_path / "bad")


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_lora_export_loads_into_the_pipeline_with_the_trained_effect(kind, tmp_path):
    """model.train: lora on the transformer: the exported LoRA file, loaded by the pipeline's load_lora_weights,
    reproduces the trained module's loss exactly (and differs from the base model's)."""
    from diffusers import DiffusionPipeline

    from dstune.families.lora import apply_train_mode, export_lora

    spec = FlowModelSpec(family="flow", pretrained=f"builtin:{NAMES[kind]}", train="lora")
    model = build_model(spec, CACHE_DIR, "cpu")
    assert "training: LoRA rank 16" in apply_train_mode(model.trainable, spec, seed=0, family=flow.FAMILY)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:  # B starts at zero: "train" it
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    encoded = flow.encode_batch(model, _batch([1]))
    state = {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}
    out = export_lora(flow.FAMILY, model, state, tmp_path / "lora", spec)
    pipe = DiffusionPipeline.from_pretrained(model.folder)
    with torch.no_grad():
        base_loss = flow.loss(model, pipe.transformer, encoded, 0, 1)
        pipe.load_lora_weights(out)
        trained, loaded = (flow.loss(model, module, encoded, 0, 1) for module in (model.trainable, pipe.transformer))
    assert loaded.item() == pytest.approx(trained.item(), rel=1e-6) and loaded.item() != base_loss.item()
