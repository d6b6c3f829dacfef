"""Z-Image (its card and class, dstune.models.zimage) on builtin:tiny-z-image's real components.

The loss-parity test re-computes the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_z_image.py
with diffusers' own pieces: the captions through ZImagePipeline.encode_prompt (a list of unpadded embeddings), the
posterior's mode (the example's latent_dist.mode()) shifted and scaled, the scheduler copy's tables, the one-frame
latent list, the timestep as (1000 - t) / 1000, the negated output, compute_loss_weighting_for_sd3. The noise and u
are dstune's per-sample draws, taken by both sides.
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.zimage.card import Z_IMAGE_CARD
from dstune.models.zimage.model import ZImage
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_settings
from tiny_batches import shape_batch

SEED, STEP, INDICES = 5, 2, [1, 8, 13]
CASES = {  # (dstune settings, the example's flags): its defaults (uniform u: --weighting_scheme none), then others
    "script-defaults": (dict(timestep_sampling="uniform"), dict(weighting_scheme="none")),
    "logit-normal": (dict(timestep_sampling="logit_normal"), dict(weighting_scheme="logit_normal")),
}


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained="builtin:tiny-z-image"), CACHE_DIR, "cpu")


def _batch(indices=INDICES) -> dict:
    return shape_batch(indices)


def test_builtin_is_a_z_image_pipeline_folder(built):
    folder = tiny.ensure_builtin_model("tiny-z-image", CACHE_DIR)
    assert card_of("flow", folder) is Z_IMAGE_CARD and built.card is Z_IMAGE_CARD
    assert type(built) is ZImage
    assert built.max_sequence_length == 512 and type(built.text_encoders["text_encoder"]).__name__ == "Qwen3Model"


def _script_loss(built, pixels: torch.Tensor, captions: list[str], flags: dict, u: torch.Tensor) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(built.folder / "scheduler")
    vae = built.vae
    with torch.no_grad():
        model_input = vae.encode(pixels).latent_dist.mode()
        model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
        prompt_embeds, _ = built.pipeline().encode_prompt(prompt=list(captions), max_sequence_length=512)
    noise = per_sample_randn(model_input.shape[1:], SEED, STEP, INDICES, "noise")
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    positions = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[positions].flatten().view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    with torch.no_grad():
        model_pred = built.trainable(
            list(noisy.unsqueeze(2).unbind(dim=0)), (1000 - timesteps) / 1000, prompt_embeds, return_dict=False
        )[0]
    model_pred = -torch.stack(model_pred, dim=0).squeeze(2)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=flags["weighting_scheme"], sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(len(captions), -1), 1)
    return loss.mean()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_z_image_script(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    batch = _batch()
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, model.encode_batch(batch), SEED, STEP)
    reference = _script_loss(model, batch["pixel_values"], batch["caption"], flags, u)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_cached_text_trains_like_encoded_text(built):
    tensors = built.encode_text(["a", "a much longer caption about a red circle"])
    assert tensors["encoder_hidden_states"].shape[:2] == tensors["encoder_attention_mask"].shape == (2, 512)
    batch = _batch([4, 7])
    cached = {**batch, **built.encode_text(batch["caption"])}
    with torch.no_grad():
        encoded = built.loss(built.trainable, built.encode_batch(batch), 0, 1)
        from_cache = built.loss(built.trainable, built.encode_batch(cached), 0, 1)
    assert from_cache.item() == encoded.item()


def test_sample_and_export_reload_with_z_image_pipeline(built, tmp_path):
    from diffusers import ZImagePipeline

    images = built.sample(built.trainable, ["a red circle"], SampleSpec(prompts=["x"], steps=2, guidance=3.0), 32)
    assert [image.size for image in images] == [(32, 32)]
    state = {k: v + 0.01 for k, v in built.trainable.state_dict().items()}
    reloaded = ZImagePipeline.from_pretrained(built.export(state, tmp_path / "export"))
    name = next(iter(state))
    assert torch.equal(reloaded.transformer.state_dict()[name], state[name])
    assert reloaded(prompt="a red circle", height=32, width=32, num_inference_steps=2).images[0].size == (32, 32)
