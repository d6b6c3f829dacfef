"""The torch-free facts of LTX-2 folders in the video family (VIDEO_FACTS: the video family's facts ask them, through
the registry, for a folder whose transformer is LTX2VideoTransformer3DModel): token factors, tokens per clip, the
activation estimate, the caches' bytes and the spec checks, from the folder's configs.

Tokens of a clip: (1 + (frames - 1) / t) x (H / s) x (W / s), with the VAE's temporal_compression_ratio t (8) and
spatial_compression_ratio s (32); the transformer's patch is 1x1x1. Every block runs the video stream (self-attention,
cross-attention to the caption's max_sequence_length tokens, a 4x feed-forward) and, for a clip with sound, the
audio stream over the clip's sound tokens: frames / fps seconds x the audio VAE's sample_rate / mel_hop_length mel
frames / 4 (LTX-2: 25 a second, 126 for 121 frames at 24 fps), each audio_num_attention_heads x
audio_attention_head_dim wide (2,048, half the video's). The plan counts a clip as if it had sound (whether clips
have sound is known only when they are read).
"""

from __future__ import annotations

from typing import Optional

from dstune.families.denoiser_facts import transformer_text_bytes
from dstune.families.facts import Attention
from dstune.families.video_facts import VideoFacts
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes

TRANSFORMER_CLASS = "LTX2VideoTransformer3DModel"
DEFAULT_TEXT_TOKENS = 1024  # LTX2Pipeline's max_sequence_length
SPATIAL, TEMPORAL = 32, 8  # AutoencoderKLLTX2Video's compression when its config does not say
# Measured on LTX2VideoTransformer3DModel itself (the "ltx2" activation case in its builtin module), run as dstune trains it:
# the video stream over the clip with cross-attention to the caption, the audio stream on one zero token (its
# constant bytes are in the fit). The feed-forward is 4x the width in every config, so the constants are per width.
ACTIVATION_CONSTANTS = "ltx2"
AV_ACTIVATION_CONSTANTS = "ltx2-av"  # both streams, as a clip with sound trains
AV_CAPTION_TOKENS = 8  # the caption of the ltx2-av measurement: fixed, its bytes are the video-only constants' C term
# image-to-video: a timestep per video token (the first frame's 0), so every block's modulation is per token
I2V_ACTIVATION_CONSTANTS = "ltx2-i2v"
SAMPLING_ONLY = ("vocoder",)  # loaded for the pipeline that renders samples only (the audio VAE encodes the sound)
AUDIO_TEMPORAL = 4  # AutoencoderKLLTX2Audio: mel frames per latent step (its LATENT_DOWNSAMPLE_FACTOR)
MEL_COMPRESSION = 4  # ... and mel bins per latent bin
DEFAULT_FPS = 24.0  # the clip rate when data.video.fps is unset (the recipe's positions assume it)


def compression(folder) -> tuple[int, int]:
    """(spatial, temporal) compression of the folder's video VAE."""
    vae = folder.config("vae")
    return vae.get("spatial_compression_ratio") or SPATIAL, vae.get("temporal_compression_ratio") or TEMPORAL


def token_factors(folder) -> tuple[int, tuple[int, int, int], int, str]:
    """(VAE spatial factor, transformer patch (t, h, w), VAE temporal factor, where they came from): the clip's
    tokens at the VAE's own compression (8x in time for LTX-2), which the sequence split divides."""
    spatial, temporal = compression(folder)
    transformer = folder.config("transformer")
    patch = transformer.get("patch_size", 1)
    return (
        spatial,
        (transformer.get("patch_size_t", 1), patch, patch),
        temporal,
        f"the VAE and transformer configs of {folder.origin}",
    )


def clip_tokens(frames: int, width: int, height: int, spatial: int, temporal: int) -> int:
    return (1 + (frames - 1) // temporal) * (height // spatial) * (width // spatial)


def audio_tokens(spec, folder, frames: int) -> int:
    """The sound tokens of a clip of `frames` frames: its seconds x the audio VAE's latent steps a second (the
    count LTX2Pipeline renders with); 0 for a folder without an audio VAE."""
    if not folder.has("audio_vae"):
        return 0
    audio = folder.config("audio_vae")
    per_second = audio.get("sample_rate", 16000) / audio.get("mel_hop_length", 160) / AUDIO_TEMPORAL
    return round(frames / float(spec.data.video.fps or DEFAULT_FPS) * per_second)


def sample_bytes(spec, folder, frames: int, width: int, height: int) -> tuple[float, float]:
    """One clip's activation bytes (dstune.memory.plan's units) at (frames, width, height), its sound included: the
    video-only constants over the clip's tokens and the caption's, plus what a clip with sound adds, from the
    constants measured with both streams running (AV_ACTIVATION_CONSTANTS, the caption fixed at AV_CAPTION_TOKENS)
    less the video-only figure at that caption: the sound tokens' own bytes and the cross-modal attention the video
    stream then runs (about a third more per video token). The plan counts every clip as having sound (whether a
    clip has a track is known only when it is read)."""
    config = folder.config("transformer")
    width_hidden = config["num_attention_heads"] * config["attention_head_dim"]
    shape = ModelShape(width_hidden, {"transformer_blocks": config["num_layers"]})
    video = clip_tokens(frames, width, height, *compression(folder))
    key = I2V_ACTIVATION_CONSTANTS if spec.model.image_to_video else ACTIVATION_CONSTANTS
    sound, split = audio_tokens(spec, folder, frames), spec.deepspeed.sequence_parallel_size
    sample = clip_bytes(shape, video, sound, text_tokens(spec), spec.train.precision, key, split)
    return in_plan_units(sample, spec.train.precision)


def clip_bytes(
    shape: ModelShape,
    video: float,
    sound: float,
    caption: float,
    precision: str,
    key: str = ACTIVATION_CONSTANTS,
    split: int = 1,
) -> tuple[float, float]:
    """(full, checkpointed) bytes of a clip of `video` tokens, `sound` tokens (0: no sound) and `caption` tokens;
    `key` the video-only constants (image-to-video's: a timestep per token). What sound adds is text-to-video's.
    Under a sequence split of `split` ranks the memory plan divides the result by `split`, but the sound tokens
    stay whole on every rank (dstune.models.ltx2.split): what sound adds is evaluated at one rank's video tokens
    with the whole sound and multiplied by `split`, so that the plan's division leaves one rank's."""
    silent = measured_sample_bytes(key, shape, video, caption, precision)
    if not sound:
        return silent
    share = video / split
    joint = measured_sample_bytes(AV_ACTIVATION_CONSTANTS, shape, share, sound, precision)
    fixed_caption = measured_sample_bytes(ACTIVATION_CONSTANTS, shape, share, AV_CAPTION_TOKENS, precision)
    return tuple(s + (j - c) * split for s, j, c in zip(silent, joint, fixed_caption))


def cache_bytes(spec, folder, companions: dict, num_samples: int, buckets) -> int:
    """Each bucket's clips' posteriors (float32 mean and std) at the VAE's own compression and their sound latents
    (float32, latent_channels x mel_bins / 4 per sound token, and has_sound), and each caption's connector
    outputs."""
    text = (
        sum(
            transformer_text_bytes(spec, folder, tokens, width) for tokens, width in text_tokens_and_width(spec, folder)
        )
        * num_samples
    )
    if not (spec.data.cache.latents and "vae" in companions):
        return text
    channels = folder.config("vae").get("latent_channels", 128)
    spatial, temporal = compression(folder)
    audio = folder.config("audio_vae") if "audio_vae" in companions else {}
    sound_width = audio.get("latent_channels", 0) * audio.get("mel_bins", 0) // MEL_COMPRESSION
    return text + sum(
        (2 * channels * clip_tokens(frames, width, height, spatial, temporal) * 4) * count
        + (sound_width * audio_tokens(spec, folder, frames) * 4 + 4) * count * bool(audio)
        for frames, width, height, count in buckets
    )


def text_tokens(spec) -> int:
    return spec.model.max_sequence_length or DEFAULT_TEXT_TOKENS


def text_tokens_and_width(spec, folder) -> list[tuple[int, int]]:
    """(tokens, width) of each cached text tensor: the connectors' video and audio embeddings (caption_channels
    wide each; the mask is a byte per token)."""
    width = folder.config("transformer").get("caption_channels", 0) if folder.has("transformer") else 0
    return [(text_tokens(spec), width), (text_tokens(spec), width)]


def sampling_parts(folder) -> tuple[str, ...]:
    return tuple(part for part in SAMPLING_ONLY if (folder.index.get(part) or [None])[0])


def image_to_video_issues(spec) -> list[tuple[str, str]]:
    """Image-to-video: one first frame per sample prompt, and no sequence split (its per-token timesteps are not
    split); text-to-video: no first frames."""
    if not spec.model.image_to_video:
        if not spec.sample.control_images:
            return []
        return [
            (
                "sample.control_images",
                f"{spec.model.pretrained} renders from the prompt alone (text-to-video): remove sample.control_images "
                "or set model.image_to_video: true",
            )
        ]
    issues = []
    if len(spec.sample.control_images) != len(spec.sample.prompts):
        issues.append(
            (
                "sample.control_images",
                f"LTX2ImageToVideoPipeline renders each sample from a first frame: give one image per "
                f"sample.prompts entry ({len(spec.sample.prompts)} prompt(s), {len(spec.sample.control_images)} "
                "image(s)), or set sample.prompts: []",
            )
        )
    if spec.deepspeed.sequence_parallel_size > 1:
        issues.append(
            (
                "deepspeed.sequence_parallel_size",
                f"{spec.deepspeed.sequence_parallel_size} with model.image_to_video: LTX-2 image-to-video gives "
                "each token its own timestep (the first frame's at 0), which LTX-2's sequence split does not "
                "split (it takes one timestep per sample): set deepspeed.sequence_parallel_size: 1, or train "
                "text-to-video",
            )
        )
    return issues


def spec_issues(spec, folder) -> list[tuple[str, str]]:
    """Image-to-video's first frames and split (or no first frames for text-to-video), frame counts the VAE takes
    (1 + t k), clips whose sound cannot follow their frames (uniform sampling)."""
    issues = []
    _, temporal = compression(folder)
    issues += image_to_video_issues(spec)
    if spec.model.timestep_sampling not in ("shifted_logit_normal", "uniform"):
        issues.append(
            (
                "model.timestep_sampling",
                f"{spec.model.timestep_sampling}: LTX-2 draws sigma as ltx-trainer "
                "does: shifted_logit_normal (its default) or uniform",
            )
        )
    for key in ("shift", "timestep_range"):
        if getattr(spec.model, key) is not None:
            issues.append(
                (
                    f"model.{key}",
                    "LTX-2 draws sigma directly (model.timestep_sampling), without the "
                    "scheduler's tables this key acts on; remove it",
                )
            )
    if (spec.model.sample_frames - 1) % temporal:
        issues.append(
            (
                "model.sample_frames",
                f"{spec.model.sample_frames} is not {temporal}k+1: LTX-2's VAE keeps "
                f"the first frame and compresses the rest {temporal}x (e.g. 9, 17, 25, 121)",
            )
        )
    if spec.data.video.sampling == "uniform" and spec.data.video.max_frames > 1:
        issues.append(
            (
                "data.video.sampling",
                "uniform spreads a clip's frames over the whole video, so the clip's sound (which LTX-2 trains "
                "on) cannot follow them: use head or sliding",
            )
        )
    uneven = [count for count in spec.data.video.frame_counts if (count - 1) % temporal]
    if uneven:
        issues.append(
            (
                "data.video.frames",
                f"{', '.join(map(str, uneven))} frames: LTX-2's VAE takes {temporal}k+1 "
                f"frames (e.g. {temporal + 1}, {2 * temporal + 1}, 121)",
            )
        )
    return issues


def attention(folder) -> Optional[Attention]:
    """The video heads a sequence-parallel split divides (its plan is dstune's: dstune.models.ltx2.split). The
    caption and the audio stream stay whole on every rank, so they set no rule on N."""
    config = folder.config("transformer")
    if not isinstance(config.get("num_attention_heads"), int):
        return None
    return Attention(
        config["num_attention_heads"], config.get("attention_head_dim", 0), f"the transformer config of {folder.origin}"
    )


VIDEO_FACTS = VideoFacts(
    transformer_class=TRANSFORMER_CLASS,
    samples_from_cached_text=True,  # its recipe's Sampling.cached_text
    token_factors=token_factors,
    sample_bytes=sample_bytes,
    cache_bytes=cache_bytes,
    spec_issues=spec_issues,
    sampling_parts=sampling_parts,
    attention=attention,
)
