"""LTX-2's card (torch-free): LTX2Pipeline folders of LTX-2.0, 2.3 and 2.5 (LTX2VideoTransformer3DModel with its
audio stream, AutoencoderKLLTX2Video and AutoencoderKLLTX2Audio, Gemma 3 or Gemma 4 with the text connectors, the
vocoder; 2.3 and 2.5 project the text per modality in the connectors, 2.5 adds a duration head): token factors,
tokens per clip, the activation estimate, the caches' bytes and the checks validate and start-up share, from the
folder's configs.

Tokens of a clip: (1 + (frames - 1) / t) x (H / s) x (W / s), with the VAE's temporal_compression_ratio t (8) and
spatial_compression_ratio s (32); the transformer's patch is 1x1x1. Every block runs the video stream (self-attention,
cross-attention to the caption's max_sequence_length tokens, a 4x feed-forward) and, for a clip with sound, the
audio stream over the clip's sound tokens: frames / fps seconds x the audio VAE's sample_rate / mel_hop_length mel
frames / 4 (LTX-2: 25 a second, 126 for 121 frames at 24 fps), each audio_num_attention_heads x
audio_attention_head_dim wide (2,048, half the video's). The plan counts a clip as if it had sound (whether clips
have sound is known only when they are read).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dstune.card import ModelPreset, lora, video
from dstune.families.denoiser_facts import transformer_text_bytes
from dstune.families.facts import Attention
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.pipeline_card import SpecIssues
from dstune.families.video_card import VideoCard, clip_buckets, set_videos
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes
from dstune.spec.video_models import expert_problems
from dstune.memory.working import TextWork, VaeWork

PIPELINE = "LTX2Pipeline"
TEXT_TENSORS = ("encoder_hidden_states", "audio_encoder_hidden_states", "encoder_attention_mask")
SOUND_TENSORS = ("sound_latent", "has_sound")  # a clip's sound latents and whether it has a track, beside its posterior
SOUND_SAMPLERS = ("shifted_logit_normal", "uniform")  # ltx-trainer's sigma samplers
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
AUDIO_TEMPORAL = 4  # AutoencoderKLLTX2Audio: mel frames per latent step (its LATENT_DOWNSAMPLE_FACTOR)
MEL_COMPRESSION = 4  # ... and mel bins per latent bin
DEFAULT_FPS = 24.0  # the clip rate when data.video.fps is unset (the recipe's positions assume it)
# LTX2Pipeline's text encoders: Gemma 3 (LTX-2.0, 2.3) or Gemma 4 (LTX-2.5); its vocoders: 2.0's and 2.3's (with
# bandwidth extension)
TEXT_ENCODERS = ("Gemma3ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")
VOCODERS = ("LTX2Vocoder", "LTX2VocoderWithBWE")


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
    clip has a track is known only when it is read). IC-LoRA (data.control_dir) doubles the video tokens: the
    reference's, at the clip's size, run through every block beside the clip's; so do its sound tokens (a reference
    with sound: audio-to-audio)."""
    config = folder.config("transformer")
    width_hidden = config["num_attention_heads"] * config["attention_head_dim"]
    shape = ModelShape(width_hidden, {"transformer_blocks": config["num_layers"]})
    video = clip_tokens(frames, width, height, *compression(folder))
    references = spec.data.control_dir is not None  # IC-LoRA: the reference's tokens (as many) before the clip's
    video *= 2 if references else 1
    # a timestep per token (image-to-video's first frame, IC-LoRA's reference at 0): a modulation per token
    key = I2V_ACTIVATION_CONSTANTS if spec.model.image_to_video or references else ACTIVATION_CONSTANTS
    sound, split = audio_tokens(spec, folder, frames), spec.deepspeed.sequence_parallel_size
    sound *= 2 if references else 1  # and its sound's tokens before the clip's (audio-to-audio: counted as heard)
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
    (float32, latent_channels x mel_bins / 4 per sound token, and has_sound), as many again for IC-LoRA's reference
    clips (an entry of the same size beside each clip's), and each caption's connector outputs."""
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
    entries = 2 if spec.data.control_dir is not None else 1  # IC-LoRA: each reference clip's entry beside its clip's
    return text + entries * sum(
        (2 * channels * clip_tokens(frames, width, height, spatial, temporal) * 4) * count
        + (sound_width * audio_tokens(spec, folder, frames) * 4 + 4) * count * bool(audio)
        for frames, width, height, count in buckets
    )


def text_tokens(spec) -> int:
    return spec.model.max_sequence_length or DEFAULT_TEXT_TOKENS


def text_tokens_and_width(spec, folder) -> list[tuple[int, int]]:
    """(tokens, width) of each cached text tensor: the connectors' video and audio embeddings (the mask is a byte
    per token): caption_channels wide each (LTX-2.0), or with per-modality projections (LTX-2.3, 2.5) the
    connectors' video_hidden_dim and audio_hidden_dim (the transformer's cross-attention widths)."""
    connectors = folder.config("connectors") if folder.has("connectors") else {}
    if connectors.get("per_modality_projections"):
        widths = (connectors.get("video_hidden_dim", 0), connectors.get("audio_hidden_dim", 0))
    else:
        width = folder.config("transformer").get("caption_channels", 0) if folder.has("transformer") else 0
        widths = (width, width)
    return [(text_tokens(spec), width) for width in widths]


def image_to_video_issues(spec) -> list[tuple[str, str]]:
    """Image-to-video: one first frame per sample prompt, and no sequence split (its per-token timesteps are not
    split); text-to-video: no first frames."""
    if not spec.model.image_to_video:
        if not spec.sample.control_images or spec.data.control_dir is not None:  # IC-LoRA: the reference clips
            return []
        return [
            (
                "sample.control_images",
                f"{spec.model.pretrained} renders from the prompt alone (text-to-video): remove sample.control_images, "
                "set model.image_to_video: true, or train IC-LoRA from reference clips (data.control_dir)",
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


def ic_lora_issues(spec) -> list[tuple[str, str]]:
    """IC-LoRA (data.control_dir: a reference clip per sample, dstune.models.ltx2.ic_lora): its samples' sources (a
    reference clip per prompt, with image-to-video a [reference, first frame] pair), and what it does not combine
    with: a sequence split (the references' timesteps are per token)."""
    if spec.data.control_dir is None:
        return []
    issues = []
    pairs = [one for one in spec.sample.control_images if not isinstance(one, str) and len(one) == 2]
    if spec.model.image_to_video and len(pairs) != len(spec.sample.control_images):
        issues.append(
            (
                "sample.control_images",
                "IC-LoRA with model.image_to_video renders each sample from a reference clip and a first frame: give "
                "each prompt a list of two paths, [reference clip, first frame image]",
            )
        )
    if not spec.model.image_to_video and any(not isinstance(one, str) for one in spec.sample.control_images):
        issues.append(
            (
                "sample.control_images",
                "IC-LoRA renders each sample from one reference clip: give one path per prompt (a list of two, "
                "[reference clip, first frame], is for model.image_to_video: true)",
            )
        )
    if spec.deepspeed.sequence_parallel_size > 1:
        issues.append(
            (
                "deepspeed.sequence_parallel_size",
                "IC-LoRA gives the reference tokens timestep 0 and the target's the clip's sigma (a timestep per "
                "token), which LTX-2's sequence split does not split: set deepspeed.sequence_parallel_size: 1",
            )
        )
    return issues


def sets_issues(data) -> list[tuple[str, str]]:
    """data.sets on LTX-2: preservation sets (their target would need the base's sound prediction too) and sets at
    other frame rates (the clips of one batch would carry sound tracks of other lengths) are refused."""
    issues = []
    for number, item in enumerate(data.sets or []):
        if item.role == "preservation":
            issues.append(
                (
                    f"data.sets.{number}.role",
                    "preservation is not offered for LTX-2 yet: its target would need the base model's sound "
                    "prediction as well as its video's. Use role regularization (class clips) or train",
                )
            )
    rates = [one.video.fps for one in data.set_specs()]
    if data.sets is not None and len(set(rates)) > 1:
        number = rates.index(next(rate for rate in rates if rate != rates[0]))
        issues.append(
            (
                f"data.sets.{number}.video.fps",
                f"the sets' frame rates differ ({', '.join(str(rate) for rate in rates)}): LTX-2 trains on each "
                "clip's sound, frames / fps seconds of it, so clips of one batch would carry sound tracks of other "
                "lengths. Give every set the same data.video.fps",
            )
        )
    return issues


def _text_width(text_config: dict) -> Optional[int]:
    return (text_config.get("text_config") or text_config).get("hidden_size")


def config_mismatches(folder: Path) -> list[str]:
    """Which config values of an LTX-2 folder's parts disagree (channels, text widths, the patch dstune packs)."""
    transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
    audio_vae, connectors = read_component_config(folder, "audio_vae"), read_component_config(folder, "connectors")
    text = read_component_config(folder, "text_encoder")
    problems = []
    if (transformer.get("patch_size"), transformer.get("patch_size_t")) != (1, 1):
        problems.append(
            f"transformer patch_size {transformer.get('patch_size')} / patch_size_t "
            f"{transformer.get('patch_size_t')}: dstune packs LTX-2 latents 1x1x1, as LTX-2's are"
        )
    if transformer.get("in_channels") != vae.get("latent_channels"):
        problems.append(
            f"transformer in_channels {transformer.get('in_channels')} != the VAE's latent_channels "
            f"{vae.get('latent_channels')}"
        )
    audio_width = (audio_vae.get("latent_channels") or 0) * (audio_vae.get("mel_bins") or 0) // 4
    if transformer.get("audio_in_channels") != audio_width:
        problems.append(
            f"transformer audio_in_channels {transformer.get('audio_in_channels')} != the audio VAE's "
            f"latent_channels x mel_bins / 4 ({audio_width})"
        )
    problems += projection_mismatches(transformer, connectors)
    if connectors.get("caption_channels") != _text_width(text):
        problems.append(
            f"connectors caption_channels {connectors.get('caption_channels')} != the text encoder's "
            f"hidden_size {_text_width(text)}"
        )
    layers = (text.get("text_config") or text).get("num_hidden_layers")
    if layers is not None and connectors.get("text_proj_in_factor") != layers + 1:
        problems.append(
            f"connectors text_proj_in_factor {connectors.get('text_proj_in_factor')} != the text "
            f"encoder's num_hidden_layers + 1 ({layers + 1}: every hidden state is stacked)"
        )
    return problems


def projection_mismatches(transformer: dict, connectors: dict) -> list[str]:
    """The text path of each kind: LTX-2.0's transformer projects the connectors' caption_channels-wide outputs
    itself (use_prompt_embeddings); LTX-2.3's and 2.5's connectors project per modality (per_modality_projections)
    to the transformer's cross_attention_dim and audio_cross_attention_dim, and the transformer has no projection."""
    per_modality = bool(connectors.get("per_modality_projections"))
    projects = transformer.get("use_prompt_embeddings", True)
    if per_modality == bool(projects):
        return [
            f"connectors per_modality_projections {per_modality} with transformer use_prompt_embeddings {projects}: "
            "exactly one of them projects the text (LTX-2.0: the transformer; LTX-2.3, 2.5: the connectors)"
        ]
    if not per_modality:
        return []
    problems = []
    for width, cross in (
        ("video_hidden_dim", "cross_attention_dim"),
        ("audio_hidden_dim", "audio_cross_attention_dim"),
    ):
        if connectors.get(width) != transformer.get(cross):
            problems.append(
                f"connectors {width} {connectors.get(width)} != the transformer's {cross} {transformer.get(cross)}"
            )
    return problems


def class_problems(index: dict) -> list[str]:
    """The text encoder and vocoder classes LTX2Pipeline takes (either kind of each)."""
    problems = []
    for name, classes in (("text_encoder", TEXT_ENCODERS), ("vocoder", VOCODERS)):
        entry = index.get(name)
        listed = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if listed is not None and listed not in classes:
            problems.append(f"`{name}` is a {listed}; expected one of {', '.join(classes)}")
    return problems


@dataclass(frozen=True, kw_only=True)
class Ltx2Card(VideoCard):
    trains_sound = True  # its model's sound stream encodes each clip's track with the audio VAE

    def hidden_states_read(self, folder) -> dict[str, tuple[int, ...]]:
        """LTX2Pipeline stacks every Gemma hidden state (the embeddings' and each layer's)."""
        config = folder.config("text_encoder")
        layers = (config.get("text_config") or config).get("num_hidden_layers", 0)
        return {"text_encoder": tuple(range(layers + 1))}

    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        """The experts (none), an LTX2Pipeline folder, its components, and the configs' agreement."""
        index = read_model_index(folder)
        problems = expert_problems(index, model_spec.expert, model_spec.timestep_range)
        if index.get("_class_name") != self.pipeline_class:
            problems.append(
                f"a {index.get('_class_name')}: dstune trains LTX-2 text-to-video from {self.pipeline_class} folders"
            )
        problems += component_problems(folder, index, self.components) + class_problems(index)
        return problems or config_mismatches(folder)

    def settings_issues(self, model_spec) -> SpecIssues:
        """The model keys its sigma draws do not use: refused rather than ignored."""
        issues = []
        if model_spec.timestep_sampling not in SOUND_SAMPLERS:
            issues.append(
                (
                    "model.timestep_sampling",
                    f"{model_spec.timestep_sampling}: LTX-2 draws sigma as ltx-trainer does: shifted_logit_normal (its "
                    "default) or uniform",
                )
            )
        for key in ("shift", "timestep_range"):
            if getattr(model_spec, key) is not None:
                issues.append(
                    (
                        f"model.{key}",
                        "LTX-2 draws sigma directly (model.timestep_sampling), without the scheduler's tables this key "
                        "acts on; remove it",
                    )
                )
        return issues

    def latent_cache_key(self, model_spec, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """Each clip's sound latents (the audio VAE's, of its log-mel) beside its posterior, silence's where it has
        none, with has_sound saying which."""
        return "sound: audio_vae latents", ("audio_vae",), SOUND_TENSORS

    # ---------------------------------------------------------------------------------------- memory

    def token_factors(self, folder):
        return token_factors(folder)

    def clip_activation_bytes(self, spec, folder, frames: int, width: int, height: int):
        return sample_bytes(spec, folder, frames, width, height)

    def cache_bytes(self, spec, folder, companions: dict, num_samples: int, clips) -> int:
        return cache_bytes(spec, folder, companions, num_samples, clip_buckets(spec, num_samples, clips))

    def model_spec_issues(self, spec, folder) -> SpecIssues:
        """Image-to-video's first frames and split (or no first frames for text-to-video), IC-LoRA's references
        (ic_lora_issues), clips whose sound cannot follow their frames (uniform sampling), data.sets (not yet). The
        frame counts its VAE takes (8k+1) are the core's check of its clip rule (VideoCard.frame_issues)."""
        issues = image_to_video_issues(spec) + ic_lora_issues(spec)
        issues += sets_issues(spec.data)
        for prefix, section in set_videos(spec.data):
            if section.sampling == "uniform" and section.max_frames > 1:
                issues.append(
                    (
                        f"{prefix}.sampling",
                        "uniform spreads a clip's frames over the whole video, so the clip's sound (which LTX-2 trains "
                        "on) cannot follow them: use head or sliding",
                    )
                )
        return issues

    def split_attention(self, folder) -> Optional[Attention]:
        """The video heads a sequence-parallel split divides (its plan is dstune's: dstune.models.ltx2.split). The
        caption and the audio stream stay whole on every rank, so they set no rule on N."""
        config = folder.config("transformer")
        if not isinstance(config.get("num_attention_heads"), int):
            return None
        return Attention(
            config["num_attention_heads"],
            config.get("attention_head_dim", 0),
            f"the transformer config of {folder.origin}",
        )


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLLTX2Video": VaeWork(
        encode=1.25,
        encode_frame=1.0,
        decode=0.337,
        decode_frame=0.317,
        decode_fixed=1260.0,
        measured_on="hub/Lightricks/LTX-2/vae",
    ),
    "Gemma3ForConditionalGeneration": TextWork(
        hidden=8.0, ffn=6.0, token=23.3, square=0.843, pass_square=0.27, measured_on="builtin/tiny-ltx2-v1/text_encoder"
    ),
    "Gemma4UnifiedForConditionalGeneration": TextWork(
        hidden=648.532, token=871.2, pass_square=11.687, measured_on="builtin/tiny-ltx2-5-v1/text_encoder"
    ),
}


LTX2_CARD = Ltx2Card(
    working=WORKING_MEMORY,
    guidance_batch=2,  # LTX2Pipeline: guidance's two halves in one batch
    key="ltx2",
    name="LTX-2",
    family="video",
    unit="ltx2",
    model_class="dstune.models.ltx2.model:Ltx2",
    docs="docs/family-ltx2.md",
    names=r"ltx\w*",
    summary="LTX-2, 2.3 and 2.5 (LTX2VideoTransformer3DModel, Gemma 3 or 4 with its text connectors): text- and "
    "image-to-video "
    "(model.image_to_video), audio+video on clips with sound",
    folder_classes={PIPELINE: 3.0},
    transformer_class="LTX2VideoTransformer3DModel",
    pipeline_class=PIPELINE,
    components={
        "transformer": "LTX2VideoTransformer3DModel",
        "vae": "AutoencoderKLLTX2Video",
        "audio_vae": "AutoencoderKLLTX2Audio",
        "text_encoder": None,  # one of TEXT_ENCODERS (class_problems), loaded as the folder lists it
        "tokenizer": None,
        "connectors": "LTX2TextConnectors",
        "vocoder": None,  # one of VOCODERS
        "scheduler": None,
    },
    vae_class="AutoencoderKLLTX2Video",
    text_tensors=TEXT_TENSORS,
    text_cache_folders=("text_encoder", "tokenizer", "connectors"),  # Gemma and the connectors after it
    default_text_tokens=DEFAULT_TEXT_TOKENS,
    posterior_mode=True,  # ltx-trainer's video encoder returns the normalised means
    draws_sigma=True,
    # the cache holds the connectors' outputs: the class hands the pipeline a stand-in for its connectors
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states", "prompt_attention_mask": "encoder_attention_mask"},
    sampling_parts=("vocoder",),  # loaded for the pipeline that renders samples only (the audio VAE encodes the sound)
    spec_notes={"model.max_sequence_length": "1024 (LTX-2: Gemma 3 tokens)"},
    activation_cases="dstune.models.ltx2.builtin:ACTIVATION_CASES",
    builtins={
        "tiny-ltx2": "dstune.models.ltx2.builtin:TINY_LTX2",
        "tiny-ltx2-3": "dstune.models.ltx2.builtin:TINY_LTX23",
        "tiny-ltx2-5": "dstune.models.ltx2.builtin:TINY_LTX25",
    },
    presets=(
        ModelPreset(
            "ltx2",
            "LTX-2 text-to-video with sound (19 B audio+video transformer; Gemma 3 12B)",
            "video",
            "Lightricks/LTX-2",
            "tiny-ltx2",
            video(512, 121, 24, 3.0, **lora(), **{"model.timestep_sampling": "shifted_logit_normal"}),
        ),
        ModelPreset(
            "ltx2-3",
            "LTX-2.3 text-to-video with sound (audio+video transformer with per-modality text projections; Gemma 3 12B)",
            "video",
            "Lightricks/LTX-2.3",
            "tiny-ltx2-3",
            video(
                512,
                121,
                24,
                3.0,
                **lora(),
                **{"model.timestep_sampling": "shifted_logit_normal", "deepspeed.zero_stage": 3},
            ),
        ),
    ),
)
