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

PIPELINE = "LTX2InContextPipeline"
REFERENCE = "reference_latents"  # (B, C, f, h, w): the reference clip's latents in the transformer's scale


def encode(model, batch: dict) -> dict:
    """The reference clips' posterior means (B, C, f, h, w): cached (data.cache.latents: control_latent_mean), or
    encoded now from the batch's control_values; nothing without them."""
    if batch.get("control_latent_mean") is not None:
        return {"control_latent": batch["control_latent_mean"].to(model.device).float()}
    if "control_values" not in batch:
        return {}
    return {"control_latent": source_latents(model, batch)[1]}


def model_inputs(model, encoded: dict) -> dict:
    """{reference_latents} in the transformer's scale (at least float32, concatenated before the cast)."""
    if "control_latent" not in encoded:
        return {}
    return {REFERENCE: model.to_model_latents(at_least_float32(encoded["control_latent"]))}


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
    prompt. FamilyError naming the fix when there are none or one cannot be read."""
    if not sample_spec.control_images:
        raise FamilyError(
            "sample.prompts: an IC-LoRA run (data.control_dir) renders each sample from a reference clip; give "
            "sample.control_images, one reference video (or image) per prompt (or set sample.prompts: [])."
        )
    try:
        return read_control_clips(sample_spec.control_images)
    except ValueError as err:
        raise FamilyError(str(err)) from None


def sample_inputs(prompt: str, source: list) -> dict:
    """One prompt's LTX2InContextPipeline inputs: its reference clip, fully clean (strength 1)."""
    with quiet_hf_libraries():
        from diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora import LTX2ReferenceCondition

    return {"prompt": prompt, "reference_conditions": [LTX2ReferenceCondition(frames=source, strength=1.0)]}


def pipeline_class(references: bool, transformer) -> Optional[str]:
    """LTX2InContextPipeline for an IC-LoRA run's samples; None otherwise."""
    return PIPELINE if references and transformer is not None else None
