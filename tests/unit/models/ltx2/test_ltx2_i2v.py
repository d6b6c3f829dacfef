"""LTX-2 image-to-video (model.image_to_video, dstune.models.ltx2.i2v) on builtin:tiny-ltx2: the loss against
ltx-trainer's first-frame conditioning (the clip's first latent frame given clean at timestep 0, outside the loss),
with and without the clips' sound; samples rendered by LTX2ImageToVideoPipeline from first frames, the export it
loads, and what `dstune validate` says of image-to-video on the real LTX-2 configs."""

from __future__ import annotations

import pytest
import torch

from dstune.families.randomness import per_sample_randn
from loaded_models import with_attributes
from tiny_batches import clip_batch

from .ltx_trainer import (
    FRAMES,
    INDICES,
    SEED,
    STEP,
    TEXT_TOKENS,
    load_tiny_ltx2,
    reference_audio_latents,
    reference_audio_positions,
    reference_positions,
    reference_sigmas,
    sound_batch,
    validate_example,
)


@pytest.fixture(scope="module")
def i2v():
    return load_tiny_ltx2(image_to_video=True)


def _reference_i2v_loss(built, encoded: dict, indices: list[int], sound=None) -> torch.Tensor:
    """ltx-trainer's first-frame conditioning (TextToVideoStrategy with first_frame_conditioning_p 1, the flexible
    strategy's first_frame condition at probability 1 computes the same): the first latent frame's tokens (h x w)
    are the clean latents, their per-token timesteps 0, the others' sigma; the video loss per sample is the squared
    error times the loss mask (not the conditioning tokens), its mean over tokens and channels divided by the mask's
    mean; with sound, the audio at sigma on every token, its mean squared error added."""
    vae, config = built.vae, built.transformer_config
    mean = encoded["latent_mean"]
    latents = (mean - vae.latents_mean.view(1, -1, 1, 1, 1)) * vae.config.scaling_factor
    latents = latents / vae.latents_std.view(1, -1, 1, 1, 1)
    b, c, f, h, w = latents.shape
    video = latents.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
    noise = per_sample_randn((c, f, h, w), SEED, STEP, indices, "noise").permute(0, 2, 3, 4, 1).reshape(b, -1, c)
    sigmas = reference_sigmas("shifted_logit_normal", video.shape[1], indices)
    conditioning_mask = torch.zeros(b, video.shape[1], dtype=torch.bool)
    conditioning_mask[:, : h * w] = True
    noisy = (1 - sigmas.view(-1, 1, 1)) * video + sigmas.view(-1, 1, 1) * noise
    noisy = torch.where(conditioning_mask.unsqueeze(-1), video, noisy)
    timesteps = torch.where(conditioning_mask, 0.0, sigmas.view(-1, 1).expand_as(conditioning_mask))
    audio_inputs = dict(audio_hidden_states=torch.zeros(b, 1, config["audio_in_channels"]), audio_num_frames=1)
    if sound is not None:
        audio = reference_audio_latents(built.parts["audio_vae"], sound)
        audio_noise = per_sample_randn(audio.shape[1:], SEED, STEP, indices, "audio_noise")
        audio_inputs = dict(
            audio_hidden_states=(1 - sigmas.view(-1, 1, 1)) * audio + sigmas.view(-1, 1, 1) * audio_noise,
            audio_timestep=sigmas.view(-1, 1).expand(-1, audio.shape[1]) * 1000,
            audio_coords=reference_audio_positions(audio.shape[1], b, config),
        )
    with torch.no_grad():
        video_pred, audio_pred = built.trainable(
            hidden_states=noisy,
            encoder_hidden_states=encoded["encoder_hidden_states"],
            audio_encoder_hidden_states=encoded["audio_encoder_hidden_states"],
            timestep=timesteps * 1000,
            sigma=sigmas * 1000,
            encoder_attention_mask=encoded["encoder_attention_mask"],
            audio_encoder_attention_mask=encoded["encoder_attention_mask"],
            video_coords=reference_positions(f, h, w, tuple(config["vae_scale_factors"]))[:b],
            isolate_modalities=sound is None,
            return_dict=False,
            **audio_inputs,
        )
    loss_mask = (~conditioning_mask).unsqueeze(-1).float()
    masked = (video_pred - (noise - video)).pow(2).mul(loss_mask)
    per_sample = masked.mean(dim=[-2, -1]) / loss_mask.mean(dim=[-2, -1]).clamp(min=1e-8)
    if sound is not None:
        per_sample = per_sample + (audio_pred - (audio_noise - audio)).pow(2).mean(dim=[-2, -1])
    return per_sample.mean()


def test_image_to_video_loss_equals_ltx_trainers_first_frame_conditioning(i2v):
    """model.image_to_video: the clip's first latent frame clean at timestep 0, the loss over the other frames'
    tokens: ltx-trainer's loss lines, video alone and with the clips' sound. The first latent frame is the first
    pixel frame's alone (a causal VAE), which is what LTX2ImageToVideoPipeline encodes from the given image."""
    from dstune.families.diffusion import vae_posterior

    assert i2v.mode is True and i2v.clean_frames() == 1
    batch = clip_batch(INDICES, SEED, frames=FRAMES)
    encoded = i2v.encode_batch(batch)
    alone, _ = vae_posterior(i2v.vae, batch["pixel_values"][:, :, :1])
    assert torch.allclose(alone, encoded["latent_mean"][:, :, :1], atol=1e-5)
    with torch.no_grad():
        ours = i2v.loss(i2v.trainable, encoded, SEED, STEP)
        text_to_video = with_attributes(i2v, mode=False).loss(i2v.trainable, encoded, SEED, STEP)
    assert ours.item() == pytest.approx(_reference_i2v_loss(i2v, encoded, INDICES).item(), rel=1e-5)
    assert abs(ours.item() - text_to_video.item()) > 1e-4
    with_sound = sound_batch(INDICES, i2v.parts["audio_vae"].config.sample_rate)
    encoded = i2v.encode_batch(with_sound)
    assert encoded["has_sound"].tolist() == [True, True]
    with torch.no_grad():
        ours = i2v.loss(i2v.trainable, encoded, SEED, STEP)
    reference = _reference_i2v_loss(i2v, encoded, INDICES, sound=with_sound["sound"])
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_image_to_video_refuses_a_clip_of_one_latent_frame(i2v):
    encoded = i2v.encode_batch(clip_batch(INDICES, SEED, frames=1))
    with pytest.raises(ValueError, match="one latent frame"):
        i2v.loss(i2v.trainable, encoded, SEED, STEP)


def test_image_to_video_samples_render_from_first_frames_and_the_export_loads_in_its_pipeline(i2v, tmp_path):
    """Samples: LTX2ImageToVideoPipeline around the live transformer from sample.control_images (another first
    frame, another clip); the export (an LTX2Pipeline folder, every part shared) loads in LTX2ImageToVideoPipeline
    and renders video and sound from an image."""
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    from dstune.families.base import FamilyError
    from dstune.spec.models import SampleSpec

    for name, colour in (("red", (200, 30, 30)), ("blue", (20, 40, 220))):
        Image.new("RGB", (32, 32), colour).save(tmp_path / f"{name}.png")
    clips = {
        name: i2v.sample(
            i2v.trainable,
            ["a circle moving left"],
            SampleSpec(
                prompts=["a circle moving left"],
                steps=2,
                guidance=1.0,
                control_images=[str(tmp_path / f"{name}.png")],
            ),
            32,
        )[0]
        for name in ("red", "blue")
    }
    assert len(clips["red"]) == 5 and clips["red"][0].size == (32, 32) and clips["red"].sound.shape[0] == 2
    assert clips["red"][0].tobytes() != clips["blue"][0].tobytes()
    with pytest.raises(FamilyError, match="one image per prompt"):
        i2v.sample(i2v.trainable, ["a circle"], SampleSpec(steps=2, guidance=1.0), 32)
    out = i2v.export(i2v.trainable.state_dict(), tmp_path / "full")
    pipeline = LTX2ImageToVideoPipeline.from_pretrained(out)
    result = pipeline(
        image=Image.open(tmp_path / "red.png"),
        prompt="a circle moving left",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=TEXT_TOKENS,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    assert result.frames.shape == (1, 9, 32, 32, 3) and torch.isfinite(torch.as_tensor(result.frames)).all()
    assert result.audio.shape[:2] == (1, 2) and torch.isfinite(result.audio).all()


def test_validate_takes_ltx2_image_to_video_and_refuses_it_under_a_sequence_split(capsys, monkeypatch, tmp_path):
    """model.image_to_video on the real LTX-2 configs validates (samples from one first frame per prompt), its
    activations from the constants measured with a timestep per token (more than text-to-video's); with a sequence
    split it is refused at deepspeed.sequence_parallel_size (per-token timesteps are not split), and first frames
    that do not match the prompts at sample.control_images."""
    code, out = validate_example(capsys, monkeypatch, tmp_path, "model.image_to_video=true", "sample.prompts=[]")
    assert code == 0, out["errors"]
    code, text_to_video = validate_example(capsys, monkeypatch, tmp_path, "sample.prompts=[]")
    activations = out["memory"]["per_gpu"]["activations_bytes"]
    assert 1.0 < activations / text_to_video["memory"]["per_gpu"]["activations_bytes"] < 2.0
    code, out = validate_example(
        capsys, monkeypatch, tmp_path, "model.image_to_video=true", "deepspeed.sequence_parallel_size=2"
    )
    errors = "\n".join(out["errors"])
    assert code == 1 and "deepspeed.sequence_parallel_size" in errors and "per-token" not in errors
    assert "its own timestep (the first frame's at 0)" in errors
    assert "sample.control_images" in errors and "one image per sample.prompts entry" in errors
