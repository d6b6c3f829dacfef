"""The flow-matching core every flow model shares (dstune.families.flow_matching, the flow spec section, the cards'
text-cache keys and the model table): per-sample timestep densities, loss weights, preconditioning, 2x2 latent
packing, and what the spec refuses. Pure functions and torch-free facts: no model is loaded here (the models' own
tests are in tests/unit/models/<unit>/).
"""

from __future__ import annotations

import pytest
import torch

from dstune.builtin import BUILTIN_MODELS
from dstune.families import family_cards
from dstune.families.flow_matching import (
    flow_loss_per_sample,
    image_ids,
    loss_weights,
    pack_latents,
    timestep_density,
    unpack_latents,
)
from dstune.families.randomness import sample_generator
from dstune.spec.load import SpecError, SpecSource, validate_data
from dstune.spec.models import FlowModelSpec

# --------------------------------------------------------------------------------------- timestep sampling


def test_timestep_densities_match_their_distributions():
    indices = list(range(4000))
    uniform = timestep_density(FlowModelSpec(family="flow", timestep_sampling="uniform"), 0, 0, indices)
    assert 0 <= uniform.min() and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.02
    settings = FlowModelSpec(family="flow", logit_mean=0.5, logit_std=0.7)
    logits = torch.logit(timestep_density(settings, 0, 0, indices).double())
    assert abs(logits.mean() - 0.5) < 0.05 and abs(logits.std() - 0.7) < 0.05
    mode = timestep_density(FlowModelSpec(family="flow", timestep_sampling="mode", mode_scale=0.8), 0, 0, [5])
    raw = torch.rand(1, generator=sample_generator(0, 0, 5, "timestep"))
    expected = 1 - raw - 0.8 * (torch.cos(torch.pi * raw / 2) ** 2 - 1 + raw)  # diffusers' mode formula
    assert torch.allclose(mode, expected)


def test_a_samples_timestep_depends_only_on_seed_step_and_index():
    settings = FlowModelSpec(family="flow")
    together = timestep_density(settings, 1, 2, [3, 9])
    assert together[1] == timestep_density(settings, 1, 2, [9])[0]
    assert together[0] != timestep_density(settings, 1, 3, [3])[0]


def test_loss_weights_are_the_reference_formulas():
    sigmas = torch.tensor([0.1, 0.5, 0.9])
    assert torch.equal(loss_weights("none", sigmas), torch.ones(3))
    assert torch.allclose(loss_weights("sigma_sqrt", sigmas), sigmas**-2)
    assert torch.allclose(loss_weights("cosmap", sigmas), 2 / (torch.pi * (1 - 2 * sigmas + 2 * sigmas**2)))


def test_preconditioning_weights_the_velocity_error_by_sigma_squared():
    """precondition_outputs is not a rescaling of the whole loss: per sample it is sigma^2 x the velocity loss."""
    torch.manual_seed(0)
    latents, noise, prediction = (torch.randn(3, 4, 2, 2) for _ in range(3))
    sigmas = torch.tensor([0.05, 0.5, 0.95]).view(-1, 1, 1, 1)
    noisy = (1 - sigmas) * latents + sigmas * noise
    ones = torch.ones_like(sigmas)
    velocity = flow_loss_per_sample(prediction, noisy, latents, noise, sigmas, ones, False)
    x0 = flow_loss_per_sample(prediction, noisy, latents, noise, sigmas, ones, True)
    assert torch.allclose(x0, sigmas.flatten() ** 2 * velocity, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ the spec


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


def test_sigma_sqrt_without_preconditioning_is_refused_with_the_numbers():
    with pytest.raises(ValueError) as refused:
        FlowModelSpec(family="flow", timestep_sampling="uniform", loss_weighting="sigma_sqrt")
    assert "about 186" in str(refused.value) and "precondition_outputs: true" in str(refused.value)
    FlowModelSpec(family="flow", timestep_sampling="uniform", loss_weighting="sigma_sqrt", precondition_outputs=True)


def test_the_reference_names_every_flow_model_its_folders_defaults_and_builtins():
    """`dstune init --family flow` and docs/spec-reference.md send users to the model table: a flow model or a
    built-in missing from it is invisible to users, and the max_sequence_length default it states is the one the
    model loads with (its card's default_text_tokens)."""
    from dstune.reference import model_table, reference_markdown

    rows = model_table()
    cards = family_cards("flow")
    for card in cards:
        (row,) = [line for line in rows if line.startswith(f"| `flow` | {card.name} (")]
        assert card.transformer_class in row, card.key
        assert card.pipeline_class in row, card.key
        assert card.spec_notes["model.max_sequence_length"].startswith(f"{card.default_text_tokens} ("), card.key
        for name in card.builtins:
            assert f"`builtin:{name}`" in row, name
    flow_builtins = [name for name, model in BUILTIN_MODELS.items() if model.family == "flow"]
    assert len(flow_builtins) >= len(cards)
    assert "\n".join(rows) in reference_markdown()  # docs/spec-reference.md holds the table


# ------------------------------------------------------------------------------------------ the text cache


def test_max_sequence_length_is_part_of_every_text_cache_key():
    """A cache built at one max_sequence_length misses at another (the same encoders, other tensors), for every
    flow model."""
    from dstune.cache.entries import text_key

    for card in family_cards("flow"):
        keys = {
            length: text_key(
                "a red circle",
                card.text_cache_settings(FlowModelSpec(family="flow", max_sequence_length=length)),
                "float32",
                card.text_tensors,
            )
            for length in (32, 64)
        }
        assert keys[32] != keys[64], card.key


# ------------------------------------------------------------------------------------------ 2x2 packing


def test_flux_packing_round_trips_and_matches_diffusers():
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 6, 10)  # not square: bucketed images
    packed = pack_latents(latents)
    assert packed.shape == (2, 3 * 5, 64)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 6, 10))
    assert torch.equal(unpack_latents(packed, 6, 10), latents)
    assert torch.equal(unpack_latents(packed, 6, 10), FluxPipeline._unpack_latents(packed, 6, 10, 1))
    ids = image_ids(6, 10)
    assert ids.shape == (15, 3)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32))
