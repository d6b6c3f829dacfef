"""The LTX-2 recipe of the flow-matching core (dstune.families.flow_recipe; the video family, chosen by the folder's
transformer class, LTX2VideoTransformer3DModel): text- and image-to-video, audio+video on clips with sound.

- latents: clips (B, 3, frames, H, W) in [-1, 1] through AutoencoderKLLTX2Video (32x spatial, 8x temporal, 128
  channels); the posterior's mean (ltx-trainer's video encoder returns the normalised means), normalised per channel
  with the VAE's latents_mean / latents_std buffers and scaling_factor as LTX2Pipeline normalises them; packed into
  (B, F x H x W, C) tokens (patch 1x1x1);
- text: LTX2Pipeline.encode_prompt (every Gemma 3 hidden state stacked, left-padded to max_sequence_length, 1024 by
  default), then the folder's LTX2TextConnectors: the video and audio text embeddings and their mask, the three
  tensors data.cache.text_embeddings stores (the connectors are frozen, as in ltx-trainer, which caches their
  outputs too);
- sound (SOUND, the core's second latent stream): the clip's sound track at the audio VAE's rate, its log-mel
  (dstune.models.ltx2.audio), the audio VAE posterior's means packed (B, T, C x M) and normalised per feature;
  noised at the clip's sigma with noise of its own, target noise - x0, its mean squared error added per sample;
- the transformer is fed the video tokens with the timestep sigma x 1000 (its timestep_scale_multiplier) and the
  RoPE coordinates of (num_frames, height, width) at 24 fps; a clip with sound also its audio tokens at the same
  timestep, with cross-modal attention; a clip without gets one zero audio token and isolate_modalities (no
  cross-modal attention), which is what ltx-trainer's transformer runs without an audio modality;
- sigma is drawn continuously as ltx-trainer's samplers draw it (shifted_logit_normal: a logit-normal whose mean
  follows the clip's token count, stretched to [0, 1], with 10% uniform draws; uniform), each sample from its own
  generator; x_t = (1 - sigma) x0 + sigma noise, target noise - x0, the squared error averaged per sample;
- image-to-video (model.image_to_video: true): the clip's first latent frame given clean at timestep 0, the loss over
  the other frames, as ltx-trainer's first-frame conditioning (dstune.models.ltx2.i2v);
- samples: the folder's LTX2Pipeline (LTX2ImageToVideoPipeline from sample.control_images for image-to-video), saved
  with the sound its vocoder renders.

Differences from ltx-trainer's loss are listed in docs/family-ltx2.md; the parity test is tests/unit/test_ltx2.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from dstune.families.diffusion import load_component
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.flow_recipe import (
    Conditioning,
    FlowRecipe,
    LatentSpace,
    Sampling,
    SoundStream,
    TextSide,
    load_text_side,
)
from dstune.families.randomness import sample_generator
from dstune.hf import quiet_hf_libraries
from dstune.models.ltx2 import i2v as ltx2_i2v
from dstune.models.ltx2 import split as ltx2_split
from dstune.models.ltx2.audio import audio_tokens, sound_latents
from dstune.spec.video_models import expert_problems

TRANSFORMER_CLASS = "LTX2VideoTransformer3DModel"
PIPELINE = "LTX2Pipeline"
COMPONENTS = {
    "transformer": TRANSFORMER_CLASS,
    "vae": "AutoencoderKLLTX2Video",
    "audio_vae": "AutoencoderKLLTX2Audio",
    "text_encoder": "Gemma3ForConditionalGeneration",
    "tokenizer": None,
    "connectors": "LTX2TextConnectors",
    "vocoder": "LTX2Vocoder",
    "scheduler": None,
}
TEXT_TENSORS = ("encoder_hidden_states", "audio_encoder_hidden_states", "encoder_attention_mask")
DEFAULT_MAX_SEQUENCE_LENGTH = 1024  # LTX2Pipeline's max_sequence_length default
DEFAULT_FPS = 24.0  # ltx-trainer's frame rate for latents without one (RoPE's time axis is in seconds)
# ltx-trainer's ShiftedLogitNormalTimestepSampler: the logit mean goes linearly from 0.95 at 1024 video tokens to
# 2.05 at 4096; draws are stretched between the normal's 0.5th and 99.9th percentiles, reflected at eps, and
# replaced by uniform ones with probability 0.1
SHIFT_TOKENS, SHIFT_VALUES = (1024, 4096), (0.95, 2.05)
PERCENTILE_LOW, PERCENTILE_HIGH = -2.5758, 3.0902
SIGMA_EPS, UNIFORM_PROBABILITY = 1e-3, 0.1


# ------------------------------------------------------------------------------------------ the folder


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


def folder_problems(
    folder: Path, expert: Optional[str] = None, image_to_video: Optional[bool] = None, timestep_range=None
) -> list[str]:
    """Why `folder` is not an LTX-2 pipeline folder dstune trains with these model keys (empty: it is)."""
    index = read_model_index(folder)
    problems = expert_problems(index, expert, timestep_range)
    if index.get("_class_name") != PIPELINE:
        problems.append(f"a {index.get('_class_name')}: dstune trains LTX-2 text-to-video from {PIPELINE} folders")
    problems += component_problems(folder, index, COMPONENTS)
    if not problems:
        problems += config_mismatches(folder)
    return problems


def settings_problems(model) -> list[str]:
    """The model keys LTX-2's sigma draws do not use: refused rather than ignored."""
    problems = []
    if model.timestep_sampling not in ("shifted_logit_normal", "uniform"):
        problems.append(
            f"model.timestep_sampling {model.timestep_sampling!r}: LTX-2 draws sigma as ltx-trainer does: "
            "shifted_logit_normal (its default) or uniform"
        )
    for key in ("shift", "timestep_range"):
        if getattr(model, key) is not None:
            problems.append(
                f"model.{key}: LTX-2 draws sigma directly (model.timestep_sampling), without the "
                "scheduler's tables this key acts on; remove it"
            )
    return problems


# ------------------------------------------------------------------------------------------ parts


def load_text(folder: Path, recipe: FlowRecipe, device, dtype) -> tuple[dict, dict]:
    """Gemma 3 and its tokenizer (as the recipe lists them), and the text connectors beside them: frozen, so the
    text cache can store their outputs."""
    with quiet_hf_libraries():
        from diffusers.pipelines.ltx2 import LTX2TextConnectors

    encoders, tokenizers = load_text_side(folder, recipe, device, dtype)
    connectors = load_component(folder, "connectors", LTX2TextConnectors.from_pretrained, torch_dtype=dtype)
    encoders["connectors"] = connectors.to(device).eval().requires_grad_(False)
    return encoders, tokenizers


def load_audio_parts(folder: Path, model, transformer_config, device, dtype) -> tuple[dict, bool]:
    """The audio VAE and the vocoder (frozen): the pipeline that renders samples needs both; the mode: whether the
    run trains image-to-video (model.image_to_video, dstune.models.ltx2.i2v)."""
    with quiet_hf_libraries():
        from diffusers import AutoencoderKLLTX2Audio
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    parts = {
        "audio_vae": load_component(folder, "audio_vae", AutoencoderKLLTX2Audio.from_pretrained, torch_dtype=dtype),
        "vocoder": load_component(folder, "vocoder", LTX2Vocoder.from_pretrained, torch_dtype=dtype),
    }
    frozen = {name: part.to(device).eval().requires_grad_(False) for name, part in parts.items()}
    return frozen, bool(model.image_to_video)


# ------------------------------------------------------------------------------------------ text, latents


def _captions(pipeline, built, captions: list[str]) -> dict:
    """The connectors' video and audio text embeddings and mask of LTX2Pipeline's Gemma 3 prompt embeds."""
    with torch.no_grad(), quiet_hf_libraries():
        embeds, mask, _, _ = pipeline.encode_prompt(
            list(captions),
            do_classifier_free_guidance=False,
            max_sequence_length=built.max_sequence_length,
            device=built.device,
        )
        video, audio, mask = pipeline.connectors(embeds, mask, padding_side=pipeline.tokenizer.padding_side)
    return dict(zip(TEXT_TENSORS, (video, audio, mask)))


def to_model(built, latents: torch.Tensor) -> torch.Tensor:
    """(latents - latents_mean) x scaling_factor / latents_std per channel: LTX2Pipeline._normalize_latents with
    the VAE's own statistics (buffers of the VAE, not config values)."""
    shape = (1, -1) + (1,) * (latents.ndim - 2)
    mean = built.vae.latents_mean.view(shape).to(latents.device, latents.dtype)
    std = built.vae.latents_std.view(shape).to(latents.device, latents.dtype)
    return (latents - mean) * built.vae.config.scaling_factor / std


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, F x H x W, C): LTX-2's 1x1x1 patches, frame-major as the pipeline packs them."""
    return latents.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return tokens.transpose(1, 2).reshape(like.shape)


# ------------------------------------------------------------------------------------------ sigma draws


def shifted_logit_normal(tokens: int, normal: torch.Tensor, uniform: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """ltx-trainer's shifted logit-normal sigma of standard normal, uniform [0, 1) and mixing draws (one each per
    sample), for a clip of `tokens` video tokens."""
    slope = (SHIFT_VALUES[1] - SHIFT_VALUES[0]) / (SHIFT_TOKENS[1] - SHIFT_TOKENS[0])
    mean = SHIFT_VALUES[0] + slope * (tokens - SHIFT_TOKENS[0])
    low, high = torch.sigmoid(torch.tensor(mean + PERCENTILE_LOW)), torch.sigmoid(torch.tensor(mean + PERCENTILE_HIGH))
    stretched = (torch.sigmoid(normal + mean) - low) / (high - low)
    stretched = torch.where(stretched >= SIGMA_EPS, stretched, 2 * SIGMA_EPS - stretched).clamp(0, 1)
    return torch.where(mix > UNIFORM_PROBABILITY, stretched, (1 - SIGMA_EPS) * uniform + SIGMA_EPS)


def draw_sigmas(built, latents: torch.Tensor, seed: int, step: int, indices: list[int]) -> torch.Tensor:
    """Each sample's sigma, from its own generators: model.timestep_sampling shifted_logit_normal (ltx-trainer's
    default) or uniform (its uniform sampler: sigma = u)."""

    def draws(purpose: str, normal: bool = False) -> torch.Tensor:
        make = torch.randn if normal else torch.rand
        return torch.cat([make((1,), generator=sample_generator(seed, step, i, purpose)) for i in indices])

    if built.settings.timestep_sampling == "uniform":  # build refused the others (settings_problems)
        return draws("timestep")
    tokens = latents.shape[2] * latents.shape[3] * latents.shape[4]
    return shifted_logit_normal(
        tokens, draws("timestep", normal=True), draws("timestep_uniform"), draws("timestep_mix")
    )


# ------------------------------------------------------------------------------------------ prediction


def _forward(built, forward, noisy, timesteps, conditions: dict, dtype, audio: Optional[torch.Tensor] = None):
    """The transformer on the packed clip and `audio` tokens (B, T, D), every token at the clip's timestep (in
    image-to-video the first frame's clean, at 0: ltx2_i2v.conditioned); without audio the audio stream runs on one
    zero token, cut off from the video (isolate_modalities). Returns (video velocity in the latent layout, audio
    velocity tokens)."""
    batch, _, frames, height, width = noisy.shape
    isolated = audio is None
    if isolated:
        audio = noisy.new_zeros(batch, 1, built.transformer_config["audio_in_channels"])
    noisy, video_timesteps = ltx2_i2v.conditioned(built, noisy, timesteps, conditions)
    timesteps = timesteps.to(dtype)
    video, audio_velocity = forward(
        hidden_states=pack(noisy).to(dtype),
        audio_hidden_states=audio.to(dtype),
        encoder_hidden_states=conditions["encoder_hidden_states"].to(dtype),
        audio_encoder_hidden_states=conditions["audio_encoder_hidden_states"].to(dtype),
        timestep=video_timesteps.to(dtype),
        audio_timestep=timesteps,
        sigma=timesteps,
        encoder_attention_mask=conditions["encoder_attention_mask"],
        audio_encoder_attention_mask=conditions["encoder_attention_mask"],
        num_frames=frames,
        height=height,
        width=width,
        fps=DEFAULT_FPS,
        audio_num_frames=audio.shape[1],
        isolate_modalities=isolated,
        return_dict=False,
    )
    return unpack(video, noisy), audio_velocity


def _predict(built, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
    """A clip without sound: the video velocity, the audio stream cut off."""
    return _forward(built, forward, noisy, timesteps, conditions, dtype)[0]


def _predict_with_sound(built, forward, noisy, timesteps, conditions: dict, noisy_sound, dtype):
    """A clip with sound: both streams in one call, with audio-to-video and video-to-audio attention."""
    return _forward(built, forward, noisy, timesteps, conditions, dtype, audio=noisy_sound)


def _rendered_sound(built, result) -> tuple:
    """The vocoder's waveform of the rendered clip, its output rate, and the frame rate the clip was rendered at."""
    rate = built.parts["vocoder"].config.output_sampling_rate
    return result.audio[0].float().cpu().numpy(), rate, DEFAULT_FPS


SOUND = SoundStream(
    rate=lambda built: built.parts["audio_vae"].config.sample_rate,
    encode=lambda built, sound: sound_latents(built.parts["audio_vae"], sound),
    to_tokens=lambda built, latents: audio_tokens(built.parts["audio_vae"], latents),
    predict=_predict_with_sound,
    parts=("audio_vae",),
    rendered=_rendered_sound,
)


class CachedConnectors(torch.nn.Module):
    """Stands in for the pipeline's text connectors on a rank without the text side: their cached outputs (what
    the text cache stores) for the prompt, or under guidance for ("" , prompt), in the order the pipeline
    concatenates its negative and positive embeddings. What it is given in their place is not read."""

    def __init__(self, prompt: dict, negative: dict):
        super().__init__()
        self.prompt, self.negative = prompt, negative

    @property
    def device(self) -> torch.device:  # what the pipeline asks of each of its modules
        return self.prompt[TEXT_TENSORS[0]].device

    @property
    def dtype(self) -> torch.dtype:
        return self.prompt[TEXT_TENSORS[0]].dtype

    def forward(self, embeds, mask, padding_side: str = "left") -> tuple:
        order = [self.negative, self.prompt] if embeds.shape[0] == 2 else [self.prompt]
        return tuple(torch.cat([tensors[name] for tensors in order]) for name in TEXT_TENSORS)


def _cached_text(built, pipeline, prompt: dict, negative: dict) -> dict:
    """LTX2Pipeline runs Gemma's stacked hidden states through its connectors; the cache holds the connectors'
    outputs, so the pipeline gets a stand-in for them and a placeholder of the embeddings' batch (never read)."""
    object.__setattr__(pipeline, "connectors", CachedConnectors(prompt, negative))  # not a folder component
    placeholder = {"prompt_embeds": prompt["encoder_hidden_states"], "prompt_attention_mask": prompt[TEXT_TENSORS[2]]}
    return {**placeholder, **{f"negative_{name}": value for name, value in placeholder.items()}}


def _call_arguments(built, pipeline, sample_spec, arguments: dict) -> dict:
    """The frame rate RoPE was trained at; the rest as the core passes it."""
    return {**arguments, "frame_rate": DEFAULT_FPS}


LTX2 = FlowRecipe(
    kind="ltx2",
    transformer_class=TRANSFORMER_CLASS,
    pipeline_class=PIPELINE,
    components=COMPONENTS,
    text=TextSide(
        TEXT_TENSORS, _captions, lambda built: built.max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH, load=load_text
    ),
    predict=_predict,
    config_mismatches=config_mismatches,
    latents=LatentSpace(
        vae_class="AutoencoderKLLTX2Video",
        frames=True,
        patch=lambda built: (1, 1),
        spatial_factor=lambda vae_config: vae_config.spatial_compression_ratio or 32,
        posterior_mode=True,
        to_model=to_model,
    ),
    conditioning=Conditioning(
        load=load_audio_parts,
        model_inputs=ltx2_i2v.model_inputs,
        clean_frames=ltx2_i2v.clean_frames,
        sample_sources=ltx2_i2v.sample_sources,
    ),
    sampling=Sampling(
        pipeline=ltx2_i2v.pipeline,
        call=_call_arguments,
        cached_text=_cached_text,
        side_multiple=lambda built: built.vae.spatial_compression_ratio,
    ),
    draw_sigmas=draw_sigmas,
    sequence_split=ltx2_split.prepare_split,  # diffusers 0.42's plan splits the masked caption, which fails
    preconditioned=lambda model: False,
    sound=SOUND,
)  # ltx-trainer's velocity loss
