"""FLUX.1 Kontext (its card FLUX_KONTEXT_CARD and class FluxKontext, dstune.models.sd3_flux) on
builtin:tiny-flux-kontext's real components.

The reference is the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_flux_kontext.py (diffusers
0.42) with diffusers' own pieces: the target's and the source's latents from the VAE posterior's mode
(--vae_encode_mode mode, its default) shifted and scaled by the VAE config, the scheduler copy's timestep table
indexed by int(u * num_train_timesteps) and its get_sigmas lookup, FluxKontextPipeline's _pack_latents /
_prepare_latent_image_ids (the source's ids with the first axis set to 1) / _unpack_latents, the packed source
concatenated after the packed noisy target and the output cut back to the target's tokens, guidance
--guidance_scale, compute_loss_weighting_for_sd3. Only the random draws are dstune's (noise and u, per sample): the
reference takes the same ones.
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.builtin.common import to_tensor
from dstune.data.synthetic import render_shape
from dstune.families import card_of
from dstune.families.base import FamilyError
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.sd3_flux.card import FLUX_KONTEXT_CARD
from dstune.models.sd3_flux.model import FluxKontext
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_settings

MODEL = "builtin:tiny-flux-kontext"
SEED, STEP, INDICES = 3, 4, [5, 0, 9]
SIDE = 64  # 8 px per latent: 8x8 latents, 16 target tokens and 16 source tokens
CASES = {
    "script-defaults": (dict(timestep_sampling="uniform", guidance=3.5), dict(weighting_scheme="none", guidance=3.5)),
    "logit-normal": (
        dict(timestep_sampling="logit_normal", guidance=1.0),
        dict(weighting_scheme="logit_normal", guidance=1.0),
    ),
    "cosmap": (
        dict(timestep_sampling="uniform", loss_weighting="cosmap", guidance=3.5),
        dict(weighting_scheme="cosmap", guidance=3.5),
    ),
}


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained=MODEL), CACHE_DIR, "cpu")


def _batch(indices=INDICES) -> dict:
    """Targets are shapes; each source is another shape (the edit turns source i into target i)."""
    targets = [render_shape(i, SIDE) for i in indices]
    return {
        "pixel_values": to_tensor([image for image, _ in targets]),
        "control_values": to_tensor([render_shape(i + 100, SIDE)[0] for i in indices]),
        "caption": [f"turn it into {caption}" for _, caption in targets],
        "index": torch.tensor(indices, dtype=torch.long),
    }


def test_builtin_is_a_flux_kontext_pipeline_folder(built):
    from diffusers import FluxKontextPipeline

    folder = tiny.ensure_builtin_model("tiny-flux-kontext", CACHE_DIR)
    assert card_of("flow", folder) is FLUX_KONTEXT_CARD and built.card is FLUX_KONTEXT_CARD
    assert type(built) is FluxKontext
    pipeline = FluxKontextPipeline.from_pretrained(folder)
    assert pipeline.vae_scale_factor == 8 and pipeline.transformer.config.guidance_embeds
    flux = tiny.ensure_builtin_model("tiny-flux", CACHE_DIR)
    assert card_of("flow", flux).key == "flux"  # the same transformer class in a FluxPipeline is Flux.1


def _script_loss(built, batch: dict, flags: dict, u: torch.Tensor) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(built.folder / "scheduler")
    vae = built.vae
    with torch.no_grad():
        model_input = vae.encode(batch["pixel_values"]).latent_dist.mode()
        cond_model_input = vae.encode(batch["control_values"]).latent_dist.mode()
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    cond_model_input = (cond_model_input - vae.config.shift_factor) * vae.config.scaling_factor
    batch_size, channels, height, width = model_input.shape
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    latent_image_ids = FluxKontextPipeline._prepare_latent_image_ids(
        batch_size, height // 2, width // 2, "cpu", torch.float32
    )
    cond_ids = FluxKontextPipeline._prepare_latent_image_ids(batch_size, height // 2, width // 2, "cpu", torch.float32)
    cond_ids[..., 0] = 1
    latent_image_ids = torch.cat([latent_image_ids, cond_ids], dim=0)
    noise = per_sample_randn(model_input.shape[1:], SEED, STEP, INDICES, "noise")
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    positions = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[positions].flatten().view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    packed = FluxKontextPipeline._pack_latents(noisy, batch_size, channels, height, width)
    target_tokens = packed.shape[1]
    packed_cond = FluxKontextPipeline._pack_latents(cond_model_input, batch_size, channels, height, width)
    embeds, pooled = built.encode_text(batch["caption"]).values()
    with torch.no_grad():
        model_pred = built.trainable(
            hidden_states=torch.cat([packed, packed_cond], dim=1),
            timestep=timesteps / 1000,
            guidance=torch.tensor([flags["guidance"]]).expand(batch_size),
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3),
            img_ids=latent_image_ids,
            return_dict=False,
        )[0]
    model_pred = FluxKontextPipeline._unpack_latents(
        model_pred[:, :target_tokens], height * factor, width * factor, factor
    )
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=flags["weighting_scheme"], sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(batch_size, -1), 1)
    return loss.mean()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_kontext_script(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    batch = _batch()
    encoded = model.encode_batch(batch)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, encoded, SEED, STEP)
    reference = _script_loss(model, batch, flags, u)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_the_source_image_conditions_the_loss_and_cached_source_latents_train_alike(built):
    batch = _batch([4, 7])
    other = {**batch, "control_values": _batch([8, 2])["control_values"]}
    cached = {**batch, "control_latent_mean": built.encode_batch(batch)["control_latent"]}
    with torch.no_grad():
        losses = [built.loss(built.trainable, built.encode_batch(b), 0, 1).item() for b in (batch, other, cached)]
    assert losses[0] != losses[1] and losses[2] == losses[0]


def test_a_batch_without_sources_is_refused_with_the_fix(built):
    batch = _batch([1])
    del batch["control_values"]
    with pytest.raises(ValueError, match="FluxKontextPipeline trains on pairs.*data.control_dir"):
        built.encode_batch(batch)
    with pytest.raises(FamilyError, match="sample.control_images"):
        built.sample(built.trainable, ["x"], SampleSpec(prompts=["x"], steps=1), SIDE)


def test_samples_edit_their_source_images(built, tmp_path):
    sources = []
    for number in (3, 4):
        sources.append(str(tmp_path / f"{number}.png"))
        render_shape(number, SIDE)[0].save(sources[-1])
    spec = SampleSpec(prompts=["make it red", "make it red"], control_images=sources, steps=2, guidance=3.5, seed=1)
    images = built.sample(built.trainable, spec.prompts, spec, SIDE)
    assert [image.size for image in images] == [(SIDE, SIDE)] * 2
    assert images[0].tobytes() != images[1].tobytes()  # same prompt, other source (and noise)
