"""SD3's and Flux.1's loss (dstune.models.sd3_flux) equals the loss of diffusers' training examples on the same tiny model, batch and draws.

The reference re-computes the loss lines of examples/dreambooth/train_dreambooth_sd3.py and
train_dreambooth_flux.py (diffusers 0.42) with diffusers' own pieces: the scheduler copy's timestep table indexed by
int(u * num_train_timesteps), the scripts' get_sigmas lookup, FluxPipeline's _pack_latents /
_prepare_latent_image_ids / _unpack_latents, compute_loss_weighting_for_sd3, the SD3 scripts'
--precondition_outputs, and each script's flag defaults. Only the random draws are dstune's (each sample's own
generator, docs/family-flow.md): the reference takes the same posterior draw, noise and u, so the two losses must
agree to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.sd3_flux.card import SD3_CARD
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec
from loaded_models import CACHE_DIR, with_settings
from tiny_batches import shape_batch

NAMES = {"sd3": "tiny-flow", "flux": "tiny-flux"}
SEED, STEP, INDICES = 7, 5, [3, 11, 2]

# (kind, dstune settings, the script's flags): each script's defaults first, then the combinations that matter
CASES = {
    "sd3-script-defaults": (
        "sd3",
        dict(timestep_sampling="logit_normal", precondition_outputs=True),
        dict(weighting_scheme="logit_normal", precondition_outputs=1),
    ),
    "sd3-velocity": (
        "sd3",
        dict(timestep_sampling="logit_normal"),
        dict(weighting_scheme="logit_normal", precondition_outputs=0),
    ),
    "sd3-sigma-sqrt": (
        "sd3",
        dict(timestep_sampling="uniform", loss_weighting="sigma_sqrt", precondition_outputs=True),
        dict(weighting_scheme="sigma_sqrt", precondition_outputs=1),
    ),
    "sd3-cosmap": (
        "sd3",
        dict(timestep_sampling="uniform", loss_weighting="cosmap"),
        dict(weighting_scheme="cosmap", precondition_outputs=0),
    ),
    "flux-script-defaults": (
        "flux",
        dict(timestep_sampling="uniform", guidance=3.5),
        dict(weighting_scheme="none", guidance_scale=3.5),
    ),
    "flux-logit-normal": (
        "flux",
        dict(timestep_sampling="logit_normal", guidance=1.0),
        dict(weighting_scheme="logit_normal", guidance_scale=1.0),
    ),
}


@pytest.fixture(scope="module")
def built() -> dict:
    return {
        kind: build_model(FlowModelSpec(family="flow", pretrained=f"builtin:{name}"), CACHE_DIR, "cpu")
        for kind, name in NAMES.items()
    }


def _batch() -> dict:
    return shape_batch(INDICES)


def _script_sigmas(scheduler, timesteps: torch.Tensor, n_dim: int) -> torch.Tensor:
    """The scripts' get_sigmas: each timestep's position in the schedule, its sigma, shaped to broadcast."""
    positions = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigma = scheduler.sigmas[positions].flatten()
    return sigma.view(-1, *([1] * (n_dim - 1)))


def _script_loss(built, encoded: dict, flags: dict, u: torch.Tensor) -> torch.Tensor:
    """One micro batch's loss as the SD3 / Flux script computes it, from dstune's posterior draw, noise and u."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(built.folder / "scheduler")
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    sample = mean + std * per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "vae_posterior")
    config = built.vae.config
    model_input = (sample - (config.shift_factor or 0.0)) * config.scaling_factor
    noise = per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "noise")
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    sigmas = _script_sigmas(scheduler, timesteps, model_input.ndim)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    embeds, pooled = encoded["encoder_hidden_states"], encoded["pooled_projections"]
    with torch.no_grad():
        if built.card is SD3_CARD:
            model_pred = built.trainable(
                hidden_states=noisy,
                timestep=timesteps,
                encoder_hidden_states=embeds,
                pooled_projections=pooled,
                return_dict=False,
            )[0]
        else:
            batch, channels, height, width = model_input.shape
            factor = 2 ** (len(config.block_out_channels) - 1)
            image_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, "cpu", torch.float32)
            guidance = (
                torch.tensor([flags["guidance_scale"]]).expand(batch)
                if built.trainable.config.guidance_embeds
                else None
            )
            packed = FluxPipeline._pack_latents(noisy, batch, channels, height, width)
            model_pred = built.trainable(
                hidden_states=packed,
                timestep=timesteps / 1000,
                guidance=guidance,
                pooled_projections=pooled,
                encoder_hidden_states=embeds,
                txt_ids=torch.zeros(embeds.shape[1], 3),
                img_ids=image_ids,
                return_dict=False,
            )[0]
            model_pred = FluxPipeline._unpack_latents(model_pred, height * factor, width * factor, factor)
    if flags.get("precondition_outputs"):
        model_pred = model_pred * (-sigmas) + noisy
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=flags["weighting_scheme"], sigmas=sigmas)
    target = model_input if flags.get("precondition_outputs") else noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1)
    return loss.mean()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_script(built, case):
    kind, settings, flags = CASES[case]
    model = with_settings(built[kind], **settings)
    encoded = model.encode_batch(_batch())
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, encoded, SEED, STEP)
    reference = _script_loss(model, encoded, flags, u)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
