"""What the flow edit models share (those trained on source/target pairs: their cards' `pairs` names their pipeline):
the source images' latents of a batch and the sources samples render from.

A pair's source is the image at data.control_dir (or a metadata.jsonl `control_file_name`), resized and cropped to
its target's size by the dataset (dstune.data); the latent cache stores its posterior beside the target's as
`control_latent_mean`. A model that takes several references per sample (data.control_dir a list) reads reference
k > 1 under the same names with `_k` added (`control_values_2`, `control_latent_mean_2`: dstune.data.pairs).
"""

from __future__ import annotations

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import vae_posterior
from dstune.families.samples import read_control_images
from dstune.spec.data_sections import reference_key


def source_latents(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the source pixels (B, 3, H, W) in [-1, 1] on the device, their VAE posterior's mode (B, C, h, w), unscaled:
    cached, or encoded now). ValueError with the fix when the batch has no sources."""
    if batch.get("control_values") is None:
        raise ValueError(
            f"{model.card.pipeline_class} trains on pairs: every target image needs its source (control) image, "
            "but this batch has none. Give data.control_dir (or a `control_file_name` per metadata.jsonl line): "
            f"see {model.card.docs}, {model.card.name}."
        )
    if reference_count(batch) > 1:  # metadata.jsonl may name several: never leave one out silently
        raise ValueError(
            f"{model.card.pipeline_class} takes one reference image per sample, but this batch's samples carry "
            f"{reference_count(batch)}: name one `control_file_name` per metadata.jsonl line (docs/data.md names "
            "the models that take several)."
        )
    pixels = batch["control_values"].to(model.device)
    if batch.get("control_latent_mean") is not None:
        return pixels, batch["control_latent_mean"].to(model.device).float()
    return pixels, vae_posterior(model.vae, pixels.to(model.vae.dtype))[0]


def reference_count(batch: dict) -> int:
    """The references each sample of the batch carries (0: none)."""
    count = 0
    while reference_key("control_values", count) in batch:
        count += 1
    return count


def reference_latents(model, batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """source_latents for each of the batch's references, in order."""
    found = []
    for number in range(max(reference_count(batch), 1)):
        values, mean = reference_key("control_values", number), reference_key("control_latent_mean", number)
        found.append(
            source_latents(model, {"control_values": batch.get(values), "control_latent_mean": batch.get(mean)})
        )
    return found


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


def edit_sample_references(sample_spec) -> list[list]:
    """sample.control_images of a model with several references: each prompt's references as RGB images (a
    prompt given one path: one); FamilyError as edit_sample_sources."""
    if not sample_spec.control_images:
        edit_sample_sources(sample_spec)  # raises with the fix
    try:
        return [read_control_images([one] if isinstance(one, str) else one) for one in sample_spec.control_images]
    except ValueError as err:
        raise FamilyError(str(err)) from None
