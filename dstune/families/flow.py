"""The `flow` family: flow-matching image transformers (the `transformer` subfolder, FlowMatchEulerDiscreteScheduler).

The steps are the flow-matching core's (dstune.families.flow_core, shared with the video family); what differs per
model is a recipe (dstune.families.flow_recipe) in the model's unit (dstune/models/<name>/recipe.py, listed by
dstune.models.registry), found by the transformer's class in the folder (recipes that share a transformer class are
told apart by the pipeline class). The text side is encoded by the pipeline's own
`encode_prompt`, so training sees exactly what inference feeds. The loss is the one of diffusers'
examples/dreambooth/train_dreambooth_sd3.py / train_dreambooth_flux.py (tests/unit/test_flow_loss_parity.py).

    build(model: FlowModelSpec, folders, device, dtype_for_frozen) -> FlowBuilt
    encode_batch, loss, sample, export, save_lora_weights: dstune.families.flow_core
    cache hooks: TEXT_CACHE_FOLDERS, TEXT_CACHE_TENSORS, cache_text_tensors (see dstune.families.base)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from dstune.families.base import Family, FamilyError, TextCache
from dstune.families.denoiser_facts import text_once_per_node
from dstune.families.folders import component_problems, read_model_index
from dstune.families.flow_core import (
    FlowBuilt,
    build_from,
    cache_text_tensors,
    encode_batch,
    encode_captions,
    export,
    loss,
    pipeline_of,
    save_lora_weights,
    split_plan,
    text_cache_settings,
)
from dstune.families.flow_matching import image_ids, loss_weights, pack_latents, timestep_density, unpack_latents
from dstune.families.flow_distilled import attach_sampling_denoiser
from dstune.families.flow_recipe import FlowRecipe, pick_recipe, read_config
from dstune.families.samples import save_grid
from dstune.families.flow_sampling import sample
from dstune.models import registry
from dstune.models.unit import load
from dstune.spec.models import FlowModelSpec

__all__ = [
    "FlowBuilt",
    "build",
    "encode_batch",
    "loss",
    "sample",
    "export",
    "FAMILY",
    "detect_kind",
    "cache_text_tensors",
    "encode_captions",
    "TEXT_CACHE_FOLDERS",
    "TEXT_CACHE_TENSORS",
    "timestep_density",
    "loss_weights",
    "pack_latents",
    "unpack_latents",
    "image_ids",
    "save_lora_weights",
    "pipeline_of",
]

# kind -> recipe, each model unit's own (dstune.models.registry.recipes("flow")); detect_kind finds a folder's by its
# transformer (and, where recipes share one, by the pipeline class, or the text encoder class where that tells them
# apart)
RECIPES = {recipe.kind: recipe for recipe in map(load, registry.recipes("flow"))}

# Cache hooks (dstune.families.base): every folder that decides a caption's embeddings (a folder a kind lacks,
# a third text encoder, adds nothing to the fingerprint), and the tensors stored per caption.
TEXT_CACHE_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
TEXT_CACHE_FOLDERS += ("processor",)  # a recipe that tokenizes with its processor
TEXT_CACHE_TENSORS = ("encoder_hidden_states", "pooled_projections")  # CLIP+T5 models; each recipe states its own


# ---------------------------------------------------------------------------------------------------- build


def detect_kind(folder: Path) -> str:
    """The recipe's kind (FlowRecipe.kind) from model_index.json and transformer/config.json; FamilyError naming
    what is unsupported or missing."""
    index = read_model_index(folder)
    supported = ", ".join(f"{r.transformer_class} ({r.pipeline_class})" for r in RECIPES.values())
    if not (folder / "transformer").is_dir():
        hint = " (a UNet pipeline: use model.family sd)" if "unet" in index else ""
        raise FamilyError(f"{folder} has no transformer/ subfolder{hint}; model.family 'flow' trains {supported}.")
    transformer_class = read_config(folder, "transformer").get("_class_name")
    recipes = [recipe for recipe in RECIPES.values() if recipe.transformer_class == transformer_class]
    if not recipes:
        raise FamilyError(
            f"{folder / 'transformer'}: {transformer_class} is not supported by model.family 'flow'; "
            f"supported transformers: {supported}."
        )
    recipe = pick_recipe(folder, index, recipes)
    problems = component_problems(folder, index, recipe.components)
    for name in ("vae", "scheduler"):
        if not (folder / name).is_dir():
            problems.append(f"missing subfolder {name}/")
    if problems:
        raise FamilyError(
            f"{folder} cannot be used as a {transformer_class} pipeline ({recipe.pipeline_class}):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return recipe.kind


def build(
    model: FlowModelSpec,
    folders: dict,
    device,
    dtype_for_frozen: torch.dtype = torch.float32,
    zero3_config: Optional[dict] = None,
    text_encoders: bool = True,
) -> FlowBuilt:
    """Load `model.pretrained`: the transformer fp32 in host memory (the start-up casts and moves it; partitioned with
    `zero3_config`, dstune.families.diffusion.load_trainable), the frozen parts in `dtype_for_frozen`. Never
    downloads; FamilyError for any folder that is not a pipeline of one of RECIPES."""
    folder = folders["pretrained"]
    recipe = folder_recipe(folder)
    if recipe.draw_sigmas and model.shift is not None:
        raise FamilyError(
            f"model.shift: {recipe.pipeline_class}'s training example draws sigma itself, with no "
            "scheduler table to shift; remove model.shift (model.logit_mean / logit_std move the draw)"
        )
    problems = recipe.config_mismatches(folder)
    if problems:
        raise FamilyError(f"{folder}: the components do not fit together:\n" + "\n".join(f"  - {p}" for p in problems))
    return build_from(recipe, model, folders, device, dtype_for_frozen, zero3_config, text_encoders)


def folder_recipe(folder) -> FlowRecipe:
    """The recipe of the pipeline folder `folder` (FamilyError for a folder that is none of RECIPES')."""
    return RECIPES[detect_kind(Path(folder))]


def text_cache_refusal(folder) -> str | None:
    """Why data.cache.text_embeddings cannot be used with the model in `folder` (an edit model), or None."""
    recipe = folder_recipe(folder)
    return recipe.text.cache_refusal(folder) if recipe.text.cache_refusal else None


def samples_from_cached_text(folder) -> bool:
    """Whether the folder's recipe renders samples from cached prompt embeddings (Sampling.cached_text)."""
    return folder_recipe(folder).sampling.cached_text is not None


FAMILY = Family(
    name="flow",
    modality="image",
    pretrained_fields=("pretrained",),
    build=build,
    encode_batch=encode_batch,
    loss=loss,
    sample=sample,
    save_samples=save_grid,
    export=export,
    save_lora_weights=save_lora_weights,
    text_cache=TextCache(
        TEXT_CACHE_FOLDERS,
        TEXT_CACHE_TENSORS,
        cache_text_tensors,
        text_cache_settings,
        tensors_of=lambda folder: folder_recipe(folder).text_tensors,
        refusal=text_cache_refusal,
    ),
    builds_partitioned=True,
    sampling_denoiser=attach_sampling_denoiser,
    split_plan=split_plan,
    text_once_per_node=lambda spec, folder: text_once_per_node(spec, samples_from_cached_text(folder)),
    negative_caption=lambda folder: folder_recipe(folder).sampling.negative_caption,
)
