"""MiniMax-H3's card (torch-free): MiniMaxH3ModularPipeline folders (a diffusers modular pipeline: its
modular_model_index.json, no model_index.json) around MiniMaxH3Transformer3DModel, the video VAE of 17-frame chunks
(AutoencoderKLMiniMaxH3: 17k+5 frames -> 5k+2 latent frames, ImageNet-normalised pixels from [0, 1]), the stereo audio
VAE (AutoencoderKLMiniMaxH3Audio, 40 latents a second at 32 kHz), a Qwen3-VL text encoder read at hidden state 50,
and two MiniMaxH3Schedulers (shift 12 for video, 3 for audio). Trained text-to-video+audio (t2va) and, under
model.image_to_video, first-frame-to-video+audio (fl2va: each clip from its own first frame) on the folder's
`transformer/` partition; the reference workflow (ref2va, the `transformer_ref/` partition) is not loaded.

Tokens of a clip: one packed sequence `[text | target audio | target video]`: the caption's tokens, the sound's 2 x
(frames / 24 x 40) rows (stereo, channel-major) and (5k + 2) x (H / 32) x (W / 32) video rows (16x VAE, 1x2x2
patches); every block is full self-attention over all of them (no cross-attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dstune.card import IMAGENET_UNIT_PIXELS, ClipRule, ModelPreset, PixelRange, lora, video
from dstune.families.denoiser_facts import transformer_text_bytes
from dstune.families.facts import Attention
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.pipeline_card import SpecIssues
from dstune.families.video_card import VideoCard, clip_buckets, set_videos
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes
from dstune.memory.working import TextWork, VaeWork

PIPELINE = "MiniMaxH3ModularPipeline"
TRANSFORMER = "MiniMaxH3Transformer3DModel"
TEXT_TENSORS = ("encoder_hidden_states", "encoder_attention_mask")  # padded to max_sequence_length; the mask cuts
SOUND_TENSORS = ("sound_latent", "has_sound")  # a clip's normalised audio rows and whether it has a track
KEYFRAME_TENSORS = (
    "keyframe_latent",
    "keyframe_pixels",
)  # fl2va: a clip's first frame encoded as a keyframe, its pixels
TEXT_LAYER = 50  # the Qwen3-VL hidden state the pipeline conditions on (after decoder layer 50; not a config value)
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # the two MiniMaxH3Schedulers' shifts, stepped together (one u, two sigmas)
FPS = 24  # the frame rate its rotary clock assumes: one latent of sound (1/40 s) is 24 x 5/3 / 40 of a frame's
AUDIO_LATENTS_PER_SECOND = 40  # the audio VAE's 800-sample hop at 32 kHz
TEXT_TAG, VIDEO_TAG, AUDIO_TAG = 1, 0, 2  # the rows' modality tags (AdaLN per tag)
MIN_SECONDS, MAX_SECONDS = 5, 15  # the clip lengths its pipeline renders (sample frames 120 to 360 at 24 fps)
DEFAULT_TEXT_TOKENS = 512  # captions are cut to max_sequence_length rows (the pipeline encodes them whole)
SPATIAL = 16  # AutoencoderKLMiniMaxH3's compression when its config does not say
ACTIVATION_CONSTANTS = "minimax-h3"  # measured on the class itself (the "minimax-h3" case in its builtin module)
KEYFRAME_SEED = 42  # the pipeline's keyframe_encode_seed: a keyframe's posterior is sampled under its own generator
KEYFRAME_LEVEL = 0.999  # the pipeline's keyframe_noise_aug: the t a keyframe's rows are noised to and held at
VISION_PIXELS = 32  # pixels a side per vision token of the keyframe's block (Qwen3-VL: 16 px patches merged 2x2)
KEYFRAME_LABEL_TOKENS = 8  # '<Picture 1>: ', <|vision_start|>, <|vision_end|> (about; the plan's count only)


def clip_rule(vae: dict) -> ClipRule:
    """AutoencoderKLMiniMaxH3's rule from its config: chunks of clip_length frames (17) to ceil(17 / t) latent
    frames (5, t its temporal factor 4), the first 5 frames to 2: 17k+5 -> 5k+2."""
    temporal = math.prod(vae.get("temporal_downsample_factors") or (1, 2, 2, 1, 1, 1))
    latents = math.ceil(vae.get("clip_length", 17) / temporal)
    return ClipRule(vae.get("clip_length", 17), latents, latents, math.ceil(latents / temporal))


def spatial_factor(vae: dict) -> int:
    return math.prod(vae.get("spatial_downsample_factors") or (SPATIAL,))


def audio_rows(frames: int, channels: int = 2) -> int:
    """The sound rows of a clip of `frames` frames: its seconds at 24 fps x 40 latents, per stereo channel (the
    pipeline's count, rounded)."""
    return channels * round(frames / FPS * AUDIO_LATENTS_PER_SECOND)


def text_tokens(spec) -> int:
    return spec.model.max_sequence_length or DEFAULT_TEXT_TOKENS


def sample_bytes(spec, folder, frames: int, width: int, height: int) -> tuple[int, int]:
    """One clip's activations from the constants measured on its class (the "minimax-h3" case in its builtin
    module): its media rows (video and sound, which every block treats alike; fl2va: the keyframe's latent frame too)
    and its caption's rows (through the refiner blocks too; fl2va: the keyframe's vision block and its label too) at
    the transformer's width and block counts."""
    config, vae = folder.config("transformer"), folder.config("vae")
    factor = spatial_factor(vae) * 2  # the 1x2x2 patch
    frame_rows = (width // factor) * (height // factor)
    video = clip_rule(vae).latent_frames(frames) * frame_rows
    blocks = {"transformer_blocks": config.get("num_layers", 50), "refiner_blocks": config.get("num_refiner_layers", 2)}
    shape = ModelShape(config.get("hidden_size", 5376), blocks)
    rows, caption = video + audio_rows(frames), text_tokens(spec)
    if spec.model.image_to_video:
        rows += frame_rows
        caption += (width // VISION_PIXELS) * (height // VISION_PIXELS) + KEYFRAME_LABEL_TOKENS
    sample = measured_sample_bytes(ACTIVATION_CONSTANTS, shape, rows, caption, spec.train.precision)
    return in_plan_units(sample, spec.train.precision)


def config_mismatches(folder: Path) -> list[str]:
    """The channels of the transformer against both VAEs, its text width against the text encoder's, and the
    1x2x2 patch the pipeline packs."""
    transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
    audio, text = read_component_config(folder, "audio_vae"), read_component_config(folder, "text_encoder")
    problems = []
    if transformer.get("in_channels") != vae.get("latent_channels"):
        problems.append(
            f"transformer in_channels {transformer.get('in_channels')} != the VAE's latent_channels "
            f"{vae.get('latent_channels')}"
        )
    if transformer.get("audio_in_channels") != audio.get("latent_channels"):
        problems.append(
            f"transformer audio_in_channels {transformer.get('audio_in_channels')} != the audio VAE's latent_channels "
            f"{audio.get('latent_channels')}"
        )
    width = (text.get("text_config") or text).get("hidden_size")
    if width is not None and transformer.get("text_dim") != width:
        problems.append(f"transformer text_dim {transformer.get('text_dim')} != the text encoder's hidden_size {width}")
    layers = (text.get("text_config") or text).get("num_hidden_layers")
    if layers is not None and layers <= TEXT_LAYER:
        problems.append(
            f"the text encoder has {layers} decoder layers: MiniMax-H3 reads hidden state {TEXT_LAYER}, so it needs "
            f"more than {TEXT_LAYER}"
        )
    if list(transformer.get("patch_size") or (1, 2, 2)) != [1, 2, 2]:
        problems.append(f"transformer patch_size {transformer.get('patch_size')}: its pipeline packs 1x2x2 patches")
    return problems


def keyframe_issues(spec) -> SpecIssues:
    """First-frame training (fl2va): its text rows hold the frame's vision block (not cacheable per caption), and
    its samples render from a first frame per prompt."""
    issues = []
    if spec.data.cache.text_embeddings:
        issues.append(
            (
                "data.cache.text_embeddings",
                "MiniMax-H3's first-frame workflow (fl2va) encodes each caption after its clip's first frame (a "
                "'<Picture 1>: ' label and the frame's Qwen3-VL vision block, then the caption), so a clip's text "
                "rows belong to its caption and its frame, not to the caption: set it to false (data.cache.latents "
                "still caches the clip's latents, sound and keyframe)",
            )
        )
    prompts, images = len(spec.sample.prompts), len(spec.sample.control_images)
    if prompts and images != prompts:
        issues.append(
            (
                "sample.control_images",
                f"{images} image(s) for {prompts} prompt(s): MiniMax-H3's first-frame samples render each prompt from "
                "its first frame; give one image per prompt, or sample.prompts: []",
            )
        )
    return issues


@dataclass(frozen=True, kw_only=True)
class MiniMaxH3Card(VideoCard):
    trains_sound = True  # its class encodes each clip's track with the audio VAE
    fits_guided_target = True  # guidance-distilled: its loss takes model.cfg_augmented_target

    def hidden_states_read(self, folder) -> dict[str, tuple[int, ...]]:
        return {"text_encoder": (TEXT_LAYER,)}

    def pixel_range(self) -> PixelRange:
        """AutoencoderKLMiniMaxH3 encodes ImageNet-normalised pixels from [0, 1] (its pipeline's pixel_mean and
        pixel_std) and decodes to them."""
        return IMAGENET_UNIT_PIXELS

    def token_factors(self, folder):
        transformer, vae = folder.config("transformer"), folder.config("vae")
        patch = tuple(transformer.get("patch_size") or (1, 2, 2))
        return spatial_factor(vae), patch, 4, f"the VAE and transformer configs of {folder.origin}"

    def clip_rule(self, folder) -> ClipRule:
        return clip_rule(folder.config("vae"))

    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        """A MiniMaxH3ModularPipeline folder with the components t2va trains, their configs agreeing."""
        index = read_model_index(folder)
        problems = []
        if index.get("_class_name") != self.pipeline_class:
            problems.append(
                f"a {index.get('_class_name')}: dstune trains MiniMax-H3 from {self.pipeline_class} folders"
            )
        problems += component_problems(folder, index, self.components)
        return problems or config_mismatches(folder)

    def settings_issues(self, model_spec) -> SpecIssues:
        """The keys its sigma draw does not read (it maps u through the schedulers' shifts itself)."""
        issues = super().settings_issues(model_spec)
        for key in ("shift", "timestep_range"):
            if getattr(model_spec, key, None) is not None:
                issues.append(
                    (
                        f"model.{key}",
                        f"MiniMax-H3 maps u through its schedulers' own shifts ({VIDEO_SHIFT:g} for video, "
                        f"{AUDIO_SHIFT:g} for audio, one u for both, as they step together); remove it",
                    )
                )
        return issues

    def model_spec_issues(self, spec, folder) -> SpecIssues:
        """Clip rates other than its 24 fps (its rotary clock pairs a frame with 5/3 latents of sound), sound that
        cannot follow its frames, sample lengths its pipeline does not render, and fl2va's text cache and first
        frames (keyframe_issues)."""
        issues = []
        for prefix, section in set_videos(spec.data):
            if section.fps is not None and section.fps != FPS:
                issues.append(
                    (
                        f"{prefix}.fps",
                        f"{section.fps}: MiniMax-H3 is trained and renders at {FPS} fps (its rotary positions pair "
                        f"each frame with {AUDIO_LATENTS_PER_SECOND}/{FPS} latents of sound); set {FPS}",
                    )
                )
            if section.sampling == "uniform" and section.max_frames > 1:
                issues.append(
                    (
                        f"{prefix}.sampling",
                        "uniform spreads a clip's frames over the whole video, so the clip's sound (which MiniMax-H3 "
                        "trains on) cannot follow them: use head or sliding",
                    )
                )
        frames = spec.model.sample_frames
        if spec.sample.prompts and not MIN_SECONDS * FPS <= frames <= MAX_SECONDS * FPS:
            issues.append(
                (
                    "model.sample_frames",
                    f"{frames}: {self.pipeline_class} renders {MIN_SECONDS} to {MAX_SECONDS} s at {FPS} fps, "
                    f"{MIN_SECONDS * FPS} to {MAX_SECONDS * FPS} frames of the form 17k+5 (124, 141, ..., 362 - "
                    "362 rounds past 15 s, so 345 is the longest); set one, or sample.prompts: []",
                )
            )
        if spec.model.image_to_video:
            issues += keyframe_issues(spec)
        return issues

    def latent_cache_key(self, model_spec, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """Each clip's normalised audio rows (the audio VAE posterior's mode) beside its posterior, silence's where it
        has none, with has_sound saying which; first-frame training (fl2va) its first frame's keyframe latent and
        pixels too."""
        if model_spec.image_to_video:
            return (
                "sound: audio_vae rows; fl2va: first-frame keyframe",
                ("audio_vae",),
                SOUND_TENSORS + KEYFRAME_TENSORS,
            )
        return "sound: audio_vae rows", ("audio_vae",), SOUND_TENSORS

    # ---------------------------------------------------------------------------------------- memory

    def clip_activation_bytes(self, spec, folder, frames: int, width: int, height: int):
        return sample_bytes(spec, folder, frames, width, height)

    def text_bytes(self, spec, folder) -> int:
        text = folder.config("text_encoder")
        width = (text.get("text_config") or text).get("hidden_size")
        return transformer_text_bytes(spec, folder, text_tokens(spec), width) + text_tokens(spec) * 8

    def cache_bytes(self, spec, folder, companions: dict, num_samples: int, clips) -> int:
        """The core's posteriors and captions, and each clip's sound rows (float32) and has_sound."""
        core = super().cache_bytes(spec, folder, companions, num_samples, clips)
        if not (spec.data.cache.latents and "audio_vae" in companions):
            return core
        channels = folder.config("audio_vae").get("latent_channels", 32)
        buckets = clip_buckets(spec, num_samples, clips)
        return core + sum((audio_rows(f) * channels * 4 + 4) * n for f, _, _, n in buckets)

    def split_attention(self, folder) -> Optional[Attention]:
        """The heads a sequence-parallel split divides (its class's plan, prepared by dstune.models.minimax_h3.split).
        The packed sequence sets no rule on N: the split pads it with masked rows to a multiple of N."""
        config = folder.config("transformer")
        if not isinstance(config.get("num_attention_heads"), int):
            return None
        heads, width = config["num_attention_heads"], config.get("attention_head_dim", 0)
        return Attention(heads, width, f"the transformer config of {folder.origin}")

    def split_tokens(self, spec, frames: int, video_tokens: int) -> tuple[int, str]:
        """The packed sequence a split divides: the caption (at most max_sequence_length tokens), the sound's rows
        and the video's, padded with masked rows to a multiple of N."""
        size = spec.deepspeed.sequence_parallel_size
        rows = text_tokens(spec) + audio_rows(frames) + video_tokens
        what = f"packed text <= {text_tokens(spec)} + sound {audio_rows(frames)} + video {video_tokens} rows"
        return -(-rows // size) * size, what + (f", padded to a multiple of {size}" if size > 1 else "")


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs (the VAE from the released configuration, its encoder
# in float32 as the class keeps it, its ViT decoder narrowed with its channels; clips of 17k+5 frames);
# tests/unit/test_working_memory.py checks them at another size. The class encodes and decodes through its own
# 256 px tiles above 256 px: these figures are its whole-frame passes, an upper bound there.
WORKING_MEMORY = {
    "AutoencoderKLMiniMaxH3": VaeWork(
        encode=0.757,
        encode_frame=362.966,
        encode_fixed=12864.0,
        decode=0.309,
        decode_frame=10.21,
        decode_fixed=3137.0,
        measured_on="hub/MiniMaxAI/MiniMax-H3/vae",
    ),
    "Qwen3VLForConditionalGeneration": TextWork(
        hidden=8.0,
        ffn=6.0,
        token=36.7,
        square=0.969,
        pass_square=0.054,
        measured_on="builtin/tiny-minimax-h3-v1/text_encoder",
    ),
}


MINIMAX_H3_CARD = MiniMaxH3Card(
    working=WORKING_MEMORY,
    key="minimax-h3",
    name="MiniMax-H3",
    family="video",
    unit="minimax_h3",
    model_class="dstune.models.minimax_h3.model:MiniMaxH3",
    docs="docs/family-minimax-h3.md",
    activation_cases="dstune.models.minimax_h3.builtin:ACTIVATION_CASES",
    names=r"minimax[-_ ]?h3\w*",
    summary="MiniMax-H3 (MiniMaxH3Transformer3DModel, a modular pipeline; Qwen3-VL text): text-to-video with stereo "
    "sound (t2va) and first-frame-to-video (fl2va: model.image_to_video), guidance-distilled",
    folder_classes={PIPELINE: 1.0},  # guidance-distilled: one forward a step, no guidance scale
    transformer_class=TRANSFORMER,
    pipeline_class=PIPELINE,
    components={
        "transformer": TRANSFORMER,
        "vae": "AutoencoderKLMiniMaxH3",
        "audio_vae": "AutoencoderKLMiniMaxH3Audio",
        "text_encoder": "Qwen3VLForConditionalGeneration",
        "tokenizer": None,
        "scheduler": "MiniMaxH3Scheduler",
        "audio_scheduler": "MiniMaxH3Scheduler",
    },
    vae_class="AutoencoderKLMiniMaxH3",
    text_tensors=TEXT_TENSORS,
    default_text_tokens=DEFAULT_TEXT_TOKENS,
    posterior_mode=True,  # the targets are the posterior's mode (the published trainer's choice)
    draws_sigma=True,  # u through the two shifts, continuously (no scheduler table)
    # samples render from the prompt's rows (the class encodes them; its pipeline's text block is not run)
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states"},
    cached_text_negative=False,
    cached_text_rows="per_caption",
    spec_notes={"model.max_sequence_length": "512 (MiniMax-H3: Qwen3-VL tokens a caption keeps)"},
    builtins={"tiny-minimax-h3": "dstune.models.minimax_h3.builtin:TINY_MINIMAX_H3"},
    presets=(
        ModelPreset(
            "minimax-h3",
            "MiniMax-H3 text-to-video with stereo sound (33 B joint video+audio transformer; Qwen3-VL)",
            "video",
            "MiniMaxAI/MiniMax-H3",
            "tiny-minimax-h3",
            video(
                512,
                124,  # 17k+5 frames: about 5 s at its 24 fps
                FPS,
                1.0,  # guidance-distilled: one forward a step, no guidance scale
                **lora(),
                **{
                    "sample.steps": 50,  # diffusers' modular num_inference_steps default (the pipeline sets none)
                    "deepspeed.zero_stage": 3,
                    "data.cache.latents": True,
                    "data.cache.text_embeddings": True,
                    "model.text_encoder_offload": "cpu",  # the 33 B text encoder while it builds the text cache
                },
            ),
        ),
    ),
)
