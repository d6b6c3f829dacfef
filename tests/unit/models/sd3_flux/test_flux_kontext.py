"""FLUX.1 Kontext (its card FLUX_KONTEXT_CARD and class FluxKontext, dstune.models.sd3_flux) on
builtin:tiny-flux-kontext's real components.

The reference is the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_flux_kontext.py (diffusers
0.42) with diffusers' own pieces: the target's and the source's latents from the VAE posterior's mode
(--vae_encode_mode mode, its default) shifted and scaled by the VAE config, the scheduler copy's timestep table
indexed by int(u * num_train_timesteps) and its get_sigmas lookup, FluxKontextPipeline's _pack_latents /
_prepare_latent_image_ids (the source's ids with the first axis set to 1) / _unpack_latents, the packed source
concatenated after the packed noisy target and the output cut back to the target's tokens, guidance
--guidance_scale, compute_loss_weighting_for_sd3; its text from its own encode_prompt's lines (T5 at
--max_sequence_length, CLIP's pooled output at 77 tokens, text ids of zeros). Only the random draws are
dstune's (noise and u, per sample): the reference takes the same ones. Beside the loss, the transformer's inputs
on both sides are compared (edit_script.Recorder): the source tokens' ids, the timesteps, the guidance exactly.
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.data.synthetic import render_shape
from dstune.families import card_of
from dstune.families.base import FamilyError
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.sd3_flux.card import FLUX_KONTEXT_CARD
from dstune.models.sd3_flux.model import FluxKontext
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from edit_script import (
    Recorder,
    check_same_denoiser_inputs,
    check_source_conditions_the_loss,
    pairs_batch,
    script_loss,
    script_timesteps,
)
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


def test_builtin_is_a_flux_kontext_pipeline_folder(built):
    from diffusers import FluxKontextPipeline

    folder = tiny.ensure_builtin_model("tiny-flux-kontext", CACHE_DIR)
    assert card_of("flow", folder) is FLUX_KONTEXT_CARD and built.card is FLUX_KONTEXT_CARD
    assert type(built) is FluxKontext
    pipeline = FluxKontextPipeline.from_pretrained(folder)
    assert pipeline.vae_scale_factor == 8 and pipeline.transformer.config.guidance_embeds
    flux = tiny.ensure_builtin_model("tiny-flux", CACHE_DIR)
    assert card_of("flow", flux).key == "flux"  # the same transformer class in a FluxPipeline is Flux.1


def _script_text(built, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The script's encode_prompt: T5's last hidden state of the caption padded to --max_sequence_length, CLIP's
    pooler output of the caption padded to 77 tokens, text ids of zeros. The flag is dstune's max_sequence_length:
    512 on a real folder (the script's default), the tiny tokenizer's 32 here."""
    encoders, tokenizers = built.text_encoders, built.tokenizers
    with torch.no_grad():
        t5_ids = tokenizers["tokenizer_2"](
            captions, padding="max_length", max_length=built.max_sequence_length, truncation=True, return_tensors="pt"
        ).input_ids
        embeds = encoders["text_encoder_2"](t5_ids)[0]
        clip_ids = tokenizers["tokenizer"](
            captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt"
        ).input_ids
        pooled = encoders["text_encoder"](clip_ids, output_hidden_states=False).pooler_output
    return embeds, pooled, torch.zeros(embeds.shape[1], 3)


def _script_loss(built, batch: dict, flags: dict, u: torch.Tensor, denoiser) -> torch.Tensor:
    from diffusers import FluxKontextPipeline

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
    timesteps, sigmas = script_timesteps(built.folder, u, model_input.ndim)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    packed = FluxKontextPipeline._pack_latents(noisy, batch_size, channels, height, width)
    target_tokens = packed.shape[1]
    packed_cond = FluxKontextPipeline._pack_latents(cond_model_input, batch_size, channels, height, width)
    embeds, pooled, text_ids = _script_text(built, batch["caption"])
    with torch.no_grad():
        model_pred = denoiser(
            hidden_states=torch.cat([packed, packed_cond], dim=1),
            timestep=timesteps / 1000,
            guidance=torch.tensor([flags["guidance"]]).expand(batch_size),
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=text_ids,
            img_ids=latent_image_ids,
            return_dict=False,
        )[0]
    model_pred = FluxKontextPipeline._unpack_latents(
        model_pred[:, :target_tokens], height * factor, width * factor, factor
    )
    return script_loss(model_pred, noise, model_input, sigmas, flags["weighting_scheme"])


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_denoiser_inputs_equal_the_diffusers_kontext_script(built, case):
    """The loss at 1e-5, and what the transformer is given: the source's tokens after the target's with their ids
    (the source's own grid, first axis 1), the timesteps, the guidance and the text ids exactly."""
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    batch = pairs_batch(INDICES, SIDE)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    ours, script = Recorder(model.trainable), Recorder(model.trainable)
    with torch.no_grad():
        loss = model.loss(ours, model.encode_batch(batch), SEED, STEP)
    reference = _script_loss(model, batch, flags, u, script)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    check_same_denoiser_inputs(
        ours.inputs,
        script.inputs,
        exact=("img_ids", "txt_ids", "timestep", "guidance", "return_dict"),
        close=("hidden_states", "encoder_hidden_states", "pooled_projections"),
    )
    ids = ours.inputs["img_ids"]
    assert ids.shape == (32, 3) and set(ids[16:, 0].tolist()) == {1} and set(ids[:16, 0].tolist()) == {0}
    assert torch.equal(ids[16:, 1:], ids[:16, 1:])  # the source's grid is the target's


def test_the_source_image_conditions_the_loss_and_cached_source_latents_train_alike(built):
    check_source_conditions_the_loss(built, lambda indices: pairs_batch(indices, SIDE))


def test_a_batch_without_sources_is_refused_with_the_fix(built):
    batch = pairs_batch([1], SIDE)
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
