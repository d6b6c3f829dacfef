"""What the flow edit models share (those trained on source/target pairs: their cards' `pairs` names their pipeline):
the source images' latents of a batch and the sources samples render from.

A pair's source is the image at data.control_dir (or a metadata.jsonl `control_file_name`), resized and cropped to
its target's size by the dataset (dstune.data); the latent cache stores its posterior beside the target's as
`control_latent_mean`.
"""

from __future__ import annotations

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import vae_posterior
from dstune.families.samples import read_control_images


def source_latents(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the source pixels (B, 3, H, W) in [-1, 1] on the device, their VAE posterior's mode (B, C, h, w), unscaled:
    cached, or encoded now). ValueError with the fix when the batch has no sources."""
    if "control_values" not in batch:
        raise ValueError(
            f"{model.card.pipeline_class} trains on pairs: every target image needs its source (control) image, "
            "but this batch has none. Give data.control_dir (or a `control_file_name` per metadata.jsonl line): "
            f"see {model.card.docs}, {model.card.name}."
        )
    pixels = batch["control_values"].to(model.device)
    if "control_latent_mean" in batch:
        return pixels, batch["control_latent_mean"].to(model.device).float()
    return pixels, vae_posterior(model.vae, pixels.to(model.vae.dtype))[0]


def edit_sample_sources(sample_spec) -> list:
    """sample.control_images as RGB images, one per prompt; FamilyError naming the fix when there are none, or the
    one that cannot be read."""
    if not sample_spec.control_images:
        raise FamilyError(
            "sample.prompts: an edit model renders from a source image; give sample.control_images, one source "
            "image per prompt (or set sample.prompts: [])."
        )
    try:
        return read_control_images(sample_spec.control_images)
    except ValueError as err:
        raise FamilyError(str(err)) from None
