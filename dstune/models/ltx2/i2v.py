"""Image-to-video for LTX-2 (model.image_to_video: true on an LTX2Pipeline folder; samples and the export by
LTX2ImageToVideoPipeline, which shares every part with LTX2Pipeline): ltx-trainer's first-frame conditioning.

- The condition is the clip's own first latent frame: the VAE is causal in time, so the clip's first latent frame is
  the first pixel frame's alone, which is what LTX2ImageToVideoPipeline encodes (the mode, "argmax") from the given
  image. dstune takes it from the clip's posterior mean in the transformer's scale (no extra encode, nothing more
  cached); ltx-trainer takes the same frame of its cached (mean) latents.
- Its tokens are given clean (the noisy first frame replaced by it) with timestep 0 per token; every other token at
  the clip's sigma (x 1000); the sound, where the clip has one, at the clip's sigma on every token, as ltx-trainer's
  audio and LTX2ImageToVideoPipeline's audio_timestep are. The prompt modulation's sigma is the clip's.
- The loss is the mean over the other latent frames' tokens (ltx-trainer's masked mean: the conditioning tokens'
  error times 0, divided by the share of tokens counted), i.e. the core's clean_frames = 1.
- Every clip is conditioned (ltx-trainer's i2v_lora.yaml conditions half of them, with probability 0.5; dstune's
  run is one mode or the other, as every video model's image-to-video in dstune is). A one-latent-frame clip (a still)
  has nothing to learn and is refused.
"""

from __future__ import annotations

from typing import Optional

import torch

from dstune.families.precision import at_least_float32
from dstune.families.samples import first_frames
from dstune.hf import quiet_hf_libraries

PIPELINE = "LTX2ImageToVideoPipeline"
FIRST_FRAME = "first_frame_latent"  # (B, C, 1, h, w): the clip's first latent frame in the transformer's scale


def model_inputs(model, encoded: dict, dtype: torch.dtype) -> dict:
    """{first_frame_latent} for image-to-video (at least float32: it replaces the noisy frame before the cast); nothing for
    text-to-video."""
    if not model.mode:
        return {}
    return {FIRST_FRAME: model.to_model_latents(at_least_float32(encoded["latent_mean"][:, :, :1]))}


def clean_frames(model) -> int:
    """Latent frames given clean, outside the loss: image-to-video's first."""
    return int(bool(model.mode))


def conditioned(model, noisy: torch.Tensor, timesteps: torch.Tensor, conditions: dict) -> tuple:
    """(noisy latents with the first frame clean, the video's timestep per token (B, F x h x w) with 0 on the first
    frame's tokens) for image-to-video; (noisy, timesteps) unchanged for text-to-video."""
    if not model.mode:
        return noisy, timesteps
    frames, height, width = noisy.shape[2:]
    if frames < 2:
        raise ValueError(
            "LTX-2 image-to-video: a clip of one latent frame (a still image, or fewer than "
            f"{1 + model.vae.temporal_compression_ratio} frames) has no frame to learn, its only latent "
            "frame being the given image. Remove the stills or set model.image_to_video: false."
        )
    first = conditions[FIRST_FRAME].to(noisy.device, noisy.dtype)
    noisy = torch.cat([first, noisy[:, :, 1:]], dim=2)
    keep = torch.ones(frames, height * width, device=noisy.device)
    keep[0] = 0.0
    return noisy, keep.flatten()[None, :] * timesteps.view(-1, 1).to(keep.dtype)


def sample_sources(model, sample_spec, prompts: list[str]) -> Optional[list]:
    """Image-to-video: sample.control_images, one first frame per prompt; text-to-video: None."""
    return first_frames(sample_spec, prompts) if model.mode else None


def pipeline(model, transformer) -> tuple:
    """LTX2ImageToVideoPipeline for image-to-video samples, LTX2Pipeline otherwise; the same parts either way."""
    import diffusers

    with quiet_hf_libraries():
        name = PIPELINE if model.mode and transformer is not None else model.card.pipeline_class
        return getattr(diffusers, name), model.parts
