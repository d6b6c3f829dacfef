"""What the diffusers pipeline models share in their torch-free facts: a pipeline folder whose denoiser DeepSpeed
trains beside frozen companions (VAE, text encoders, an image encoder), counted from its configs.

    count_denoiser(spec, num_samples, clips, card) -> ModelCounts

The model's card answers what differs (`DenoiserFacts`): which component trains (a two-expert folder trains one of
two), whether the image encoder is used, one sample's activations and the encoder caches' bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from dstune.families.folders import class_entries, index_path
from dstune.memory.activations import figure
from dstune.memory.plan import ModelCounts
from dstune.memory.counts import (
    SizesUnknown,
    config_folder,
    count_component,
    count_linear_weights,
    count_small_tensors,
    read_config,
    vae_factor,
)
from dstune.memory.working import MAX_CHUNK_ENTRIES, TextWork, VaeWork, text_bytes, text_part, vae_bytes
from dstune.spec.model_sections import DEFAULT_LORA_TARGET_MODULES

# "connectors": a stage after the text encoder (a pipeline's text connectors), frozen; the text cache holds its outputs
FROZEN_PIPELINE_PARTS = (
    "vae",
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "image_encoder",
    "connectors",
    "audio_vae",
)
# the parts whose outputs data.cache.latents stores (a video model's first-frame embedding, a clip's sound latents)
LATENT_PARTS = ("vae", "image_encoder", "audio_vae")
# the parts whose outputs data.cache.text_embeddings stores: loaded once per node where text_once_per_node allows
TEXT_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "connectors")


def text_once_per_node(spec, samples_from_cached_text: bool) -> Optional[str]:
    """None when the run loads its text encoders on one rank per node only (local rank 0), which encodes the text
    cache's entries and drops them once the cache is complete; otherwise why every rank loads them. After the
    cache nothing on the other ranks reads a caption's text: training reads the cached tensors, and samples read
    their prompts' (cached as entries too) where the model's sampling takes embeddings (`samples_from_cached_text`).
    The rule of both the start-up (dstune.startup) and the memory plan."""
    cache = spec.data.cache
    if not cache.text_embeddings:
        return "data.cache.text_embeddings is off: every rank encodes its captions"
    if "{rank}" in (cache.dir or ""):
        return "data.cache.dir has {rank}: each rank builds a cache folder of its own"
    if spec.data.eval is not None:
        return "data.eval encodes the held-out captions on every rank"
    if spec.sample.prompts and not samples_from_cached_text:
        return "sample.prompts: this model's samples encode their prompts on every rank"
    return None


@dataclass(frozen=True)
class PipelineFolder:
    """A pipeline folder's configs as the facts read them (JSON only)."""

    path: Path
    origin: str  # where the configs came from (dstune.memory.counts.config_folder)
    index: dict  # model_index.json

    def config(self, component: str) -> dict:
        return read_config(self.path / component / "config.json")

    def has(self, component: str) -> bool:
        return (self.path / component / "config.json").exists()


class DenoiserFacts(Protocol):
    """What count_denoiser asks a model's card (dstune.families.flow_card, video_card, the UNet families' cards)."""

    text_once: bool  # its start-up can load the text encoders on one rank per node (False: every rank, always)

    @property
    def samples_from_cached_text(self) -> bool: ...  # its samples render from the prompts' cached text

    def trained(self, spec, folder: "PipelineFolder") -> tuple:
        """(the trained component, {frozen component loaded only for samples: params}, the expert summary of
        validate --json or None)"""

    def activation_bytes(self, spec, folder: "PipelineFolder", config: dict, clips) -> tuple[float, float]:
        """one sample's activation bytes (full, checkpointed), the denoiser's config given"""

    def cache_bytes(self, spec, folder: "PipelineFolder", companions: dict, num_samples: int, clips) -> int:
        """the encoder caches' bytes on disk"""

    def uses_image_encoder(self, spec, folder: "PipelineFolder") -> bool:
        """whether the run loads the folder's image encoder (image-to-video)"""

    # the encoders' working memory (dstune.memory.working; dstune.families.pipeline_card.PipelineCard)
    working: dict
    guidance_batch: int

    def geometry(self, spec, folder: "PipelineFolder", clips): ...

    def encoder_tokens(self, spec, folder: "PipelineFolder") -> dict: ...

    def hidden_states_read(self, folder: "PipelineFolder") -> dict: ...


def pipeline_folder(pretrained: str) -> PipelineFolder:
    path, origin = config_folder(pretrained)
    return PipelineFolder(path, origin, class_entries(read_config(index_path(path))))


def lora_settings(spec) -> tuple[tuple, int]:
    settings = spec.model.lora_settings
    return (tuple(settings.target_modules), settings.rank) if settings else ((), 0)


def count_denoiser(spec, num_samples: int, clips, card: DenoiserFacts) -> ModelCounts:
    """The denoiser, its companions, one sample's activations and the cache size of a pipeline folder's run."""
    folder = pipeline_folder(spec.model.pretrained)
    module, sampling_only, expert = card.trained(spec, folder)
    targets, rank = lora_settings(spec)
    config_path = folder.path / module / "config.json"
    params, largest, lora = count_component(str(config_path), targets, rank)
    default_lora = count_component(str(config_path), DEFAULT_LORA_TARGET_MODULES, 16)[2]
    companions = {
        part: count_component(str(folder.path / part / "config.json"))[0]
        for part in FROZEN_PIPELINE_PARTS
        if (folder.index.get(part) or [None])[0]
    }
    cache = spec.data.cache
    if not card.uses_image_encoder(spec, folder):  # e.g. a text-to-video run of an image-to-video-capable folder
        companions.pop("image_encoder", None)
    # the image encoder's embeddings (first-frame conditioning) and the sound latents are stored beside the latents
    cached = tuple(part for part in companions if (cache.latents if part in LATENT_PARTS else cache.text_embeddings))
    full, checkpointed = card.activation_bytes(spec, folder, read_config(config_path), clips)
    with figure("offload"):  # what model.activation_offload moves to the host, and the one block it brings back
        offloaded, one_block = card.activation_bytes(spec, folder, read_config(config_path), clips)
    # a family without the rule loads them on every rank, with nothing to say about it (no spec key changes it)
    why_every_rank = text_once_per_node(spec, card.samples_from_cached_text) if card.text_once else ""
    text_parts = tuple(part for part in companions if part in TEXT_PARTS)
    # model.text_encoder_offload holds one module's own parameters at a time: the largest over the text encoders
    text_layer = max((count_component(str(folder.path / part / "config.json"))[1] for part in text_parts), default=0)
    return ModelCounts(
        module,
        params,
        lora or params,
        largest,
        companions,
        cached,
        int(full),
        int(checkpointed),
        default_lora,
        card.cache_bytes(spec, folder, companions, num_samples, clips),
        folder.origin,
        builds_partitioned=True,  # every pipeline family builds the denoiser partitioned under ZeRO-3
        sampling_companions=sampling_only,
        expert=expert,
        small_tensors=count_small_tensors(str(config_path), targets, rank),
        linear_weights=count_linear_weights(str(config_path)),
        once_per_node=text_parts if card.text_once and why_every_rank is None else (),
        text_on_every_rank=why_every_rank if text_parts and why_every_rank else "",
        offloaded_sample_bytes=int(max(min(offloaded, checkpointed), 0.0)),
        offload_block_bytes=int(max(min(one_block, offloaded), 0.0)),
        text_offload_layer_params=text_layer,
        **working_counts(spec, folder, companions, card, read_config(config_path), clips),
    )


def _work(works: dict, folder: PipelineFolder, part: str, kind: type):
    """The card's measured constants for the class of `part`; SizesUnknown naming the class when it has none."""
    name = (folder.index.get(part) or [None, None])[1]
    work = works.get(name)
    if not isinstance(work, kind):
        raise SizesUnknown(
            f"{folder.origin}: no measured working memory for its {part} ({name}); the model's card declares "
            f"{', '.join(works) or 'none'} (bench/working_memory.py measures a class)"
        )
    return work


def _in_bytes(plan_units: float, precision: str) -> float:
    """dstune.memory.plan's activation units (2 bytes per element, doubled for fp32) as bytes."""
    return plan_units * (2 if precision == "fp32" else 1)


def working_counts(spec, folder: PipelineFolder, companions: dict, card: DenoiserFacts, config: dict, clips) -> dict:
    """ModelCounts' working-memory fields of a pipeline folder's run: the VAE's encode of one cache entry and decode
    of one sample (plain and, where the VAE tiles, tiled), the largest text encoder's pass over one caption (with the
    hidden states its pipeline reads), one sampling forward and the backward's transients."""
    works, precision = card.working, spec.train.precision
    geometry = card.geometry(spec, folder, clips)
    counts: dict = {"samples_per_call": geometry.samples_per_call}
    if "vae" in companions:
        work, vae = _work(works, folder, "vae", VaeWork), folder.config("vae")
        for name, decode, size, tokens in (
            ("encode_entry", False, geometry.entry, geometry.entry_tokens),
            ("decode_sample", True, geometry.sample, geometry.sample_tokens),
        ):
            counts[f"{name}_bytes"] = int(vae_bytes(work, vae, decode, *size, tokens, False, precision))
            if work.tile_px:
                counts[f"{name}_tiled_bytes"] = int(vae_bytes(work, vae, decode, *size, tokens, True, precision))
    tokens, states = card.encoder_tokens(spec, folder), card.hidden_states_read(folder)
    passes = []  # (per caption, once a pass) of each text encoder: they run one after another
    for part in companions:
        if text_part(part) and part != "connectors":
            work, encoder = _work(works, folder, part, TextWork), folder.config(part)
            length, kept = _positions(encoder, tokens.get(part, 0)), len(states.get(part, (-1,)))
            once = text_bytes(work, encoder, length, kept, precision, captions=0)
            passes.append((text_bytes(work, encoder, length, kept, precision) - once, once))
    per_caption, once = max(passes, key=lambda p: MAX_CHUNK_ENTRIES * p[0] + p[1], default=(0.0, 0.0))
    counts["text_entry_bytes"], counts["text_pass_bytes"] = int(per_caption), int(once)
    with figure("forward"):  # one sample's; guidance's second half beside it where the pipeline batches them
        forward = _in_bytes(card.activation_bytes(spec, folder, config, [(*geometry.sample, 1)])[1], precision)
    counts["sample_forward_bytes"] = int(forward * card.guidance_batch)
    with figure("transients"):
        full, checkpointed = card.activation_bytes(spec, folder, config, clips)
    step = checkpointed if getattr(spec.model, "gradient_checkpointing", False) else full
    counts["transient_sample_bytes"] = int(_in_bytes(step, precision))
    return counts


def _positions(config: dict, tokens: int) -> int:
    """A caption's tokens as an encoder takes them: at most its positions (CLIP's 77)."""
    limit = (config.get("text_config") or config).get("max_position_embeddings")
    return min(tokens, limit) if limit else tokens


def side_issues(spec, side: int, why: str) -> list[tuple[str, str]]:
    """data.resolution (or the bucket step or sizes) against the `side` in pixels every image or clip side must be a
    multiple of (the VAE's spatial factor x the patch a token packs; `why` says so), before any GPU time: otherwise
    the first batch is refused on every rank (FlowModel's latent check) after the whole start-up. With data.sets,
    each set's own resolution and buckets, at the set's key."""
    issues = _data_side_issues(spec.data, side, why)
    for number, (item, one) in enumerate(zip(spec.data.sets or (), spec.data.set_specs())):
        for key, text in _data_side_issues(one, side, why):
            own = key.split(".")[1] in item.model_fields_set and getattr(item, key.split(".")[1]) is not None
            if own:
                issues.append((key.replace("data.", f"data.sets.{number}.", 1), text))
    return issues


def _data_side_issues(data, side: int, why: str) -> list[tuple[str, str]]:
    buckets = data.buckets
    if not buckets.enabled:
        if data.resolution % side == 0:
            return []
        return [("data.resolution", f"{data.resolution}: {why}; use {max(side, data.resolution // side * side)}")]
    if buckets.sizes:
        wrong = [list(size) for size in buckets.sizes if size[0] % side or size[1] % side]
        return [("data.buckets.sizes", f"{wrong}: {why}")] if wrong else []
    # generated buckets have sides in multiples of the step
    return [("data.buckets.step", f"{buckets.step}: {why}; use a multiple of {side}")] if buckets.step % side else []


def latent_channels(folder: PipelineFolder) -> tuple[int, int]:
    """(latent channels, spatial factor) of the folder's VAE."""
    vae = folder.config("vae")
    return vae.get("latent_channels") or vae.get("z_dim", 4), vae_factor(vae)


def image_latent_bytes(spec, folder: PipelineFolder, companions: dict, pictures: float = 1) -> int:
    """One sample's cached VAE posterior (mean and std, float32) at data.resolution's square; `pictures`: 2 for an
    edit model (the source's latents too), in target areas (FlowCard.picture_areas). 0 without
    data.cache.latents."""
    if not (spec.data.cache.latents and "vae" in companions):
        return 0
    channels, factor = latent_channels(folder)
    side = spec.data.resolution // factor
    return round(pictures * 2 * channels * side**2 * 4)


def embedding_width_bytes(spec) -> int:
    """Bytes per cached embedding element: the frozen parts' dtype (2 under mixed precision)."""
    return 2 if spec.train.precision in ("bf16", "fp16") else 4


def transformer_text_bytes(spec, folder: PipelineFolder, tokens: int, text_width: Optional[int]) -> int:
    """One caption's cached text for a transformer denoiser: `tokens` x the width it reads, plus a pooled vector."""
    if not spec.data.cache.text_embeddings or not folder.has("transformer"):
        return 0
    pooled = folder.config("transformer").get("pooled_projection_dim", 0)
    return (tokens * (text_width or 0) + pooled) * embedding_width_bytes(spec)
