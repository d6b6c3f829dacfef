"""The torch-free facts of the video family (`model.family` VIDEO_FAMILY): what validate, the memory plan and the video planner
know of a video folder without torch. What is common to the video models is here (two experts and the timesteps each
trains, the clip buckets, the latent cache, the sequence-parallel attention); what is a model's own comes from its
unit's `VideoFacts` (dstune.models.registry.video_facts), told by the folder's transformer class: its token factors,
activations, text and first-frame cache bytes, and its offline spec checks. dstune.families.facts describes the
contract.

Tokens of a clip: latent frames (1 + (frames - 1) / 4) x (H / s / ph) x (W / s / pw), with the VAE's spatial factor s
and the transformer's patch (pt, ph, pw) read from the model's configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Callable, Optional

from dstune.families.denoiser_facts import DenoiserRules, count_denoiser, latent_channels, pipeline_folder, side_issues
from dstune.families.facts import Attention, ModelFacts, SpecIssues, no_plan_refusal
from dstune.memory.counts import SizesUnknown, count_component
from dstune.models import registry
from dstune.models.unit import VIDEO_FAMILY, load
from dstune.spec.video_models import expert_problems, expert_range, expert_range_text, experts_in

# Where a model's configs are not here (a hub id not downloaded, no stored copy), tokens are estimated with the
# common video layout: an 8x VAE and 1x2x2 patches; validate says so where it prints them.
ASSUMED_SPATIAL, ASSUMED_PATCH = 8, (1, 2, 2)
TEMPORAL_COMPRESSION = 4  # the video VAEs: the first frame, then 4 frames per latent frame (frames are 4k+1)


@dataclass(frozen=True)
class VideoFacts:
    """What the video family's facts ask one video model (declared in its unit's facts.py)."""

    transformer_class: str  # the folder's transformer class that tells the model
    # folder -> (VAE spatial factor, transformer patch (t, h, w), VAE temporal factor, where they came from)
    token_factors: Callable
    sample_bytes: Callable  # (spec, folder, frames, width, height) -> one clip's activations (memory plan units)
    spec_issues: Callable  # (spec, folder) -> [(dotted key, message)]: the spec against the folder's configs
    image_to_video: Callable = lambda spec, folder: False  # (spec, folder) -> whether this run trains image-to-video
    text_bytes: Callable = lambda spec, folder: 0  # (spec, folder) -> one caption's cached text tensors, in bytes
    # (spec, folder, companions, channels, spatial factor, buckets, num_samples) -> the first-frame condition cache
    condition_cache_bytes: Callable = lambda *args: 0
    # (spec, folder, companions, num_samples, buckets) -> the whole cache's bytes, for a model whose VAE is not
    # 4x in time (then text_bytes and condition_cache_bytes are not asked)
    cache_bytes: Optional[Callable] = None
    sampling_parts: Callable = lambda folder: ()  # folder -> frozen parts loaded only while samples render
    # folder -> Attention, for a model whose sequence-parallel plan is dstune's (the transformer's own plan, or its
    # class without one, decides otherwise)
    attention: Optional[Callable] = None
    # its samples render from cached prompt embeddings (its recipe's Sampling.cached_text), so with the text cache
    # the text encoders load on one rank per node (dstune.families.denoiser_facts.text_once_per_node)
    samples_from_cached_text: bool = False


@cache
def _video_facts() -> dict[str, VideoFacts]:
    return {facts.transformer_class: facts for facts in map(load, registry.video_facts())}


def facts_of(folder) -> Optional[VideoFacts]:
    """The video model a pipeline folder (dstune.families.denoiser_facts.PipelineFolder) holds; None if no unit's."""
    return _video_facts().get((folder.index.get("transformer") or [None, None])[1])


def _known() -> str:
    return ", ".join(_video_facts())


def expert_summary(index: dict, expert: str, timestep_range) -> dict:
    """`memory.parameters.expert` of validate --json: the expert, its component and the timesteps it trains."""
    low, high, inclusive = expert_range(index, expert, timestep_range)
    return {
        "name": expert,
        "component": "transformer_2" if expert == "low_noise" else "transformer",
        "boundary_ratio": index["boundary_ratio"],
        "timesteps": [low, high],
        "max_included": inclusive,
        "text": expert_range_text(index, expert, timestep_range),
    }


def _trained(spec, folder):
    """The expert a two-expert folder trains (the other loads only while samples render), else the transformer
    (with the parts the model loads for samples only)."""
    if spec.model.expert is None or "transformer_2" not in experts_in(folder.index):
        facts = facts_of(folder)
        parts = facts.sampling_parts(folder) if facts is not None else ()
        return (
            "transformer",
            {part: count_component(str(folder.path / part / "config.json"))[0] for part in parts},
            None,
        )
    module, other = (
        ("transformer_2", "transformer") if spec.model.expert == "low_noise" else ("transformer", "transformer_2")
    )
    sampling_only = {other: count_component(str(folder.path / other / "config.json"))[0]}
    return module, sampling_only, expert_summary(folder.index, spec.model.expert, spec.model.timestep_range)


def _image_to_video(spec, folder) -> bool:
    facts = facts_of(folder)
    return facts is not None and facts.image_to_video(spec, folder)


def clip_buckets(spec, num_samples: int, clips) -> list[tuple[int, int, int, int]]:
    """The (frames, width, height, clips) buckets, or all clips at the longest count and the square."""
    side = spec.data.resolution
    return list(clips) or [(spec.data.video.max_frames, side, side, num_samples)]


def clip_volume(frames: int, width: int, height: int, *_) -> int:
    """Latent frames x pixels: what a clip's tokens and its cached latent grow with."""
    return (1 + (frames - 1) // TEMPORAL_COMPRESSION) * width * height


def _model_facts(folder) -> VideoFacts:
    facts = facts_of(folder)
    if facts is None:
        raise SizesUnknown(f"{folder.origin}: its transformer is none of the video models dstune trains ({_known()})")
    return facts


def _activations(spec, folder, config: dict, clips) -> tuple[float, float]:
    """The largest bucket's clip, as the model's facts count it."""
    frames, width, height, _ = max(clip_buckets(spec, 0, clips), key=lambda b: clip_volume(*b))
    return _model_facts(folder).sample_bytes(spec, folder, frames, width, height)


def _cache_bytes(spec, folder, companions: dict, num_samples: int, clips) -> int:
    """Each bucket's clips' posteriors (float32 mean and std), the first-frame condition, and the captions' text."""
    facts = _model_facts(folder)
    if facts.cache_bytes is not None:
        return facts.cache_bytes(spec, folder, companions, num_samples, clip_buckets(spec, num_samples, clips))
    latents = 0
    if spec.data.cache.latents and "vae" in companions:
        channels, factor = latent_channels(folder)
        buckets = clip_buckets(spec, num_samples, clips)
        latents = sum(2 * channels * clip_volume(f, w // factor, h // factor) * 4 * n for f, w, h, n in buckets)
        latents += facts.condition_cache_bytes(spec, folder, companions, channels, factor, buckets, num_samples)
    return facts.text_bytes(spec, folder) * num_samples + latents


def samples_from_cached_text(folder) -> bool:
    facts = facts_of(folder)
    return facts is not None and facts.samples_from_cached_text


RULES = DenoiserRules(
    trained=_trained,
    activations=_activations,
    cache_bytes=_cache_bytes,
    uses_image_encoder=_image_to_video,
    samples_from_cached_text=samples_from_cached_text,
)


def _count(spec, num_samples: int, clips=()):
    return count_denoiser(spec, num_samples, clips, RULES)


def token_factors(pretrained: str) -> tuple[int, tuple[int, int, int], int, str]:
    """(VAE spatial factor, transformer patch (t, h, w), VAE temporal factor, where they came from) of a video
    model's configs."""
    assumed = f"{ASSUMED_SPATIAL}x VAE, {'x'.join(map(str, ASSUMED_PATCH))} patches"
    try:
        folder = pipeline_folder(pretrained)
        folder.config("vae"), folder.config("transformer")
    except (SizesUnknown, OSError, ValueError):
        return (
            ASSUMED_SPATIAL,
            ASSUMED_PATCH,
            TEMPORAL_COMPRESSION,
            f"assumed ({assumed}): the model's configs are not here",
        )
    facts = facts_of(folder)
    if facts is None:  # model.pretrained is refused for it (spec_issues): its configs say nothing of a video model
        return (
            ASSUMED_SPATIAL,
            ASSUMED_PATCH,
            TEMPORAL_COMPRESSION,
            (f"assumed ({assumed}): {folder.origin} is none of the video models dstune trains"),
        )
    return facts.token_factors(folder)


def _spec_issues(spec) -> SpecIssues:
    """A video spec against its folder's own configs, before any GPU time (startup checks again): model.expert and
    model.timestep_range against model_index.json (two experts need an expert; a range stays on its expert's side
    of boundary_ratio), then the model's own checks; a folder no unit trains is refused with the list."""
    try:
        folder = pipeline_folder(spec.model.pretrained)
        index = folder.index
        folder.config("transformer"), folder.config("vae")
    except (SizesUnknown, OSError, ValueError):  # unknown here: startup checks the folder itself
        return []
    facts = facts_of(folder)
    if facts is None:
        transformer = (index.get("transformer") or [None, "none"])[1]
        return [
            (
                "model.pretrained",
                f"{spec.model.pretrained}: its transformer ({transformer}) is none of the video "
                f"models dstune trains ({_known()})",
            )
        ]
    issues = [
        (
            "model.timestep_range" if problem.startswith("model.timestep_range") else "model.expert",
            f"{spec.model.pretrained}: {problem}",
        )
        for problem in expert_problems(index, spec.model.expert, spec.model.timestep_range)
    ]
    spatial, patch, _, origin = facts.token_factors(folder)
    side = spatial * max(patch[1], patch[2])
    why = f"{spec.model.pretrained} takes clip sides in multiples of {side} px (its VAE's {spatial}x, then {patch[1]}x{patch[2]} patches)"
    return issues + side_issues(spec, side, why) + facts.spec_issues(spec, folder)


def _attention(spec):
    """The transformer's attention heads (what a sequence-parallel split must divide), None when its config is not
    here; a refusal for a transformer class without a context-parallel plan. Two experts have the same shape, so
    the high-noise one speaks for both."""
    try:
        folder = pipeline_folder(spec.model.pretrained)
        config = folder.config("transformer")
    except (SizesUnknown, OSError, ValueError):
        return None
    facts = facts_of(folder)
    if facts is not None and facts.attention is not None:  # its plan is dstune's
        return facts.attention(folder)
    origin = f"the transformer config of {folder.origin}"
    no_plan = no_plan_refusal((folder.index.get("transformer") or [None, "none"])[1])
    if no_plan:
        return Attention(0, 0, origin, no_plan)
    if not isinstance(config.get("num_attention_heads"), int):
        return None
    return Attention(config["num_attention_heads"], config.get("attention_head_dim", 0), origin)


FACTS = ModelFacts(
    family=VIDEO_FAMILY,
    modality="video",
    count=_count,
    spec_issues=_spec_issues,
    token_factors=token_factors,
    attention=_attention,
)
