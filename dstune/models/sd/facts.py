"""The torch-free facts of the UNet families, sd (Stable Diffusion 1.x/2.x) and sdxl: a UNet2DConditionModel trained
beside a VAE and one or two CLIP text encoders (dstune.families.facts describes the contract)."""

from __future__ import annotations

from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes, measured_unet, unet_sample_bytes
from dstune.families.denoiser_facts import (
    DenoiserRules,
    count_denoiser,
    embedding_width_bytes,
    image_latent_bytes,
    trains_denoiser,
)
from dstune.families.facts import ModelFacts

CLIP_TOKENS = 77  # every CLIP text encoder's context


def _activations(spec, folder, config: dict, clips) -> tuple[float, float]:
    """The measured constants of the UNet structure the config has (SD 1.x/2.x, SDXL; any width), over the latent
    pixels (resolution / 8 squared) and the 77 CLIP tokens; a UNet of another structure (the built-in tiny ones):
    the generic formula (dstune.memory.activations.unet_sample_bytes)."""
    key = measured_unet(config)
    if key is None:
        return unet_sample_bytes(config, spec.data.resolution)
    pixels = (spec.data.resolution / 8) ** 2
    shape = ModelShape(width=config["block_out_channels"][0])
    return in_plan_units(
        measured_sample_bytes(key, shape, pixels, CLIP_TOKENS, spec.train.precision), spec.train.precision
    )


def _cache_bytes(spec, folder, companions: dict, num_samples: int, clips) -> int:
    """Per image its posterior and each CLIP's 77 hidden states, times the images."""
    per_sample = image_latent_bytes(spec, folder, companions)
    if spec.data.cache.text_embeddings:
        for part in companions:
            if part.startswith("text_encoder"):
                per_sample += CLIP_TOKENS * folder.config(part).get("hidden_size", 0) * embedding_width_bytes(spec)
    return per_sample * num_samples


RULES = DenoiserRules(
    trained=trains_denoiser("unet"),
    activations=_activations,
    cache_bytes=_cache_bytes,
    text_once=False,  # the SD families have no Family.text_once_per_node: their CLIP encoders are small
)


def _count(spec, num_samples: int, clips=()):
    return count_denoiser(spec, num_samples, clips, RULES)


SD_FACTS = ModelFacts(family="sd", modality="image", count=_count)
SDXL_FACTS = ModelFacts(family="sdxl", modality="image", count=_count)
