"""Qwen-Image (its card and class, dstune.models.qwen_image) on builtin:tiny-qwen-image's real components.

The loss-parity test re-computes the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_qwen_image.py
with diffusers' own pieces: each caption encoded alone by QwenImagePipeline.encode_prompt and the batch padded to
its longest caption (the script's concat_prompt_embedding_batches), the one-frame posterior normalised with
latents_mean and 1 / latents_std, the scheduler copy's tables, QwenImagePipeline._pack_latents / _unpack_latents
with the script's img_shapes, compute_loss_weighting_for_sd3. The draws (posterior, noise, u) are dstune's per-sample
ones, taken by both sides.
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.qwen_image.card import QWEN_IMAGE_CARD
from dstune.models.qwen_image.model import QwenImage
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_settings
from tiny_batches import shape_batch

SEED, STEP, INDICES = 3, 4, [5, 0, 9]
# (dstune settings, the script's flags): the script's defaults (uniform u: --weighting_scheme none), then others
CASES = {
    "script-defaults": (dict(timestep_sampling="uniform"), dict(weighting_scheme="none")),
    "logit-normal": (dict(timestep_sampling="logit_normal"), dict(weighting_scheme="logit_normal")),
    "cosmap": (dict(timestep_sampling="uniform", loss_weighting="cosmap"), dict(weighting_scheme="cosmap")),
}


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained="builtin:tiny-qwen-image"), CACHE_DIR, "cpu")


def _batch(indices=INDICES) -> dict:
    return shape_batch(indices)


def test_builtin_is_a_qwen_image_pipeline_folder(built):
    from diffusers import QwenImagePipeline

    folder = tiny.ensure_builtin_model("tiny-qwen-image", CACHE_DIR)
    assert card_of("flow", folder) is QWEN_IMAGE_CARD and built.card is QWEN_IMAGE_CARD
    assert type(built) is QwenImage
    pipeline = QwenImagePipeline.from_pretrained(folder)
    assert type(pipeline.vae).__name__ == "AutoencoderKLQwenImage" and pipeline.vae.config.z_dim == 16
    assert built.max_sequence_length == 512  # the script's --max_sequence_length default


def _script_text(built, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each caption alone through encode_prompt, then padded to the batch's longest (the script's cache path)."""
    pipeline = built.pipeline()
    pairs = [pipeline.encode_prompt([caption], device="cpu", max_sequence_length=512) for caption in captions]
    longest = max(embeds.shape[1] for embeds, _ in pairs)
    embeds = torch.cat([torch.cat([e, e.new_zeros(1, longest - e.shape[1], e.shape[2])], 1) for e, _ in pairs])
    masks = [torch.ones(1, e.shape[1], dtype=torch.long) if m is None else m for e, m in pairs]
    mask = torch.cat([torch.cat([m, m.new_zeros(1, longest - m.shape[1])], 1) for m in masks])
    return embeds, (None if mask.all() else mask)


def _script_loss(built, encoded: dict, captions: list[str], flags: dict, u: torch.Tensor) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(built.folder / "scheduler")
    vae = built.vae
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    mean, std = encoded["latent_mean"].unsqueeze(2), encoded["latent_std"].unsqueeze(2)  # the VAE's 5-D posterior
    draw = lambda purpose: per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, purpose)  # noqa: E731
    model_input = (mean + std * draw("vae_posterior") - latents_mean) * latents_std
    noise = draw("noise")
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    positions = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[positions].flatten().view(-1, 1, 1, 1, 1)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    batch, channels, _, height, width = model_input.shape
    packed = QwenImagePipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), batch, channels, height, width)
    embeds, mask = _script_text(built, captions)
    with torch.no_grad():
        model_pred = built.trainable(
            hidden_states=packed,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=timesteps / 1000,
            img_shapes=[(1, height // 2, width // 2)] * batch,
            return_dict=False,
        )[0]
    model_pred = QwenImagePipeline._unpack_latents(model_pred, height * 2, width * 2, 2)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=flags["weighting_scheme"], sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(batch, -1), 1)
    return loss.mean()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_qwen_image_script(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    batch = _batch()
    encoded = model.encode_batch(batch)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, encoded, SEED, STEP)
    reference = _script_loss(model, encoded, batch["caption"], flags, u)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_text_tensors_have_one_shape_per_caption_and_train_like_encoded_ones(built):
    """Cached per caption (padded to max_sequence_length with a mask), the text trains to the same loss."""
    tensors = built.encode_text(["a", "a much longer caption about a red circle"])
    assert set(tensors) == {"encoder_hidden_states", "encoder_attention_mask"}
    assert tensors["encoder_hidden_states"].shape[:2] == tensors["encoder_attention_mask"].shape == (2, 512)
    assert tensors["encoder_attention_mask"][0].sum() < tensors["encoder_attention_mask"][1].sum()
    batch = _batch([4, 7])
    cached = {**batch, **built.encode_text(batch["caption"])}
    with torch.no_grad():
        encoded = built.loss(built.trainable, built.encode_batch(batch), 0, 1)
        from_cache = built.loss(built.trainable, built.encode_batch(cached), 0, 1)
    assert from_cache.item() == encoded.item()


def test_sample_and_export_reload_with_qwen_image_pipeline(built, tmp_path):
    from diffusers import QwenImagePipeline

    images = built.sample(
        built.trainable,
        ["a red circle", "a blue square"],
        SampleSpec(prompts=["x"], steps=2, guidance=4.0, seed=1),
        32,
    )
    assert [image.size for image in images] == [(32, 32), (32, 32)]
    state = {k: v + 0.01 for k, v in built.trainable.state_dict().items()}
    folder = built.export(state, tmp_path / "export")
    reloaded = QwenImagePipeline.from_pretrained(folder)
    assert torch.equal(reloaded.transformer.state_dict()["proj_out.weight"], state["proj_out.weight"])
    rendered = reloaded(prompt="a red circle", height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0).images
    assert rendered[0].size == (32, 32)
