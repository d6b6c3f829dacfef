"""HunyuanVideo 1.5 text-to-video (model.family wan, chosen by the folder) on builtin:tiny-hunyuan-video15: the loss
against the official trainer's loss lines, the training tables, samples and the export the pipeline loads.

The reference re-computes the loss lines of Tencent-Hunyuan/HunyuanVideo-1.5's train.py (prepare_batch and
train_step): latents = the VAE posterior's sample x scaling_factor (encode_vae), get_condition's zeros of
latent channels + 1 for text-to-video, timestep_transform's shift of t / T, LinearInterpolationSchedule's
x_t = (1 - t / T) x0 + (t / T) noise, target noise - x0, the transformer on cat([x_t, condition]) at t, and
nn.functional.mse_loss over the whole batch. Its model is the official one; the reference feeds diffusers'
HunyuanVideo15Transformer3DModel instead, with the text tensors of HunyuanVideo15Pipeline.encode_prompt and the
zero image embedding HunyuanVideo15Pipeline gives text-to-video. The draws are dstune's (each sample's own
generator): the posterior draw, the noise and t, which the reference takes at the training table's entry u picks
(its own t is continuous; docs/family-wan.md lists this and the other differing defaults).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dstune.families import wan
from dstune.families.flow_hunyuan15 import TRAIN_SHIFT, VISION_TOKENS
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.pretrained import build_model
from dstune.spec.models import WanModel
from tiny_batches import clip_batch

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
NAME = "builtin:tiny-hunyuan-video15"
SEED, STEP, INDICES = 7, 5, [3, 11]
TEXT_TOKENS = 48  # model.max_sequence_length: the tiny model's Qwen side, short to keep the test quick


@pytest.fixture(scope="module")
def built():
    return build_model(WanModel(family="wan", pretrained=NAME, max_sequence_length=TEXT_TOKENS), CACHE_DIR, "cpu")


def _reference_timestep_transform(timesteps: torch.Tensor, total: int, shift: float) -> torch.Tensor:
    """train.py's timestep_transform: t / T -> shift t / (1 + (shift - 1) t), back in [0, T]."""
    if shift == 1.0:
        return timesteps
    normalised = timesteps / total
    return shift * normalised / (1 + (shift - 1) * normalised) * total


def _reference_loss(built, encoded: dict, timesteps: torch.Tensor) -> torch.Tensor:
    """train.py's loss lines for text-to-video at `timesteps` (B,), from dstune's posterior draw and noise."""
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    latents = (mean + std * per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "vae_posterior")) \
        * built.vae.config.scaling_factor
    noise = per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "noise")
    b, c, f, h, w = latents.shape
    cond_latents = torch.zeros([b, c + 1, f, h, w])  # get_condition(latents, "t2v")
    t = (timesteps / 1000).view(-1, 1, 1, 1, 1)
    latents_noised = (1 - t) * latents + t * noise
    target = noise - latents
    with torch.no_grad():
        model_pred = built.trainable(
            hidden_states=torch.cat([latents_noised, cond_latents], dim=1), timestep=timesteps,
            encoder_hidden_states=encoded["encoder_hidden_states"],
            encoder_attention_mask=encoded["encoder_attention_mask"],
            encoder_hidden_states_2=encoded["encoder_hidden_states_2"],
            encoder_attention_mask_2=encoded["encoder_attention_mask_2"],
            image_embeds=torch.zeros(b, VISION_TOKENS, built.transformer_config["image_embed_dim"]),
            return_dict=False)[0]
    return torch.nn.functional.mse_loss(model_pred, target.to(model_pred.dtype))


CASES = {  # dstune's settings: the trainer's defaults (lognorm t, shift 3.0), then another sampling and shift
    "trainer-defaults": dict(timestep_sampling="logit_normal"),
    "uniform-shift-5": dict(timestep_sampling="uniform", shift=5.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_official_trainers_loss_lines(built, case):
    settings = WanModel(family="wan", pretrained=NAME, max_sequence_length=TEXT_TOKENS, **CASES[case])
    model = replace(built, settings=settings)
    if settings.shift is not None:
        model = replace(model, **dict(zip(("train_timesteps", "train_sigmas"),
                                          model.recipe.train_tables(model.scheduler, settings.shift))))
    encoded = wan.encode_batch(model, clip_batch(INDICES, SEED))
    assert encoded["encoder_hidden_states"].shape[1] == TEXT_TOKENS
    u = timestep_density(settings, SEED, STEP, INDICES)
    timesteps = model.train_timesteps[(u * 1000).long()]
    with torch.no_grad():
        ours = wan.loss(model, model.trainable, encoded, SEED, STEP)
    assert ours.item() == pytest.approx(_reference_loss(model, encoded, timesteps).item(), rel=1e-5)


def test_training_tables_are_the_trainers_shifted_timesteps(built):
    """The tables u indexes are train.py's timestep_transform (shift 3.0 unless model.shift) of the unshifted
    1000-step grid, not the folder scheduler's sampling shift (5.0 for 480p)."""
    assert built.scheduler.config.shift == 5.0 and TRAIN_SHIFT == 3.0
    grid = torch.linspace(1000, 1, 1000)
    assert torch.allclose(built.train_timesteps, _reference_timestep_transform(grid, 1000, 3.0), atol=1e-3)
    assert torch.allclose(built.train_sigmas * 1000, built.train_timesteps, atol=1e-3)
