"""The torch-free facts of the flow family's models: each is told by its folder's transformer class (its unit's
FlowModel row, dstune.models.registry.flow_models), as the torch side's recipes are (dstune.families.flow_recipe);
dstune.families.facts describes the contract.

Image tokens are 2x2 latent patches (16 px at the real models' 8x VAEs; the sequence split reads the VAE config
for its token counts); text tokens join them. An edit model trains on (source, target)
pairs: the source's tokens and latents double the target's, and the source image's vision tokens join the text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Callable, Optional

from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes
from dstune.families.denoiser_facts import (
    side_issues,
    DenoiserRules,
    count_denoiser,
    image_latent_bytes,
    pipeline_folder,
    trains_denoiser,
    transformer_text_bytes,
)
from dstune.families.facts import Attention, ModelFacts, SpecIssues, no_plan_refusal
from dstune.memory.counts import SizesUnknown, count_component, vae_factor
from dstune.model_folders import builtin_name_problem, locate
from dstune.models import registry
from dstune.models.unit import load

DEFAULT_TEXT_TOKENS = 512  # max_sequence_length of most flow models' training examples


def two_streams(config: dict) -> ModelShape:
    """Joint (two-stream) and single-stream blocks of heads x head_dim."""
    return ModelShape(
        config["num_attention_heads"] * config["attention_head_dim"],
        {
            "transformer_blocks": config.get("num_layers", 0),
            "single_transformer_blocks": config.get("num_single_layers", 0),
        },
    )


def joint_blocks(config: dict) -> ModelShape:
    """Joint (two-stream) blocks only."""
    return ModelShape(
        config["num_attention_heads"] * config["attention_head_dim"],
        {"transformer_blocks": config.get("num_layers", 0)},
    )


@dataclass(frozen=True)
class FlowModel:
    """One flow model's torch-free facts, told by its transformer class (each unit's facts.py declares its rows)."""

    name: str
    constants: str  # its key in the measured activation constants (dstune/model_configs/activation_constants.json)
    shape: Callable  # transformer config -> ModelShape: the width and blocks the constants are evaluated at
    text_width_key: str  # the transformer config's key for the text embeddings' width
    clip_tokens: int = 0  # CLIP tokens before the long text encoder's
    default_text_tokens: int = DEFAULT_TEXT_TOKENS
    edit_pipelines: tuple[str, ...] = ()  # pipeline classes of this transformer that train on (source, target) pairs
    edit_vision_patch_px: int = (
        0  # an edit pipeline's source-image vision tokens (this many px a side each) join the text
    )
    pad_tokens: Callable = lambda tokens: tokens  # what the transformer pads a sequence to
    sampling_parts: tuple[str, ...] = ()  # frozen components loaded only while samples render
    draws_sigma: bool = False  # its example draws sigma itself (no scheduler tables, so no model.shift)
    text_layers_key: Optional[str] = None  # the config's count of text-encoder layers stacked per token
    # output.lora_format values whose tools are known to load this model's file (comfyui: diffusers' own keys)
    lora_formats: tuple[str, ...] = ("diffusers", "comfyui")
    side_px: int = 0  # image sides must be multiples of it, said by validate (0: the VAE's factor x token_patch)
    lora_loader: str = ""  # what loads its LoRA files, where a format is refused (output.lora_format)
    token_patch: int = 2  # latent rows (and columns) one image token packs: 2x2 for every flow model here
    # its samples render from cached prompt embeddings (its recipes' Sampling.cached_text), so with the text cache
    # the text encoders load on one rank per node (dstune.families.denoiser_facts.text_once_per_node)
    samples_from_cached_text: bool = False


@cache
def flow_models() -> dict[str, FlowModel]:
    """{transformer class: FlowModel}, every unit's rows (dstune.models.registry.flow_models)."""
    return {name: row for where in registry.flow_models() for name, row in load(where).items()}


def flow_model(folder) -> FlowModel:
    """The flow model a pipeline folder holds, by its transformer class; SizesUnknown naming the known ones."""
    transformer = (folder.index.get("transformer") or [None, None])[1]
    known = flow_models()
    if transformer not in known:
        raise SizesUnknown(
            f"{folder.origin}: its transformer {transformer} is none of the flow models dstune "
            f"trains ({', '.join(known)})"
        )
    return known[transformer]


def edit_pipeline(folder) -> Optional[str]:
    """The folder's pipeline class when it is an edit model (trained on pairs), else None."""
    name = folder.index.get("_class_name")
    return name if name in flow_model(folder).edit_pipelines else None


def text_tokens(spec, folder) -> int:
    """Text tokens per sample: the CLIP tokens before the long text encoder's, where the model has them, plus
    max_sequence_length (the model's default where unset); an edit model adds the source image's vision tokens."""
    model = flow_model(folder)
    tokens = spec.model.max_sequence_length or model.default_text_tokens
    if edit_pipeline(folder):
        tokens += int((spec.data.resolution / model.edit_vision_patch_px) ** 2)
    return model.clip_tokens + tokens


def _activations(spec, folder, config: dict, clips) -> tuple[float, float]:
    """The model's measured constants over its image tokens (2x2 latent patches, 16 px; an edit model's source
    image's too) and its text tokens."""
    model = flow_model(folder)
    images = 2 if edit_pipeline(folder) else 1
    image_tokens = model.pad_tokens(images * (spec.data.resolution / 16) ** 2)
    sample = measured_sample_bytes(
        model.constants,
        model.shape(config),
        image_tokens,
        model.pad_tokens(text_tokens(spec, folder)),
        spec.train.precision,
    )
    return in_plan_units(sample, spec.train.precision)


def _cache_bytes(spec, folder, companions: dict, num_samples: int, clips) -> int:
    per_sample = image_latent_bytes(spec, folder, companions, 2 if edit_pipeline(folder) else 1)
    if folder.has("transformer"):
        config, model = folder.config("transformer"), flow_model(folder)
        stacked = config.get(model.text_layers_key, 1) if model.text_layers_key else 1  # layers per token
        width = config.get(model.text_width_key) * stacked
        per_sample += transformer_text_bytes(spec, folder, text_tokens(spec, folder), width)
    return per_sample * num_samples


def _trained(spec, folder) -> tuple:
    """The transformer trains. While samples render, the model's sampling-only parts (e.g. an unconditional
    transformer) load beside it, and with sample.pretrained (or a training adapter: the clean base) a second
    transformer (dstune.families.flow_distilled); the sample phase counts them."""
    module, _, expert = trains_denoiser("transformer")(spec, folder)
    sampling_only = {
        part: count_component(str(folder.path / part / "config.json"))[0] for part in flow_model(folder).sampling_parts
    }
    if spec.sample.prompts and (spec.sample.pretrained or getattr(spec.model, "training_adapter", None)):
        sampling = pipeline_folder(spec.sample.pretrained) if spec.sample.pretrained else folder
        sampling_only["transformer (samples)"] = count_component(str(sampling.path / "transformer" / "config.json"))[0]
    return module, sampling_only, expert


def samples_from_cached_text(folder) -> bool:
    """Whether the folder's samples render from cached prompt embeddings: its model's rows say so (an edit
    pipeline's prompts are encoded with their source image, never cached)."""
    return flow_model(folder).samples_from_cached_text and edit_pipeline(folder) is None


RULES = DenoiserRules(
    trained=_trained,
    activations=_activations,
    cache_bytes=_cache_bytes,
    samples_from_cached_text=samples_from_cached_text,
)


def _count(spec, num_samples: int, clips=()):
    return count_denoiser(spec, num_samples, clips, RULES)


def _side_issues(spec, model: FlowModel, folder) -> SpecIssues:
    """Image sides the model cannot take: FlowModel.side_px, or the VAE config's spatial factor x the latent rows a
    token packs (an 8x VAE and 2x2 patches: multiples of 16 px)."""
    side = model.side_px or vae_factor(folder.config("vae")) * model.token_patch
    return side_issues(spec, side, f"{model.name} takes image sides in multiples of {side} px")


def _spec_issues(spec) -> SpecIssues:
    return _edit_issues(spec) + _sample_folder_issues(spec) + _lora_format_issues(spec)


def _lora_format_issues(spec) -> SpecIssues:
    """A LoRA file format whose tool is not known to map this model's keys (the model's FlowModel.lora_formats)."""
    chosen = spec.output.lora_format
    try:
        model = flow_model(pipeline_folder(spec.model.pretrained))
    except (SizesUnknown, OSError, ValueError):
        return []
    if chosen is None or chosen in model.lora_formats:
        return []
    return [
        (
            "output.lora_format",
            f"{chosen!r} writes diffusers' key names, which {chosen}'s {model.name} loader is "
            f"not known to map; {model.name} LoRAs are written as {', '.join(model.lora_formats)} "
            f"({model.lora_loader}): remove output.lora_format or set it to diffusers",
        )
    ]


def _edit_issues(spec) -> SpecIssues:
    """An edit model (QwenImageEditPipeline) trains on pairs, cannot cache its text (an embedding belongs to a
    caption and its source image) and samples from source images (sample.control_images): said by validate, before
    any GPU time, rather than at startup or at the first sample. Whether the data gives pairs is validate's check
    (`pairs`)."""
    try:
        folder = pipeline_folder(spec.model.pretrained)
        edit = edit_pipeline(folder)
    except (SizesUnknown, OSError, ValueError):  # unknown here: startup checks the folder itself
        return []
    pipeline_class = folder.index.get("_class_name")
    if flow_model(folder).draws_sigma and spec.model.shift is not None:
        return [
            (
                "model.shift",
                f"{pipeline_class}'s training example draws sigma itself (logit-normal about a "
                "resolution-aware mean), with no scheduler table to shift: remove model.shift and move the "
                "draw with model.logit_mean / model.logit_std",
            )
        ]
    side_issues = _side_issues(spec, flow_model(folder), folder)
    if side_issues:
        return side_issues
    grid = folder.index.get("sample_sigmas")  # a distilled (Turbo) folder's own sampling sigmas
    if grid and spec.sample.prompts and spec.sample.steps != len(grid):
        return [
            (
                "sample.steps",
                f"{pipeline_class} samples this folder on its own {len(grid)} sigmas "
                f"(model_index.json sample_sigmas, a Turbo folder): set sample.steps: {len(grid)}",
            )
        ]
    if not edit:
        if spec.sample.control_images:
            return [
                (
                    "sample.control_images",
                    f"{pipeline_class} renders from the prompt alone: source images are for edit models; remove them",
                )
            ]
        return []
    issues = []
    if spec.data.cache.text_embeddings:
        issues.append(
            (
                "data.cache.text_embeddings",
                f"{pipeline_class} encodes each instruction together with its "
                "source image, so its text cannot be cached per caption: set it to false (data.cache.latents "
                "still caches the target and source latents)",
            )
        )
    if spec.sample.prompts and not spec.sample.control_images:
        issues.append(
            (
                "sample.prompts",
                f"{pipeline_class} renders from a source image: give sample.control_images, "
                "one source image per prompt, or set sample.prompts: []",
            )
        )
    missing = [path for path in spec.sample.control_images if not os.path.isfile(os.path.expanduser(path))]
    if missing:
        issues.append(("sample.control_images", f"{len(missing)} source image(s) do not exist: {', '.join(missing)}"))
    return issues


_CONFIG_BOOKKEEPING = ("_name_or_path", "_diffusers_version", "_class_name")


def sampling_folder_problems(trained_index: dict, trained: dict, other_index: dict, other: dict) -> list[str]:
    """Why a folder (model_index.json, transformer config) cannot render the LoRA trained on another: another
    pipeline or transformer class, or other shapes (any transformer config value but bookkeeping). Torch-free:
    validate asks it of sample.pretrained, startup again of the folders it loads."""
    problems = []
    if trained_index.get("_class_name") != other_index.get("_class_name"):
        problems.append(
            f"it is a {other_index.get('_class_name')} folder; the trained model is a "
            f"{trained_index.get('_class_name')}"
        )
    if trained.get("_class_name") != other.get("_class_name"):
        problems.append(
            f"its transformer is a {other.get('_class_name')}; the trained one a {trained.get('_class_name')}"
        )
        return problems
    differ = sorted(
        key
        for key in set(trained) | set(other)
        if key not in _CONFIG_BOOKKEEPING and trained.get(key) != other.get(key)
    )
    if differ:
        problems.append(
            "its transformer has other shapes: "
            + ", ".join(f"{key} {other.get(key)} (trained: {trained.get(key)})" for key in differ[:4])
        )
    return problems


def _sample_folder_issues(spec) -> SpecIssues:
    """sample.pretrained against model.pretrained, from their configs (found here: checked again at startup)."""
    if not spec.sample.pretrained:
        return []
    where = locate(spec.sample.pretrained)
    if where.kind == "unknown-builtin":
        return [("sample.pretrained", builtin_name_problem(spec.sample.pretrained))]
    if where.kind == "missing":
        return [
            (
                "sample.pretrained",
                f"{where.path} does not exist: give a pipeline folder of the trained model "
                "(its distilled checkpoint), a hub id in the local cache, or builtin:NAME",
            )
        ]
    try:
        trained, other = pipeline_folder(spec.model.pretrained), pipeline_folder(spec.sample.pretrained)
        problems = sampling_folder_problems(
            trained.index, trained.config("transformer"), other.index, other.config("transformer")
        )
    except (SizesUnknown, OSError, ValueError):
        return []
    return (
        [
            (
                "sample.pretrained",
                f"{spec.sample.pretrained} cannot render the LoRA trained on "
                f"{spec.model.pretrained}: " + "; ".join(problems),
            )
        ]
        if problems
        else []
    )


def _pairs(spec) -> Optional[str]:
    try:
        return edit_pipeline(pipeline_folder(spec.model.pretrained))
    except (SizesUnknown, OSError, ValueError):
        return None


def _attention(spec) -> Optional[Attention]:
    """The transformer's heads, its image tokens' geometry (the VAE config's spatial factor x the 2x2 latent patch
    a token packs) and the text tokens its context-parallel plan splits with the image's (a plan that splits both
    streams pads the text to max_sequence_length); a refusal for a transformer class without a
    context-parallel plan. An edit model's sequence holds the target's and the source's tokens; its text (the
    instruction with the source's vision tokens) has no fixed length: the split pads it with masked tokens
    (dstune.families.ulysses), so it sets no rule."""
    try:
        folder = pipeline_folder(spec.model.pretrained)
        model, config = flow_model(folder), folder.config("transformer")
        px_per_token = vae_factor(folder.config("vae")) * model.token_patch
    except (SizesUnknown, OSError, ValueError):
        return None
    origin = f"the transformer config of {folder.origin}"
    no_plan = no_plan_refusal(folder.index["transformer"][1])
    if no_plan:  # whatever its config says of heads, nothing can split it
        return Attention(0, 0, origin, no_plan)
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return None
    edit = edit_pipeline(folder) is not None
    return Attention(
        heads,
        config.get("attention_head_dim", 0),
        origin,
        text_tokens=0 if edit else text_tokens(spec, folder),
        px_per_token=px_per_token,
        pictures=2 if edit else 1,
    )


FACTS = ModelFacts(
    family="flow", modality="image", count=_count, spec_issues=_spec_issues, pairs=_pairs, attention=_attention
)
