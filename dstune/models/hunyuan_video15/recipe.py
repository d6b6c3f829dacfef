"""The HunyuanVideo 1.5 recipe of the flow-matching core (dstune.families.flow_recipe; the video family, chosen by
the folder's transformer class, HunyuanVideo15Transformer3DModel).

- latents: clips (B, 3, frames, H, W) in [-1, 1] through AutoencoderKLHunyuanVideo15 (16x spatial, 4x temporal, 32
  channels) times the VAE config's scaling_factor (as the pipeline divides by it before decoding); patch 1x1x1;
- text: HunyuanVideo15Pipeline.encode_prompt: Qwen2.5-VL's third hidden state from the end over the chat template,
  the template's first 108 tokens cropped, padded to max_sequence_length (the pipeline's 1000) with its mask; and
  the ByT5 glyph encoder over the quoted text of the caption (zeros and an empty mask when it quotes none), 256
  tokens: four tensors per caption, all of them cached by data.cache.text_embeddings;
- the transformer reads cat([x_t, condition latents, mask]) and a SigLIP image embedding: text-to-video gives zeros
  for all three, as HunyuanVideo15Pipeline does; image-to-video (HunyuanVideo15ImageToVideoPipeline folders) the
  first frame's (dstune.models.hunyuan_video15.i2v);
- tables: a FlowMatchEulerDiscreteScheduler with shift 3.0 (the official trainer's train_timestep_shift; the
  folder's scheduler shift, 5.0 to 9.0, is its sampling shift), model.shift replaces it;
- samples: the folder's pipeline with its ClassifierFreeGuidance guider at sample.guidance.

Differences from the official trainer's loss are listed in docs/family-hunyuan-video15.md; the parity test
is tests/unit/test_hunyuan15_loss_parity.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from dstune.models.hunyuan_video15 import i2v as hunyuan15_i2v
from dstune.models.hunyuan_video15 import split as hunyuan15_split
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.flow_recipe import Conditioning, FlowRecipe, LatentSpace, Sampling, TextSide
from dstune.hf import quiet_hf_libraries
from dstune.spec.video_models import expert_problems

TRANSFORMER_CLASS = "HunyuanVideo15Transformer3DModel"
COMPONENTS = {
    "transformer": TRANSFORMER_CLASS,
    "vae": "AutoencoderKLHunyuanVideo15",
    "text_encoder": "Qwen2_5_VLTextModel",
    "text_encoder_2": "T5EncoderModel",
    "tokenizer_2": None,
    "tokenizer": None,
    "scheduler": None,
    "guider": "ClassifierFreeGuidance",
}
TEXT_TENSORS = (
    "encoder_hidden_states",
    "encoder_attention_mask",
    "encoder_hidden_states_2",
    "encoder_attention_mask_2",
)
DEFAULT_MAX_SEQUENCE_LENGTH = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length (after the template's crop)
VISION_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: SigLIP's 27 x 27 patches
TRAIN_SHIFT = 3.0  # the official train.py's --train_timestep_shift default


# ------------------------------------------------------------------------------------------ the folder


def config_mismatches(folder: Path) -> list[str]:
    """Which config values of a HunyuanVideo 1.5 folder's parts disagree (channels and text widths)."""
    transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
    text, glyph = read_component_config(folder, "text_encoder"), read_component_config(folder, "text_encoder_2")
    channels = vae.get("latent_channels")
    problems = []
    if channels is not None and transformer.get("in_channels") != 2 * channels + 1:
        problems.append(
            f"transformer in_channels {transformer.get('in_channels')} != 2 x the VAE's latent_channels "
            f"{channels} + 1 (noisy latents, condition latents, mask)"
        )
    if channels is not None and transformer.get("out_channels") != channels:
        problems.append(
            f"transformer out_channels {transformer.get('out_channels')} != the VAE's latent_channels {channels}"
        )
    if transformer.get("text_embed_dim") != text.get("hidden_size"):
        problems.append(
            f"transformer text_embed_dim {transformer.get('text_embed_dim')} != the text encoder's "
            f"hidden_size {text.get('hidden_size')}"
        )
    if transformer.get("text_embed_2_dim") != glyph.get("d_model"):
        problems.append(
            f"transformer text_embed_2_dim {transformer.get('text_embed_2_dim')} != the glyph encoder's "
            f"d_model {glyph.get('d_model')}"
        )
    return problems


def folder_problems(
    folder: Path, expert: Optional[str] = None, image_to_video: Optional[bool] = None, timestep_range=None
) -> list[str]:
    """Why `folder` is not a HunyuanVideo 1.5 pipeline folder dstune trains with these model keys (empty: it is)."""
    index = read_model_index(folder)
    problems = expert_problems(index, expert, timestep_range)
    components = {**COMPONENTS, **(hunyuan15_i2v.COMPONENTS if hunyuan15_i2v.is_image_to_video(folder) else {})}
    problems += component_problems(folder, index, components)
    if not problems:
        problems += config_mismatches(folder)
    mode = hunyuan15_i2v.mode_problem(folder, image_to_video)
    return problems + ([mode] if mode else [])


def train_tables(scheduler, shift: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps, sigmas) u indexes: FlowMatchEulerDiscreteScheduler's 1000-entry tables with `shift` (the
    official trainer's 3.0 when None), not the folder scheduler's sampling shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    table = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=scheduler.config.num_train_timesteps, shift=TRAIN_SHIFT if shift is None else float(shift)
    )
    return table.timesteps.clone().float(), table.sigmas.clone().float()


# ------------------------------------------------------------------------------------------ text, prediction


def _captions(pipeline, built, captions: list[str]) -> dict:
    """The four text tensors of HunyuanVideo15Pipeline.encode_prompt, with the Qwen side padded to
    max_sequence_length."""
    pipeline.tokenizer_max_length = built.max_sequence_length
    with torch.no_grad(), quiet_hf_libraries():
        embeds, mask, embeds_2, mask_2 = pipeline.encode_prompt(
            list(captions), device=built.device, batch_size=len(captions)
        )
    return dict(zip(TEXT_TENSORS, (embeds, mask, embeds_2, mask_2)))


def condition_inputs(built, noisy: torch.Tensor, conditions: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the transformer's hidden states: cat([x_t, condition latents, mask]), the image embedding): the
    conditioning's where it gave them, else zeros (text-to-video, as HunyuanVideo15Pipeline feeds them)."""
    batch, channels, frames, height, width = noisy.shape
    condition = conditions.get("condition_latents")
    if condition is None:
        condition = noisy.new_zeros(batch, channels + 1, frames, height, width)
    image_embeds = conditions.get("image_embeds")
    if image_embeds is None:
        image_embeds = noisy.new_zeros(batch, VISION_TOKENS, built.transformer_config["image_embed_dim"])
    return torch.cat([noisy, condition.to(noisy.dtype)], dim=1), image_embeds


def _predict(built, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
    hidden, image_embeds = condition_inputs(built, noisy, conditions)
    return forward(
        hidden_states=hidden.to(dtype),
        timestep=timesteps.to(dtype),
        encoder_hidden_states=conditions["encoder_hidden_states"].to(dtype),
        encoder_attention_mask=conditions["encoder_attention_mask"],
        encoder_hidden_states_2=conditions["encoder_hidden_states_2"].to(dtype),
        encoder_attention_mask_2=conditions["encoder_attention_mask_2"],
        image_embeds=image_embeds.to(dtype),
        return_dict=False,
    )[0]


# ------------------------------------------------------------------------------------------ sampling


def _call_arguments(built, pipeline, sample_spec, arguments: dict) -> dict:
    """HunyuanVideo15Pipeline takes neither max_sequence_length nor guidance_scale: the Qwen length is its
    tokenizer_max_length, the guidance its guider's (rebuilt at sample.guidance from the folder's guider). The
    image-to-video pipeline takes no size either: it renders at the transformer's target_size in the first frame's
    aspect ratio."""
    pipeline.tokenizer_max_length = built.max_sequence_length
    if sample_spec.guidance is not None:
        pipeline.guider = type(pipeline.guider).from_config(
            {**pipeline.guider.config, "guidance_scale": float(sample_spec.guidance)}
        )
    dropped = ("max_sequence_length", "guidance_scale") + (("height", "width") if built.mode else ())
    return {k: v for k, v in arguments.items() if k not in dropped}


def _cached_text(built, pipeline, prompt: dict, negative: dict) -> dict:
    """The prompt's (and the empty negative's) four cached tensors as HunyuanVideo15Pipeline's embedding arguments."""
    names = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    return {
        **{name: prompt[tensor] for name, tensor in zip(names, TEXT_TENSORS)},
        **{f"negative_{name}": negative[tensor] for name, tensor in zip(names, TEXT_TENSORS)},
    }


def _pipeline(built, transformer) -> tuple:
    """The folder's pipeline class with its guider; the VAE always (the pipeline's constructor reads its config,
    even for the text-only pipeline encode_prompt runs on)."""
    import diffusers

    return getattr(diffusers, built.recipe.pipeline_class), {**built.parts, "vae": built.vae}


HUNYUAN_VIDEO15 = FlowRecipe(
    kind="hunyuan_video15",
    transformer_class=TRANSFORMER_CLASS,
    pipeline_class="HunyuanVideo15Pipeline",
    components=COMPONENTS,
    text=TextSide(TEXT_TENSORS, _captions, lambda built: built.max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH),
    predict=_predict,
    config_mismatches=config_mismatches,
    latents=LatentSpace(
        vae_class="AutoencoderKLHunyuanVideo15",
        frames=True,
        patch=lambda built: (built.transformer_config["patch_size"],) * 2,
        spatial_factor=lambda vae_config: vae_config.spatial_compression_ratio,
    ),
    conditioning=Conditioning(
        load=hunyuan15_i2v.load,
        encode=hunyuan15_i2v.encode_conditions,
        model_inputs=hunyuan15_i2v.model_inputs,
        sample_sources=hunyuan15_i2v.sample_sources,
    ),
    sampling=Sampling(
        options=lambda built, sample_spec, prompts: {},
        pipeline=_pipeline,
        call=_call_arguments,
        cached_text=_cached_text,
        side_multiple=lambda built: built.vae.config.spatial_compression_ratio * built.transformer_config["patch_size"],
    ),
    train_tables=train_tables,
    sequence_split=hunyuan15_split.prepare_split,  # diffusers 0.42 gives the class no context-parallel plan
    preconditioned=lambda model: False,  # the velocity loss of the official trainer
    # HunyuanVideo15Pipeline has no LoRA loader in diffusers 0.42: the file is written as HunyuanVideoPipeline's
    # (HunyuanVideoLoraLoaderMixin: "transformer."-prefixed PEFT keys), which transformer.load_lora_adapter reads
    lora_class="HunyuanVideoPipeline",
)

HUNYUAN_VIDEO15_I2V = replace(
    HUNYUAN_VIDEO15,
    kind="hunyuan_video15_i2v",
    pipeline_class=hunyuan15_i2v.PIPELINE,
    components={**COMPONENTS, **hunyuan15_i2v.COMPONENTS},
)


def recipe_of(folder: Path) -> FlowRecipe:
    """The recipe of a HunyuanVideo 1.5 folder: text-to-video or image-to-video, by its pipeline class."""
    return HUNYUAN_VIDEO15_I2V if hunyuan15_i2v.is_image_to_video(folder) else HUNYUAN_VIDEO15
