"""Kandinsky 6's card (torch-free): Kandinsky6TI2VAPipeline folders (Lite 3 B, Pro 29 B) around
Kandinsky6Transformer3DModel (fused video/audio blocks, a text branch per modality), AutoencoderKLHunyuanVideo,
Qwen2.5-VL (token states) and CLIP (pooled), the MMAudio VAE and vocoder (44.1 kHz), trained text- and
image-to-video with sound as the musubi-tuner fork that trains it does (docs/family-kandinsky6.md): tokens per clip,
activations and cache bytes, and the checks validate and start-up share.

Tokens of a clip: (1 + (frames - 1) / 4) x (H / 8 / 2) x (W / 8 / 2) (the VAE's 8x and 4x, patches 1x2x2), one
latent frame more in image-to-video (the reference frame appended at the tail); its sound: frames / fps seconds x
sample_rate / (2 x hop_length) latent steps (43 a second at 44.1 kHz), each in_audio_dim wide. Distilled folders
(PiflowScheduler: PiFlow's grid outputs) are refused: their transformer does not predict the velocity this loss
trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from dstune.card import DEFAULT_LORA_TARGET_MODULES, ModelPreset, lora, video
from dstune.families.denoiser_facts import embedding_width_bytes
from dstune.families.facts import Attention
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.pipeline_card import SpecIssues
from dstune.families.video_card import VideoCard, clip_buckets, set_videos
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes
from dstune.memory.working import TextWork, VaeWork
from dstune.spec.video_models import expert_problems

PIPELINE = "Kandinsky6TI2VAPipeline"
TEXT_TENSORS = ("encoder_hidden_states", "pooled_projections", "encoder_attention_mask")
SOUND_TENSORS = ("sound_latent", "has_sound")  # a clip's audio VAE latents and whether it has a track
DISTILLED_SCHEDULER = "PiflowScheduler"  # what a distilled (PiFlow) folder's model_index.json lists
# the negative prompt Kandinsky6TI2VAPipeline encodes under guidance when given none: samples from cached text cache
# it beside the prompts (tests/unit/models/kandinsky6 checks it is the pipeline's)
NEGATIVE = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, worst quality, low quality, ugly, deformed, "
    "walking backwards"
)
DEFAULT_TEXT_TOKENS = 1024  # the pipeline's max_sequence_length
DEFAULT_FPS = 24.0  # the released models' frame rate: the sound's length when data.video.fps is unset
DEFAULT_SHIFT = 1.0  # the fork's --scheduler_scale default: sigma = u
SPATIAL, TEMPORAL = 8, 4  # AutoencoderKLHunyuanVideo's compression where its config does not say
ACTIVATION_CONSTANTS = "kandinsky6"  # measured on the class itself (the "kandinsky6" case in its builtin module)
AUDIO_SHARE = 128  # video tokens per sound token of that measurement: the sound's bytes are in its constants
# the attention projections (query, key, value, out) of every attention of its blocks: the diffusers default's
# analogue (its layers are named to_query / to_key / to_value / out_layer, not to_q / ... / to_out.0)
LORA_TARGETS = (
    "to_query",
    "to_key",
    "to_value",
    "attn.out_layer",
    "self_attention.out_layer",
    "cross_attention.out_layer",
    "va_cross_attention.out_layer",
    "av_cross_attention.out_layer",
)
BLOCK_KINDS = ("visual_transformer_blocks", "video_text_transformer_blocks", "audio_text_transformer_blocks")


def is_distilled(index: dict) -> bool:
    """Whether a folder is a distilled (PiFlow) Kandinsky 6: its scheduler is PiFlow's."""
    return (index.get("scheduler") or [None, None])[1] == DISTILLED_SCHEDULER


def video_tokens(transformer: dict, frames: int, width: int, height: int, spatial: int, tail: bool) -> float:
    """A clip's video tokens; `tail`: image-to-video's reference frame appended."""
    patch_t, patch_h, patch_w = transformer.get("patch_size", (1, 2, 2))
    latent_frames = 1 + (frames - 1) // TEMPORAL + int(tail)
    return latent_frames / patch_t * (height / spatial / patch_h) * (width / spatial / patch_w)


def sound_steps(spec, folder, frames: int) -> int:
    """The audio VAE's latent steps of a clip of `frames` frames (the pipeline's count: ceil of its seconds x the
    steps a second)."""
    audio = folder.config("audio_vae") if folder.has("audio_vae") else {}
    step = 2 * audio.get("hop_length", 512)  # the encoder halves the mel frames once
    return math.ceil(frames / float(spec.data.video.fps or DEFAULT_FPS) * audio.get("sample_rate", 44_100) / step)


def config_mismatches(folder: Path) -> list[str]:
    """Which config values of a Kandinsky 6 folder's parts disagree (channels, text widths, the vocoder's rate)."""
    transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
    audio, vocoder = read_component_config(folder, "audio_vae"), read_component_config(folder, "vocoder")
    qwen, clip = read_component_config(folder, "text_encoder"), read_component_config(folder, "text_encoder_2")
    pairs = [
        (
            "transformer in_visual_dim",
            transformer.get("in_visual_dim"),
            "the VAE's latent_channels",
            vae.get("latent_channels"),
        ),
        (
            "transformer out_visual_dim",
            transformer.get("out_visual_dim"),
            "the VAE's latent_channels",
            vae.get("latent_channels"),
        ),
        (
            "transformer in_audio_dim",
            transformer.get("in_audio_dim"),
            "the audio VAE's latent_channels",
            audio.get("latent_channels"),
        ),
        (
            "transformer in_text_dim",
            transformer.get("in_text_dim"),
            "Qwen2.5-VL's hidden_size",
            (qwen.get("text_config") or qwen).get("hidden_size"),
        ),
        ("transformer in_text_dim2", transformer.get("in_text_dim2"), "CLIP's hidden_size", clip.get("hidden_size")),
        ("the vocoder's num_mels", vocoder.get("num_mels"), "the audio VAE's mel_bins", audio.get("mel_bins")),
    ]
    problems = [f"{a} {x} != {b} {y}" for a, x, b, y in pairs if x is not None and y is not None and x != y]
    rates = vocoder.get("upsample_rates")
    if rates and audio.get("hop_length") and math.prod(rates) != audio["hop_length"]:
        problems.append(
            f"the vocoder upsamples {math.prod(rates)}x but the audio VAE's hop_length is {audio['hop_length']}"
        )
    return problems


@dataclass(frozen=True, kw_only=True)
class Kandinsky6Card(VideoCard):
    trains_sound: ClassVar[bool] = True  # each clip's sound track through the MMAudio VAE

    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        """No experts; a Kandinsky6TI2VAPipeline folder that is not distilled (PiFlow), its components, the configs'
        agreement, and a transformer that takes a reference frame for image-to-video."""
        index = read_model_index(folder)
        problems = expert_problems(index, model_spec.expert, model_spec.timestep_range)
        if is_distilled(index):
            problems.append(
                f"its scheduler is a {DISTILLED_SCHEDULER}: a distilled (PiFlow) Kandinsky 6, whose transformer "
                "predicts PiFlow's policy grid, not the velocity this loss trains, and fine-tuning would undo its "
                "distillation. Train the undistilled folder (Kandinsky-6.0-*-Diffusers without -distill)"
            )
            return problems
        problems += component_problems(folder, index, self.components)
        if problems:
            return problems
        problems += config_mismatches(folder)
        transformer = read_component_config(folder, "transformer")
        if model_spec.image_to_video and not (
            transformer.get("visual_cond") and (transformer.get("visual_token_type_num_embeddings") or 0) >= 2
        ):
            problems.append(
                "model.image_to_video: its transformer takes no reference frame (visual_cond with "
                "visual_token_type_num_embeddings >= 2): train text-to-video, or use a folder whose transformer does"
            )
        return problems

    def settings_issues(self, model_spec) -> SpecIssues:
        """The fork draws u uniformly and shifts it (model.shift, its --scheduler_scale): other samplers and the
        tables' keys are refused rather than ignored."""
        issues = []
        if model_spec.timestep_sampling != "uniform":
            issues.append(
                (
                    "model.timestep_sampling",
                    f"{model_spec.timestep_sampling}: Kandinsky 6 draws u uniformly and shifts it (model.shift) as its "
                    "trainer does; use uniform",
                )
            )
        lora = getattr(model_spec, "lora", None)
        targets = list(lora.target_modules) if lora is not None else list(DEFAULT_LORA_TARGET_MODULES)
        if model_spec.train == "lora" and targets == list(DEFAULT_LORA_TARGET_MODULES):
            issues.append(
                (
                    "model.lora.target_modules",
                    "the default (to_q, to_k, to_v, to_out.0) names no layer of Kandinsky6Transformer3DModel, whose "
                    f"attention layers are to_query, to_key, to_value and out_layer: set it, e.g. to {list(LORA_TARGETS)}",
                )
            )
        if model_spec.timestep_range is not None:
            issues.append(("model.timestep_range", "Kandinsky 6 draws sigma directly, without tables; remove it"))
        return issues

    def negative_caption(self) -> str:
        return NEGATIVE

    def latent_cache_key(self, model_spec, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """Each clip's sound latents beside its posterior (silence's where it has none, has_sound saying which)."""
        return "sound: audio_vae latents", ("audio_vae",), SOUND_TENSORS

    # ---------------------------------------------------------------------------------------- memory

    def token_factors(self, folder):
        vae, transformer = folder.config("vae"), folder.config("transformer")
        return (
            vae.get("spatial_compression_ratio") or SPATIAL,
            tuple(transformer.get("patch_size", (1, 2, 2))),
            vae.get("temporal_compression_ratio") or TEMPORAL,
            f"the VAE and transformer configs of {folder.origin}",
        )

    def clip_activation_bytes(self, spec, folder, frames: int, width: int, height: int):
        """The measured constants at the transformer's width and block counts, over the clip's video tokens (its
        sound's are in the constants, at the measurement's share) and the caption's."""
        config = folder.config("transformer")
        text_blocks = config.get("num_text_blocks", 4)
        blocks = (config.get("num_visual_blocks", 60), text_blocks, text_blocks)
        shape = ModelShape(config.get("model_dim", 4096), dict(zip(BLOCK_KINDS, blocks)))
        spatial = self.token_factors(folder)[0]
        tokens = video_tokens(config, frames, width, height, spatial, bool(spec.model.image_to_video))
        caption = spec.model.max_sequence_length or self.default_text_tokens
        split = spec.deepspeed.sequence_parallel_size
        # under a sequence split the memory plan divides a sample's bytes by N, but the caption's text blocks run
        # whole on every rank (dstune.models.kandinsky6.split): one rank's video share with the whole caption, times N
        sample = measured_sample_bytes(ACTIVATION_CONSTANTS, shape, tokens / split, caption, spec.train.precision)
        return in_plan_units(tuple(part * split for part in sample), spec.train.precision)

    def text_bytes(self, spec, folder) -> int:
        """Qwen2.5-VL's token states, CLIP's pooled vector and the mask (a byte a token)."""
        if not spec.data.cache.text_embeddings or not folder.has("transformer"):
            return 0
        config = folder.config("transformer")
        tokens = spec.model.max_sequence_length or self.default_text_tokens
        width = tokens * config.get("in_text_dim", 0) + config.get("in_text_dim2", 0)
        return width * embedding_width_bytes(spec) + tokens

    def cache_bytes(self, spec, folder, companions: dict, num_samples: int, clips) -> int:
        """The core's (posteriors, text) and each clip's sound latents (float32) with has_sound."""
        total = super().cache_bytes(spec, folder, companions, num_samples, clips)
        if not (spec.data.cache.latents and "audio_vae" in companions):
            return total
        channels = folder.config("audio_vae").get("latent_channels", 40)
        buckets = clip_buckets(spec, num_samples, clips)
        return total + sum((channels * sound_steps(spec, folder, f) * 4 + 4) * n for f, _, _, n in buckets)

    def image_to_video(self, spec, folder) -> bool:
        return bool(spec.model.image_to_video)

    def appended_latent_frames(self, spec) -> int:
        """Image-to-video's reference frame, appended after the clip's frames: one latent frame more of tokens."""
        return int(bool(spec.model.image_to_video))

    def split_attention(self, folder) -> Optional[Attention]:
        """The video heads a sequence-parallel split divides (its plan is dstune's: dstune.models.kandinsky6.split).
        The caption and the sound stay whole on every rank, so they set no rule on N."""
        config = folder.config("transformer")
        head_dim = sum(config.get("axes_dims") or (32, 48, 48))
        if not isinstance(config.get("model_dim"), int):
            return None
        return Attention(config["model_dim"] // head_dim, head_dim, f"the transformer config of {folder.origin}")

    def model_spec_issues(self, spec, folder) -> SpecIssues:
        """Image-to-video: one first frame per sample prompt (text-to-video: none); clips whose sound cannot follow
        their frames (uniform sampling); preservation sets (their target would need the base's sound too)."""
        issues = []
        frames_given, prompts = len(spec.sample.control_images), len(spec.sample.prompts)
        if spec.model.image_to_video and frames_given != prompts:
            issues.append(
                (
                    "sample.control_images",
                    f"{PIPELINE} renders each image-to-video sample from a first frame: give one image per "
                    f"sample.prompts entry ({prompts} prompt(s), {frames_given} image(s)), or set sample.prompts: []",
                )
            )
        if not spec.model.image_to_video and frames_given:
            issues.append(
                (
                    "sample.control_images",
                    f"{spec.model.pretrained} trains text-to-video here: remove sample.control_images, or set "
                    "model.image_to_video: true",
                )
            )
        for prefix, section in set_videos(spec.data):
            if section.sampling == "uniform" and section.max_frames > 1:
                issues.append(
                    (
                        f"{prefix}.sampling",
                        "uniform spreads a clip's frames over the whole video, so the clip's sound (which Kandinsky 6 "
                        "trains on) cannot follow them: use head or sliding",
                    )
                )
        for number, item in enumerate(spec.data.sets or []):
            if item.role == "preservation":
                issues.append(
                    (
                        f"data.sets.{number}.role",
                        "preservation is not offered for Kandinsky 6: its target would need the base model's sound "
                        "prediction as well as its video's. Use role regularization or train",
                    )
                )
        return issues


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLHunyuanVideo": VaeWork(
        encode=10.274,
        encode_frame=2.939,
        encode_fixed=1400.0,
        decode=18.052,
        decode_frame=7.39,
        decode_fixed=2800.0,
        measured_on="hub/kandinskylab/Kandinsky-6.0-Pro-sft-5s-Diffusers/vae",
    ),
    "Qwen2_5_VLForConditionalGeneration": TextWork(
        hidden=6.0,
        ffn=6.0,
        token=68.7,
        square=0.969,
        pass_square=0.054,
        measured_on="builtin/tiny-kandinsky6-v1/text_encoder",
    ),
    "CLIPTextModel": TextWork(hidden=8.0, ffn=6.0, square=1.0, measured_on="builtin/tiny-kandinsky6-v1/text_encoder_2"),
}


KANDINSKY6_CARD = Kandinsky6Card(
    working=WORKING_MEMORY,
    key="kandinsky6",
    name="Kandinsky 6",
    family="video",
    unit="kandinsky6",
    model_class="dstune.models.kandinsky6.model:Kandinsky6",
    docs="docs/family-kandinsky6.md",
    names=r"kandinsky\w*|k6\w*",
    summary="Kandinsky 6 Lite and Pro (Kandinsky6Transformer3DModel, Qwen2.5-VL + CLIP, MMAudio): text- and "
    "image-to-video (model.image_to_video) with 44.1 kHz sound",
    folder_classes={PIPELINE: 5.0},
    transformer_class="Kandinsky6Transformer3DModel",
    pipeline_class=PIPELINE,
    components={
        "transformer": "Kandinsky6Transformer3DModel",
        "vae": "AutoencoderKLHunyuanVideo",
        # CLIP before Qwen2.5-VL: the core reads the text length of the tokenizer listed last
        "text_encoder_2": "CLIPTextModel",
        "tokenizer_2": None,
        "text_encoder": "Qwen2_5_VLForConditionalGeneration",
        "tokenizer": None,
        "scheduler": None,
        "audio_vae": "MMAudioVAE",
        "vocoder": "MMAudioVocoder",
    },
    vae_class="AutoencoderKLHunyuanVideo",
    text_tensors=TEXT_TENSORS,
    text_cache_folders=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    default_text_tokens=DEFAULT_TEXT_TOKENS,
    posterior_mode=True,  # the fork trains on cached latents of the posterior's mean
    draws_sigma=True,
    # the pipeline's __call__ takes no prompt mask: the cached rows are cut to the tokens some row uses
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states", "pooled_prompt_embeds": "pooled_projections"},
    cached_text_rows="trimmed",
    lora_formats=("diffusers",),
    lora_loader="Kandinsky6Transformer3DModel.load_lora_adapter (prefix transformer)",
    sampling_parts=("vocoder",),  # loaded for samples only (the audio VAE encodes the sound)
    spec_notes={
        "model.max_sequence_length": "1024 (Kandinsky 6: Qwen2.5-VL tokens after its 129-token template)",
        "model.shift": "1.0 (Kandinsky 6: the shift of its uniform u, the fork's --scheduler_scale)",
    },
    activation_cases="dstune.models.kandinsky6.builtin:ACTIVATION_CASES",
    builtins={"tiny-kandinsky6": "dstune.models.kandinsky6.builtin:TINY_KANDINSKY6"},
    presets=(
        ModelPreset(
            "kandinsky6",
            "Kandinsky 6 Pro text-to-video with sound (29 B; Qwen2.5-VL 7B + CLIP)",
            "video",
            "kandinskylab/Kandinsky-6.0-Pro-sft-5s-Diffusers",
            "tiny-kandinsky6",
            video(
                512,
                121,
                24,
                5.0,
                **lora(targets=LORA_TARGETS),
                # ZeRO 3 and the text cache (Qwen2.5-VL leaves once it is built): the step is 53.7 GB per 80 GB GPU;
                # samples of 81 frames (60.5 GB at the sample phase; 121 frames' decode would be 84.7 GB)
                **{
                    "model.timestep_sampling": "uniform",
                    "deepspeed.zero_stage": 3,
                    "data.cache.text_embeddings": True,
                    "model.sample_frames": 81,
                },
            ),
        ),
    ),
)
