"""The video family (`model.family` VIDEO_FAMILY in the spec): the video models of the flow-matching core, each a
model unit's `VideoModel` (dstune.models.registry.recipes(VIDEO_FAMILY)), told apart by the folder's transformer
class.

Video trains on the flow-matching core of the image models (dstune.families.flow_core): a clip's latents are
(B, C, frames, H, W) and every step (posterior draw, noise, table positions, x_t, loss, sampling, export) is the
core's. What is a model's own is its recipe and its `VideoModel` (in its unit: the folder's checks against the
spec, which recipe a folder takes, its first-frame conditioning's cache key and tensors, the text cache's folders).
This module is the family the stages call: build, the caches' keys, over whichever video model the folder holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable, Optional

import torch

from dstune.families.base import Family, FamilyError, LatentExtras, TextCache
from dstune.families.denoiser_facts import text_once_per_node
from dstune.families.folders import read_component_config
from dstune.families.flow_core import (
    FlowBuilt,
    build_from,
    encode_batch,
    encode_captions,
    export,
    loss,
    save_lora_weights,
    split_plan,
    text_cache_settings,
)
from dstune.families.flow_recipe import FlowRecipe
from dstune.families.flow_sampling import sample
from dstune.families.samples import save_clip_grid
from dstune.models import registry
from dstune.models.unit import VIDEO_FAMILY, load
from dstune.spec.video_models import VideoModelSpec

__all__ = [
    "build",
    "encode_batch",
    "encode_captions",
    "loss",
    "sample",
    "export",
    "save_lora_weights",
    "FAMILY",
    "VideoModel",
    "video_model_of",
    "latent_cache_key",
    "condition_tensors",
]


@dataclass(frozen=True)
class VideoModel:
    """What the video family asks one video model (declared in its unit, listed by the registry)."""

    title: str  # the model's name in messages
    transformer_class: str  # the folder's transformer/config.json _class_name that tells it
    recipe_of: Callable  # folder -> its FlowRecipe (text-to-video, image-to-video, ...)
    folder_problems: Callable  # (folder, model.expert, model.image_to_video, model.timestep_range) -> [why not]
    text_cache_folders: tuple[str, ...]  # the subfolders that decide a caption's cached embeddings
    # (model spec, folder) -> (settings text, subfolders that key the entries, tensor names) of the first-frame
    # condition stored beside each clip's posterior; ("", (), ()) where this run stores none
    cache_key: Callable
    condition_tensors: Callable  # (built, clips) -> {name: tensor} that cache_key names
    after_build: Optional[Callable] = None  # (built) -> None: what the model's parts need once loaded


@cache
def _video_models() -> dict[str, VideoModel]:
    return {model.transformer_class: model for model in map(load, registry.recipes(VIDEO_FAMILY))}


def video_model_of(folder: Path) -> VideoModel:
    """The video model a pipeline folder holds, by its transformer class; FamilyError naming the known ones."""
    known = _video_models()
    path = Path(folder) / "transformer" / "config.json"
    transformer = read_component_config(Path(folder), "transformer").get("_class_name") if path.is_file() else None
    if transformer not in known:
        raise FamilyError(
            f"{folder} cannot be used as a video pipeline (model.family {VIDEO_FAMILY}): its transformer "
            f"({transformer or 'no transformer/config.json'}) is none of the video models dstune trains "
            f"({', '.join(f'{m.title}: {name}' for name, m in known.items())})"
        )
    return known[transformer]


def build(
    model: VideoModelSpec,
    folders: dict,
    device,
    dtype_for_frozen: torch.dtype = torch.float32,
    zero3_config: Optional[dict] = None,
    text_encoders: bool = True,
) -> FlowBuilt:
    """The transformer (model.expert's) fp32 in host memory (partitioned with `zero3_config`), the VAE and text (and
    image) encoders frozen in `dtype_for_frozen`. Never downloads; FamilyError listing every problem of a folder
    that is not a video pipeline this spec can train."""
    folder = folders["pretrained"]
    video = video_model_of(folder)
    problems = video.folder_problems(folder, model.expert, model.image_to_video, model.timestep_range)
    recipe = video.recipe_of(Path(folder))
    if model.timestep_sampling == "shifted_logit_normal" and recipe.draw_sigmas is None:
        problems.append(
            "model.timestep_sampling shifted_logit_normal is the sampler of the video models that draw "
            f"sigma themselves; {video.title} indexes the scheduler's tables: use uniform, logit_normal "
            "or mode"
        )
    if problems:
        raise FamilyError(
            f"{folder} cannot be used as a {video.title} pipeline (model.family {VIDEO_FAMILY}):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    built = build_from(recipe, model, folders, device, dtype_for_frozen, zero3_config, text_encoders)
    if video.after_build is not None:
        video.after_build(built)
    return built


def latent_cache_key(model: VideoModelSpec, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """What keys the latent entries of an image-to-video run beside the VAE (the folder's video model says)."""
    return video_model_of(Path(folder)).cache_key(model, Path(folder))


def condition_tensors(built, clips: torch.Tensor) -> dict:
    """What the latent cache stores beside an image-to-video clip's posterior, per the run's video model."""
    return _video_models()[built.recipe.transformer_class].condition_tensors(built, clips)


def folder_recipe(folder) -> FlowRecipe:
    """The recipe of the video pipeline folder `folder` (its video model's, for its layout)."""
    return video_model_of(Path(folder)).recipe_of(Path(folder))


def text_once(spec, folder) -> Optional[str]:
    """The text encoders load on one rank per node where the run's samples, if any, can render from the prompts'
    cached text (the recipe's Sampling.cached_text; its unit's VideoFacts.samples_from_cached_text says the same)."""
    return text_once_per_node(spec, folder_recipe(folder).sampling.cached_text is not None)


FAMILY = Family(
    name=VIDEO_FAMILY,
    modality="video",
    pretrained_fields=("pretrained",),
    build=build,
    encode_batch=encode_batch,
    loss=loss,
    sample=sample,
    save_samples=save_clip_grid,
    export=export,
    save_lora_weights=save_lora_weights,
    text_cache=TextCache(
        ("text_encoder", "tokenizer"),
        ("encoder_hidden_states",),
        encode_captions,
        text_cache_settings,
        tensors_of=lambda folder: folder_recipe(folder).text_tensors,
        folders_of=lambda folder: video_model_of(Path(folder)).text_cache_folders,
    ),
    builds_partitioned=True,
    latent_extras=LatentExtras(latent_cache_key, condition_tensors),
    split_plan=split_plan,
    text_once_per_node=text_once,
    negative_caption=lambda folder: folder_recipe(folder).sampling.negative_caption,
)
