"""The torch-free facts of HunyuanVideo 1.5 folders for the video family's facts (dstune.families.video_facts asks
them for a folder whose transformer is HunyuanVideo15Transformer3DModel): token factors, tokens per clip, the activation
estimate and the text cache's bytes, from the folder's configs.

Tokens of a clip: (1 + (frames - 1) / 4) / patch_size_t latent frames x (H / s / p) x (W / s / p), with the VAE's
spatial_compression_ratio s (16) and the transformer's patch p (1). Every block is dual-stream: the clip's tokens
attend jointly with a context of the Qwen2.5-VL caption tokens (max_sequence_length, 1000), ByT5's 256 glyph tokens
and the 729 SigLIP image tokens (zeros and masked for text-to-video, but in the sequence).
"""

from __future__ import annotations

from typing import Optional

from dstune.families.denoiser_facts import transformer_text_bytes
from dstune.families.facts import Attention
from dstune.families.video_facts import VideoFacts
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes

TRANSFORMER_CLASS = "HunyuanVideo15Transformer3DModel"
I2V_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
DEFAULT_TEXT_TOKENS = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length
GLYPH_TOKENS = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length
VISION_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens
# Measured on HunyuanVideo15Transformer3DModel itself (the "hunyuan-video15" activation case in its builtin module): per
# dual-stream block linear bytes per width unit over clip + context tokens, plus the (clip + context)^2 attention
# mask that diffusers' processor builds and SDPA keeps for backward (2 bytes per element in bf16, 4 in fp32); the
# token refiner's 2 blocks (every released config has 2; diffusers does not checkpoint them) are in "outside".
ACTIVATION_CONSTANTS = "hunyuan-video15"


def is_hunyuan15(folder) -> bool:
    """Whether a pipeline folder (dstune.families.denoiser_facts.PipelineFolder) holds HunyuanVideo 1.5."""
    return (folder.index.get("transformer") or [None, None])[1] == TRANSFORMER_CLASS


def token_factors(folder) -> tuple[int, tuple[int, int, int], int, str]:
    """(VAE spatial factor, transformer patch (t, h, w), VAE temporal factor (4), where they came from)."""
    vae, transformer = folder.config("vae"), folder.config("transformer")
    patch = transformer.get("patch_size", 1)
    return (
        vae.get("spatial_compression_ratio", 16),
        (transformer.get("patch_size_t", 1), patch, patch),
        4,
        f"the VAE and transformer configs of {folder.origin}",
    )


def attention(folder) -> Optional[Attention]:
    """The heads a sequence-parallel split divides (its plan is dstune's: dstune.models.hunyuan_video15.split). The
    context sets no rule on N: the split pads it with masked tokens to a multiple of N."""
    config = folder.config("transformer")
    if not isinstance(config.get("num_attention_heads"), int):
        return None
    return Attention(
        config["num_attention_heads"], config.get("attention_head_dim", 0), f"the transformer config of {folder.origin}"
    )


def context_tokens(spec) -> int:
    """The context every block attends to jointly with the clip: caption, glyph and image tokens."""
    return (spec.model.max_sequence_length or DEFAULT_TEXT_TOKENS) + GLYPH_TOKENS + VISION_TOKENS


def clip_tokens(transformer: dict, width: int, height: int, frames: int, spatial: int) -> float:
    patch, patch_t = transformer.get("patch_size", 1), transformer.get("patch_size_t", 1)
    return (1 + (frames - 1) // 4) / patch_t * (height / (spatial * patch)) * (width / (spatial * patch))


def sample_bytes(spec, folder, frames: int, width: int, height: int) -> tuple[float, float]:
    """One clip's activation bytes (dstune.memory.plan's units) at (frames, width, height): the measured constants
    at the transformer's width and dual-stream block count (the kinds and widths the measurement counted)."""
    config = folder.config("transformer")
    spatial = folder.config("vae").get("spatial_compression_ratio", 16)
    shape = ModelShape(
        config["num_attention_heads"] * config["attention_head_dim"], {"transformer_blocks": config["num_layers"]}
    )
    sample = measured_sample_bytes(
        ACTIVATION_CONSTANTS,
        shape,
        clip_tokens(config, width, height, frames, spatial),
        context_tokens(spec),
        spec.train.precision,
    )
    return in_plan_units(sample, spec.train.precision)


def text_tokens_and_width(spec, folder) -> list[tuple[int, int]]:
    """(tokens, width) of each cached text tensor: Qwen2.5-VL's caption states and ByT5's glyph states."""
    config = folder.config("transformer") if folder.has("transformer") else {}
    return [
        (spec.model.max_sequence_length or DEFAULT_TEXT_TOKENS, config.get("text_embed_dim", 0)),
        (GLYPH_TOKENS, config.get("text_embed_2_dim", 0)),
    ]


def image_to_video(folder) -> bool:
    """Whether the folder is HunyuanVideo 1.5's image-to-video pipeline (its runs are image-to-video)."""
    return folder.index.get("_class_name") == I2V_PIPELINE


def image_cache_bytes(spec, folder, num_samples: int) -> int:
    """The latent cache's image-to-video extra: each clip's first-frame SigLIP hidden states (float32)."""
    if not (spec.data.cache.latents and image_to_video(folder)):
        return 0
    encoder = folder.config("image_encoder")
    tokens = (encoder.get("image_size", 384) // encoder.get("patch_size", 14)) ** 2
    return tokens * encoder.get("hidden_size", 0) * 4 * num_samples


def spec_issues(spec, folder) -> list[tuple[str, str]]:
    """model.image_to_video against the folder's pipeline, and first frames for image-to-video samples (one per
    prompt) or none for text-to-video."""
    pipeline, issues = folder.index.get("_class_name"), []
    if spec.model.image_to_video and not image_to_video(folder):
        issues.append(
            (
                "model.image_to_video",
                f"{spec.model.pretrained}: {pipeline} is text-to-video; use a {I2V_PIPELINE} folder or remove the key",
            )
        )
    if spec.model.image_to_video is False and image_to_video(folder):
        issues.append(
            (
                "model.image_to_video",
                f"{spec.model.pretrained}: {pipeline}'s transformer is the image-to-"
                "video one; use a HunyuanVideo15Pipeline folder for text-to-video, or remove the key",
            )
        )
    if image_to_video(folder):
        if len(spec.sample.control_images) != len(spec.sample.prompts):
            issues.append(
                (
                    "sample.control_images",
                    f"{pipeline} renders each sample from a first frame: give one "
                    "image per sample.prompts entry, or set sample.prompts: []",
                )
            )
    elif spec.sample.control_images:
        issues.append(
            (
                "sample.control_images",
                f"{spec.model.pretrained} renders from the prompt alone (text-to-video): remove sample.control_images",
            )
        )
    return issues


def _image_to_video(spec, folder) -> bool:
    return image_to_video(folder) and spec.model.image_to_video is not False


def _text_bytes(spec, folder) -> int:
    return sum(
        transformer_text_bytes(spec, folder, tokens, width) for tokens, width in text_tokens_and_width(spec, folder)
    )


def _condition_cache_bytes(spec, folder, companions, channels, factor, buckets, num_samples: int) -> int:
    return image_cache_bytes(spec, folder, num_samples)


VIDEO_FACTS = VideoFacts(
    transformer_class=TRANSFORMER_CLASS,
    samples_from_cached_text=True,  # its recipe's Sampling.cached_text
    token_factors=token_factors,
    image_to_video=_image_to_video,
    sample_bytes=sample_bytes,
    text_bytes=_text_bytes,
    condition_cache_bytes=_condition_cache_bytes,
    spec_issues=spec_issues,
    attention=attention,
)
