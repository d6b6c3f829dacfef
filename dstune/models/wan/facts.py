"""The torch-free facts of the wan family (Wan 2.1 / 2.2: text-to-video, image-to-video, TI2V, two experts; a
HunyuanVideo 1.5 folder's are dstune.models.hunyuan_video15.facts, told by its transformer class): its folder's layout
(dstune.models.wan.layouts), which expert trains over which timesteps (dstune.spec.video_models), tokens per clip,
activations and cache bytes; dstune.families.facts describes the contract.

Tokens of a clip: latent frames (1 + (frames - 1) / 4) x (H / s / ph) x (W / s / pw), with the VAE's spatial factor s
and the transformer's patch (pt, ph, pw) read from the model's configs (Wan's 8 and (1, 2, 2) when they are not here).
"""

from __future__ import annotations

from dstune.models.wan import layouts as wan_layouts
from dstune.models.hunyuan_video15 import facts as hunyuan15_facts
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes
from dstune.families.denoiser_facts import (DenoiserRules, count_denoiser, embedding_width_bytes, latent_channels,
                                            pipeline_folder, transformer_text_bytes)
from dstune.families.facts import Attention, ModelFacts, SpecIssues, no_plan_refusal
from dstune.memory.counts import SizesUnknown, count_component
from dstune.spec.video_models import expert_problems, expert_range, expert_range_text, experts_in

WAN_SPATIAL, WAN_PATCH = 8, (1, 2, 2)
TEMPORAL_COMPRESSION = 4  # the Wan VAE: the first frame, then 4 frames per latent frame (frames are 4k+1)
DEFAULT_TEXT_TOKENS = 512  # umT5's max_sequence_length in WanPipeline


def clip_tokens(config: dict, resolution, frames: int, vae_factor: int = 8) -> float:
    """A Wan transformer's tokens over one clip of `resolution` (a square side, or a bucket's (width, height)):
    (1 + (frames - 1) / 4) latent frames x (height / 16) x (width / 16) (the VAE's 8x spatial and 4x temporal
    compression, then 1x2x2 patches; Wan 2.2's 16x VAE: / 32), so they grow with frames x height x width."""
    patch = config.get("patch_size", [1, 2, 2])
    width, height = (resolution, resolution) if isinstance(resolution, int) else resolution
    return (1 + (frames - 1) // 4) / patch[0] * (height / (vae_factor * patch[1])) * \
        (width / (vae_factor * patch[2]))


def constants_key(config: dict, index: dict) -> str:
    """Which measured Wan block the transformer has: Wan 2.1 image-to-video's (the image's own key/value
    projections in the cross-attention), TI2V's (a timestep, so a modulation, per token), or text-to-video's (Wan
    2.2 A14B image-to-video too: its condition channels only widen the patch embedding)."""
    if config.get("added_kv_proj_dim"):
        return "wan-i2v"
    return "wan-ti2v" if index.get("expand_timesteps") else "wan-t2v"


def sample_bytes(config: dict, index: dict, resolution, frames: int, context_tokens: int, vae_factor: int = 8,
                 precision: str = "bf16") -> tuple[float, float]:
    """One clip's activation bytes (dstune.memory.plan's 2-byte units) from the measured constants of the
    transformer's block, at its width, ffn_dim and num_layers; `context_tokens`: the cross-attention context
    (Wan 2.1 I2V: the text and the image embedding's tokens)."""
    shape = ModelShape(config["num_attention_heads"] * config["attention_head_dim"], {"blocks": config["num_layers"]},
                       ffn=config.get("ffn_dim", 0))
    sample = measured_sample_bytes(constants_key(config, index), shape,
                                   clip_tokens(config, resolution, frames, vae_factor), context_tokens, precision)
    return in_plan_units(sample, precision)


def expert_summary(index: dict, expert: str, timestep_range) -> dict:
    """`memory.parameters.expert` of validate --json: the expert, its component and the timesteps it trains."""
    low, high, inclusive = expert_range(index, expert, timestep_range)
    return {"name": expert, "component": "transformer_2" if expert == "low_noise" else "transformer",
            "boundary_ratio": index["boundary_ratio"], "timesteps": [low, high], "max_included": inclusive,
            "text": expert_range_text(index, expert, timestep_range)}


def _trained(spec, folder):
    """The expert a two-expert folder trains (the other loads only while samples render), else the transformer."""
    if spec.model.expert is None or "transformer_2" not in experts_in(folder.index):
        return "transformer", {}, None
    module, other = ("transformer_2", "transformer") if spec.model.expert == "low_noise" else \
        ("transformer", "transformer_2")
    sampling_only = {other: count_component(str(folder.path / other / "config.json"))[0]}
    return module, sampling_only, expert_summary(folder.index, spec.model.expert, spec.model.timestep_range)


def _image_to_video(spec, folder) -> bool:
    """Whether the spec trains image-to-video on this folder (dstune.models.wan.layouts); False for folders whose channels
    fit no Wan layout (startup says why)."""
    if hunyuan15_facts.is_hunyuan15(folder):
        return hunyuan15_facts.image_to_video(folder) and spec.model.image_to_video is not False
    kind, _ = wan_layouts.layout(folder.index, folder.config("transformer"), folder.config("vae"))
    return kind is not None and wan_layouts.image_to_video(kind, spec.model.image_to_video)[0]


def _image_tokens(folder) -> int:
    """Wan 2.1 I2V's image embedding in the cross-attention context: the CLIP vision tower's patches and class
    token (257 for ViT-H/14 at 224 px)."""
    config = folder.config("image_encoder")
    return (config.get("image_size", 224) // config.get("patch_size", 14)) ** 2 + 1


def _text_tokens(spec) -> int:
    return spec.model.max_sequence_length or DEFAULT_TEXT_TOKENS


def clip_buckets(spec, num_samples: int, clips) -> list[tuple[int, int, int, int]]:
    """The (frames, width, height, clips) buckets, or all clips at the longest count and the square."""
    side = spec.data.resolution
    return list(clips) or [(spec.data.video.max_frames, side, side, num_samples)]


def clip_volume(frames: int, width: int, height: int, *_) -> int:
    """Latent frames x pixels: what a clip's tokens and its cached latent grow with."""
    return (1 + (frames - 1) // TEMPORAL_COMPRESSION) * width * height


def _activations(spec, folder, config: dict, clips) -> tuple[float, float]:
    """The largest bucket's clip; the context holds the text and, for Wan 2.1 I2V, the image embedding's tokens."""
    if hunyuan15_facts.is_hunyuan15(folder):
        frames, width, height, _ = max(clip_buckets(spec, 0, clips), key=lambda b: clip_volume(*b))
        return hunyuan15_facts.sample_bytes(spec, folder, frames, width, height)
    with_encoder = (folder.index.get("image_encoder") or [None])[0] and _image_to_video(spec, folder)
    context = _text_tokens(spec) + (_image_tokens(folder) if with_encoder else 0)
    frames, width, height, _ = max(clip_buckets(spec, 0, clips), key=lambda b: clip_volume(*b))
    _, factor = latent_channels(folder)
    return sample_bytes(config, folder.index, (width, height), frames, context, factor, spec.train.precision)


def _cache_bytes(spec, folder, companions: dict, num_samples: int, clips) -> int:
    """Each bucket's clips' posteriors (float32 mean and std), image-to-video's condition, and the captions' text."""
    latents = 0
    if spec.data.cache.latents and "vae" in companions:
        channels, factor = latent_channels(folder)
        buckets = clip_buckets(spec, num_samples, clips)
        latents = sum(2 * channels * clip_volume(f, w // factor, h // factor) * 4 * n for f, w, h, n in buckets)
        latents += _condition_cache_bytes(spec, folder, companions, channels, factor, buckets)
    if hunyuan15_facts.is_hunyuan15(folder):
        per_sample = sum(transformer_text_bytes(spec, folder, tokens, width)
                         for tokens, width in hunyuan15_facts.text_tokens_and_width(spec, folder))
        return per_sample * num_samples + latents + hunyuan15_facts.image_cache_bytes(spec, folder, num_samples)
    width = folder.config("transformer").get("text_dim", 0) if folder.has("transformer") else 0
    per_sample = transformer_text_bytes(spec, folder, _text_tokens(spec), width)
    return per_sample * num_samples + latents


def _condition_cache_bytes(spec, folder, companions: dict, channels: int, factor: int, buckets) -> int:
    """Image-to-video's cached condition (dstune.models.wan.i2v): its latent mode in float32 (TI2V: one latent
    frame), and Wan 2.1 I2V's first-frame CLIP hidden states in the frozen parts' dtype, summed over the buckets."""
    if not _image_to_video(spec, folder) or hunyuan15_facts.is_hunyuan15(folder):  # its extra: image_cache_bytes
        return 0
    total = 0
    for frames, clip_width, clip_height, count in buckets:
        frames = 1 if folder.index.get("expand_timesteps") else frames
        total += channels * clip_volume(frames, clip_width // factor, clip_height // factor) * 4 * count
    if "image_encoder" in companions:
        hidden = folder.config("image_encoder").get("hidden_size", 0)
        total += _image_tokens(folder) * hidden * embedding_width_bytes(spec) * sum(count for *_, count in buckets)
    return total


RULES = DenoiserRules(trained=_trained, activations=_activations, cache_bytes=_cache_bytes,
                      uses_image_encoder=_image_to_video)


def _count(spec, num_samples: int, clips=()):
    return count_denoiser(spec, num_samples, clips, RULES)


def token_factors(pretrained: str) -> tuple[int, tuple[int, int, int], str]:
    """(VAE spatial factor, transformer patch (t, h, w), where they came from) of a Wan model's configs."""
    try:
        folder = pipeline_folder(pretrained)
        vae, transformer = folder.config("vae"), folder.config("transformer")
    except (SizesUnknown, OSError, ValueError):
        return WAN_SPATIAL, WAN_PATCH, "Wan's factors (8x VAE, 1x2x2 patches): the model's configs are not here"
    if hunyuan15_facts.is_hunyuan15(folder):
        return hunyuan15_facts.token_factors(folder)
    downsample, patch = vae.get("temperal_downsample"), transformer.get("patch_size")
    wan_like = isinstance(downsample, list) and isinstance(patch, list) and len(patch) == 3 and all(
        isinstance(side, int) and side > 0 for side in patch)
    if not wan_like:  # another model's folder (model.pretrained is refused for it): its configs say nothing of Wan's
        return WAN_SPATIAL, WAN_PATCH, f"Wan's factors (8x VAE, 1x2x2 patches): {folder.origin} is not a Wan model"
    return 2 ** len(downsample), tuple(patch), f"the VAE and transformer configs of {folder.origin}"


def _spec_issues(spec) -> SpecIssues:
    """A Wan spec against its folder's own configs, before any GPU time (startup checks again): model.expert and
    model.timestep_range against model_index.json (two experts need an expert; a range stays on its expert's side
    of boundary_ratio), the folder's layout against model.image_to_video, and image-to-video samples' first frames
    (dstune.models.wan.layouts)."""
    try:
        folder = pipeline_folder(spec.model.pretrained)
        configs = [folder.index, folder.config("transformer"), folder.config("vae")]
    except (SizesUnknown, OSError, ValueError):  # unknown here: startup checks the folder itself
        return []
    issues = [("model.timestep_range" if problem.startswith("model.timestep_range") else "model.expert",
               f"{spec.model.pretrained}: {problem}")
              for problem in expert_problems(configs[0], spec.model.expert, spec.model.timestep_range)]
    if hunyuan15_facts.is_hunyuan15(folder):
        return issues + hunyuan15_facts.spec_issues(spec, folder)
    return issues + wan_layouts.spec_problems(*configs, spec.model.image_to_video, spec.sample)


def _attention(spec):
    """The transformer's attention heads (what a sequence-parallel split must divide), None when its config is not
    here; a refusal for a transformer class without a context-parallel plan (HunyuanVideo 1.5). Wan 2.2 A14B's two
    experts have the same shape, so the high-noise one speaks for both."""
    try:
        folder = pipeline_folder(spec.model.pretrained)
        config = folder.config("transformer")
    except (SizesUnknown, OSError, ValueError):
        return None
    origin = f"the transformer config of {folder.origin}"
    no_plan = no_plan_refusal((folder.index.get("transformer") or [None, "none"])[1])
    if no_plan:
        return Attention(0, 0, origin, no_plan)
    if not isinstance(config.get("num_attention_heads"), int):
        return None
    return Attention(config["num_attention_heads"], config.get("attention_head_dim", 0), origin)


FACTS = ModelFacts(family="wan", modality="video", count=_count, spec_issues=_spec_issues,
                   token_factors=token_factors, attention=_attention)
