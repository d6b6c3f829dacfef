"""The torch-free facts of Wan 2.1 / 2.2 folders (text-to-video, image-to-video, TI2V, two experts) for the video
family's facts (dstune.families.video_facts): its folder's layout (dstune.models.wan.layouts), tokens per clip,
activations and cache bytes, and its offline spec checks.

Tokens of a clip: latent frames (1 + (frames - 1) / 4) x (H / s / ph) x (W / s / pw), with the VAE's spatial factor s
(2 ** its temporal-downsample stages: 8, or Wan 2.2's 16) and the transformer's patch (pt, ph, pw) from the configs.
"""

from __future__ import annotations

from dstune.families.denoiser_facts import embedding_width_bytes, latent_channels, transformer_text_bytes
from dstune.families.video_facts import VideoFacts, clip_volume
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes
from dstune.memory.counts import vae_factor
from dstune.models.wan import layouts as wan_layouts

TRANSFORMER_CLASS = "WanTransformer3DModel"
DEFAULT_TEXT_TOKENS = 512  # umT5's max_sequence_length in WanPipeline
# Wan 2.1 I2V's cross-attention (diffusers' WanAttnProcessor) takes all but the last 512 context tokens as the image
# embedding's: its text must be exactly this long, or the image tokens are read as text and the image projections
# (add_k_proj, add_v_proj) get no gradient
IMAGE_EMBEDDING_TEXT_TOKENS = 512


def clip_tokens(config: dict, resolution, frames: int, vae_factor: int = 8) -> float:
    """A Wan transformer's tokens over one clip of `resolution` (a square side, or a bucket's (width, height)):
    (1 + (frames - 1) / 4) latent frames x (height / 16) x (width / 16) (the VAE's 8x spatial and 4x temporal
    compression, then 1x2x2 patches; Wan 2.2's 16x VAE: / 32), so they grow with frames x height x width."""
    patch = config.get("patch_size", [1, 2, 2])
    width, height = (resolution, resolution) if isinstance(resolution, int) else resolution
    return (1 + (frames - 1) // 4) / patch[0] * (height / (vae_factor * patch[1])) * (width / (vae_factor * patch[2]))


def constants_key(config: dict, index: dict) -> str:
    """Which measured Wan block the transformer has: Wan 2.1 image-to-video's (the image's own key/value
    projections in the cross-attention), TI2V's (a timestep, so a modulation, per token), or text-to-video's (Wan
    2.2 A14B image-to-video too: its condition channels only widen the patch embedding)."""
    if config.get("added_kv_proj_dim"):
        return "wan-i2v"
    return "wan-ti2v" if index.get("expand_timesteps") else "wan-t2v"


def sample_bytes(
    config: dict,
    index: dict,
    resolution,
    frames: int,
    context_tokens: int,
    vae_factor: int = 8,
    precision: str = "bf16",
) -> tuple[float, float]:
    """One clip's activation bytes (dstune.memory.plan's 2-byte units) from the measured constants of the
    transformer's block, at its width, ffn_dim and num_layers; `context_tokens`: the cross-attention context
    (Wan 2.1 I2V: the text and the image embedding's tokens)."""
    shape = ModelShape(
        config["num_attention_heads"] * config["attention_head_dim"],
        {"blocks": config["num_layers"]},
        ffn=config.get("ffn_dim", 0),
    )
    sample = measured_sample_bytes(
        constants_key(config, index),
        shape,
        clip_tokens(config, resolution, frames, vae_factor),
        context_tokens,
        precision,
    )
    return in_plan_units(sample, precision)


def _image_to_video(spec, folder) -> bool:
    """Whether the spec trains image-to-video on this folder (dstune.models.wan.layouts); False for folders whose
    channels fit no Wan layout (startup says why)."""
    kind, _ = wan_layouts.layout(folder.index, folder.config("transformer"), folder.config("vae"))
    return kind is not None and wan_layouts.image_to_video(kind, spec.model.image_to_video)[0]


def _image_tokens(folder) -> int:
    """Wan 2.1 I2V's image embedding in the cross-attention context: the CLIP vision tower's patches and class
    token (257 for ViT-H/14 at 224 px)."""
    config = folder.config("image_encoder")
    return (config.get("image_size", 224) // config.get("patch_size", 14)) ** 2 + 1


def _text_tokens(spec) -> int:
    return spec.model.max_sequence_length or DEFAULT_TEXT_TOKENS


def _clip_activations(spec, folder, frames: int, width: int, height: int) -> tuple[float, float]:
    """One clip's activations; the context holds the text and, for Wan 2.1 I2V, the image embedding's tokens."""
    with_encoder = (folder.index.get("image_encoder") or [None])[0] and _image_to_video(spec, folder)
    context = _text_tokens(spec) + (_image_tokens(folder) if with_encoder else 0)
    _, factor = latent_channels(folder)
    return sample_bytes(
        folder.config("transformer"), folder.index, (width, height), frames, context, factor, spec.train.precision
    )


def _text_bytes(spec, folder) -> int:
    width = folder.config("transformer").get("text_dim", 0) if folder.has("transformer") else 0
    return transformer_text_bytes(spec, folder, _text_tokens(spec), width)


def _condition_cache_bytes(spec, folder, companions: dict, channels: int, factor: int, buckets, num_samples) -> int:
    """Image-to-video's cached condition (dstune.models.wan.i2v): its latent mode in float32 (TI2V: one latent
    frame), and Wan 2.1 I2V's first-frame CLIP hidden states in the frozen parts' dtype, summed over the buckets."""
    if not _image_to_video(spec, folder):
        return 0
    total = 0
    for frames, clip_width, clip_height, count in buckets:
        frames = 1 if folder.index.get("expand_timesteps") else frames
        total += channels * clip_volume(frames, clip_width // factor, clip_height // factor) * 4 * count
    if "image_encoder" in companions:
        hidden = folder.config("image_encoder").get("hidden_size", 0)
        total += _image_tokens(folder) * hidden * embedding_width_bytes(spec) * sum(count for *_, count in buckets)
    return total


def _token_factors(folder) -> tuple[int, tuple[int, int, int], int, str]:
    """(VAE spatial factor, transformer patch (t, h, w), VAE temporal factor (4), where they came from) of a Wan
    folder's configs: a spatial halving per downsampling stage, times the VAE's own pixel patches where it has them
    (Wan 2.2's 16x VAE: 8x stages, then 2x2)."""
    patch = folder.config("transformer").get("patch_size", [1, 2, 2])
    return vae_factor(folder.config("vae")), tuple(patch), 4, f"the VAE and transformer configs of {folder.origin}"


def _spec_issues(spec, folder) -> list[tuple[str, str]]:
    """The folder's layout against model.image_to_video, and image-to-video samples' first frames
    (dstune.models.wan.layouts); the text length a transformer that reads an image embedding needs."""
    config = folder.config("transformer")
    problems = wan_layouts.spec_problems(
        folder.index, config, folder.config("vae"), spec.model.image_to_video, spec.sample
    )
    tokens = spec.model.max_sequence_length
    if config.get("added_kv_proj_dim") and tokens not in (None, IMAGE_EMBEDDING_TEXT_TOKENS):
        problems.append(
            (
                "model.max_sequence_length",
                f"{tokens}: a Wan 2.1 image-to-video transformer takes all but the last "
                f"{IMAGE_EMBEDDING_TEXT_TOKENS} context tokens as the image embedding's (diffusers' WanAttnProcessor), "
                f"so its text must be {IMAGE_EMBEDDING_TEXT_TOKENS} tokens; with {tokens} the image embedding would be "
                f"read as text. Remove model.max_sequence_length (or set it to {IMAGE_EMBEDDING_TEXT_TOKENS})",
            )
        )
    return problems


VIDEO_FACTS = VideoFacts(
    transformer_class=TRANSFORMER_CLASS,
    samples_from_cached_text=True,  # its recipe's Sampling.cached_text
    token_factors=_token_factors,
    image_to_video=_image_to_video,
    sample_bytes=_clip_activations,
    text_bytes=_text_bytes,
    condition_cache_bytes=_condition_cache_bytes,
    spec_issues=_spec_issues,
)
