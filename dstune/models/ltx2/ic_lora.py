"""IC-LoRA (in-context control) for LTX-2: a reference clip per sample (data.control_dir: a clip, or an image, of the
sample's relative path and name, e.g. its pose, depth or edge video), as Lightricks' ltx-trainer trains it
(VideoToVideoStrategy, its `video_to_video` strategy); samples by LTX2InContextPipeline (the same folder's parts),
whose reference_conditions take the sample.control_images clips.

- The reference is read with its target's frames (the same start and count) at its target's size, and encoded
  by the video VAE to its posterior mean (what the pipeline encodes, "argmax"), normalised as the target's latents.
- Its tokens come first, then the target's noisy tokens: [reference | target], as ltx-trainer concatenates them.
- Its timestep is 0 on every token (clean), the target's the clip's sigma (x 1000); the prompt modulation's sigma is
  the clip's.
- Positions: each part's own grid from frame 0 (`prepare_video_coords` at the reference's latent size, then at the
  target's), concatenated, so a reference token sits where its target token does (ltx-trainer's
  _get_video_positions of each; the reference at the target's size, so no spatial rescaling).
- The loss is over the target's tokens only: the prediction is cut to them (ltx-trainer's compute_loss slices the
  reference off and masks it out).
- A clip with sound trains its sound as any LTX-2 clip does, the reference tokens being part of the video stream
  the sound attends to (as LTX2InContextPipeline renders them); ltx-trainer's video-to-video strategy has no sound.
"""

from __future__ import annotations

from typing import Optional

import torch

from dstune.families.base import FamilyError
from dstune.families.flow_edit import source_latents
from dstune.families.precision import at_least_float32
from dstune.families.samples import read_control_clips
from dstune.hf import quiet_hf_libraries
from dstune.models.ltx2.audio import audio_tokens

PIPELINE = "LTX2InContextPipeline"
REFERENCE = "reference_latents"  # (B, C, f, h, w): the reference clip's latents in the transformer's scale
REFERENCE_SOUND = "reference_sound_tokens"  # (B, T, D): the reference clip's sound as the transformer's audio tokens


def encode(model, batch: dict) -> dict:
    """The reference clips' posterior means (B, C, f, h, w): cached (data.cache.latents: control_latent_mean), or
    encoded now from the batch's control_values; and where the references have sound (control_has_sound), their
    sound's audio-VAE posterior means (cached beside them, or encoded from control_sound). Nothing without them."""
    found = {}
    if batch.get("control_latent_mean") is not None:
        found["control_latent"] = batch["control_latent_mean"].to(model.device).float()
    elif "control_values" in batch:
        found["control_latent"] = source_latents(model, batch)[1]
    heard = batch.get("control_has_sound")
    if found and heard is not None and heard.bool().any():
        found["control_has_sound"] = heard.to(model.device).reshape(-1).bool()
        if batch.get("control_sound_latent") is not None:
            found["control_sound_latent"] = batch["control_sound_latent"].to(model.device).float()
        else:
            found["control_sound_latent"] = model.encode_sound(batch["control_sound"].to(model.device))
    return found


def model_inputs(model, encoded: dict) -> dict:
    """{reference_latents} in the transformer's scale (at least float32, concatenated before the cast), and
    {reference_sound_tokens, reference_heard} where the references have sound."""
    if "control_latent" not in encoded:
        return {}
    found = {REFERENCE: model.to_model_latents(at_least_float32(encoded["control_latent"]))}
    if "control_sound_latent" in encoded:
        found[REFERENCE_SOUND] = audio_tokens(model.parts["audio_vae"], encoded["control_sound_latent"])
        found[REFERENCE_HEARD] = encoded["control_has_sound"]
    return found


REFERENCE_HEARD = "reference_heard"  # (B,) bool: the reference clip has a sound track (its sound joins the audio)


def joined_sound(transformer, audio: torch.Tensor, timesteps: torch.Tensor, conditions: dict):
    """Audio-to-audio (ltx-trainer's flexible strategy with a reference condition on the audio modality): (audio
    tokens [reference | target] (B, R + T, D), per-token timesteps (B, R + T) with the reference's 0, the audio
    coordinates of both, each from 0, R) where the batch's references carry sound; None otherwise. `audio` are the
    target's noisy sound tokens, `timesteps` its (B,) timesteps."""
    reference = conditions.get(REFERENCE_SOUND)
    if reference is None:
        return None
    batch, count = audio.shape[0], audio.shape[1]
    reference = reference.to(audio.device, audio.dtype)
    per_token = timesteps.reshape(batch, 1).expand(batch, count)
    clean = per_token.new_zeros(batch, reference.shape[1])
    rope = transformer.audio_rope
    coords = [rope.prepare_audio_coords(batch, tokens, audio.device) for tokens in (reference.shape[1], count)]
    return (
        torch.cat([reference, audio], dim=1),
        torch.cat([clean, per_token], dim=1),
        torch.cat(coords, dim=2),
        reference.shape[1],
    )


def joined(transformer, tokens: torch.Tensor, timesteps: torch.Tensor, conditions: dict, grid: tuple, fps: float):
    """(tokens [reference | target] (B, R + T, C), per-token timesteps (B, R + T) with the reference's 0, the
    video coordinates of both, R) for a batch with references; None without. `tokens` are the target's packed
    tokens, `timesteps` its (B,) or per-token (B, T) timesteps, `grid` its latent (frames, height, width)."""
    reference = conditions.get(REFERENCE)
    if reference is None:
        return None
    batch, count = tokens.shape[0], tokens.shape[1]
    packed = reference.to(tokens.device, tokens.dtype).flatten(2).transpose(1, 2)  # (B, f h w, C), as pack()
    per_token = timesteps.reshape(batch, -1).expand(batch, count) if timesteps.ndim < 2 else timesteps
    clean = per_token.new_zeros(batch, packed.shape[1])
    rope = transformer.rope
    coords = [rope.prepare_video_coords(batch, *shape, tokens.device, fps=fps) for shape in (reference.shape[2:], grid)]
    return (
        torch.cat([packed, tokens], dim=1),
        torch.cat([clean, per_token], dim=1),
        torch.cat(coords, dim=2),
        packed.shape[1],
    )


def sample_sources(sample_spec) -> list:
    """sample.control_images as reference clips (each a list of RGB frames: a video's, or one image), one per
    prompt; with image-to-video a prompt's [reference clip, first frame] as (clip, image). FamilyError naming the
    fix when there are none or one cannot be read."""
    if not sample_spec.control_images:
        raise FamilyError(
            "sample.prompts: an IC-LoRA run (data.control_dir) renders each sample from a reference clip; give "
            "sample.control_images, one reference video (or image) per prompt (or set sample.prompts: [])."
        )
    try:
        return [
            read_control_clips([one])[0] if isinstance(one, str) else FirstFrame(read_control_clips(one))
            for one in sample_spec.control_images
        ]
    except ValueError as err:
        raise FamilyError(str(err)) from None


class FirstFrame(tuple):
    """A prompt's (reference clip, [first frame]) for image-to-video IC-LoRA samples."""


def sample_inputs(prompt: str, source) -> dict:
    """One prompt's LTX2InContextPipeline inputs: its reference clip, fully clean (strength 1); with image-to-video
    its first frame too, at frame 0, clean (LTX2VideoCondition, strength 1)."""
    with quiet_hf_libraries():
        from diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora import LTX2ReferenceCondition, LTX2VideoCondition

    clip = source[0] if isinstance(source, FirstFrame) else source
    found = {"prompt": prompt, "reference_conditions": [LTX2ReferenceCondition(frames=clip, strength=1.0)]}
    if isinstance(source, FirstFrame):
        found["conditions"] = [LTX2VideoCondition(frames=source[1][0], index=0, strength=1.0)]
    return found


def pipeline_class(references: bool, transformer) -> Optional[str]:
    """LTX2InContextPipeline for an IC-LoRA run's samples; None otherwise."""
    return PIPELINE if references and transformer is not None else None
