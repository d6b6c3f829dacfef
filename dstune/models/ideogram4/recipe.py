"""The flow family's Ideogram 4 recipe (dstune.families.flow_recipe), as diffusers'
examples/dreambooth/train_dreambooth_lora_ideogram4.py feeds Ideogram4Transformer2DModel:

- text: Ideogram4Pipeline.encode_prompt (the caption in the Qwen3-VL chat format, left-padded to
  max_sequence_length, the hidden states of 13 text layers concatenated per token, padding zeroed), encoded for an
  empty image grid so that a caption's tensors have one shape (the text cache); the mask marks its tokens, and the
  position, segment and indicator ids are rebuilt from it for each batch's grid with the pipeline's _prepare_ids;
- latents: the AutoencoderKLFlux2 posterior's mode, cut into 2x2 patches in the example's channel order (row,
  column, then VAE channel) and normalised with the VAE's batch-norm statistics: the model space is
  (B, 4C, H/2, W/2), where noise, x_t and the target live;
- sigma is drawn continuously (no scheduler table): logit-normal with the mean shifted by half the log of the
  image's pixels over 512^2 and a standard deviation of 1.5 unless the spec sets them;
- the transformer sees [zeros over the text positions | the noisy image tokens], the text features over
  [text | zeros], the model time 1 - sigma, and predicts x0 - noise, the negative velocity: predict negates it.

Samples render with Ideogram4Pipeline, whose asymmetric guidance needs the folder's frozen
`unconditional_transformer`: it is loaded only while samples render.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component
from dstune.families.flow_matching import timestep_density
from dstune.families.flow_recipe import (
    FlowRecipe,
    LatentSpace,
    Sampling,
    TextSide,
    fixed_patch,
    read_config,
    vae_spatial_factor,
)
from dstune.hf import quiet_hf_libraries

TEXT_TENSORS = ("encoder_hidden_states", "encoder_attention_mask")
TAPPED_LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 35)  # the pipeline's QWEN3_VL_ACTIVATION_LAYERS
LOGIT_STD = 1.5  # the example's --logit_std default (the pipeline's schedule std)
BASE_PIXELS = 512 * 512  # the resolution the example's logit mean is given for


def _pipeline_class():
    with quiet_hf_libraries():
        from diffusers import Ideogram4Pipeline
    return Ideogram4Pipeline


def _mismatches(folder: Path) -> list[str]:
    transformer, vae = read_config(folder, "transformer"), read_config(folder, "vae")
    text = read_config(folder, "text_encoder")
    text = text.get("text_config", text)
    checks = [
        ("in_channels", 4 * vae.get("latent_channels", 32)),
        ("llm_features_dim", len(TAPPED_LAYERS) * text.get("hidden_size", 0)),
    ]
    problems = [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
        for key, want in checks
        if transformer.get(key) != want
    ]
    if text.get("num_hidden_layers", 0) <= max(TAPPED_LAYERS):
        problems.append(
            f"text_encoder has {text.get('num_hidden_layers')} layers; the pipeline reads the hidden "
            f"states of layers {', '.join(map(str, TAPPED_LAYERS))}"
        )
    unconditional = read_config(folder, "unconditional_transformer")
    for key in ("in_channels", "llm_features_dim"):
        if unconditional.get(key) != transformer.get(key):
            problems.append(
                f"unconditional_transformer {key} {unconditional.get(key)} != the transformer's {transformer.get(key)}"
            )
    return problems


def _caption_tokens(pipeline, caption: str) -> int:
    """A caption's tokens as Ideogram4Pipeline.encode_prompt counts them: in the chat format, generation prompt on."""
    messages = [{"role": "user", "content": [{"type": "text", "text": caption}]}]
    text = pipeline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(pipeline.tokenizer(text, add_special_tokens=False)["input_ids"])


def _captions(pipeline, built, captions: list[str]) -> dict:
    from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR

    limit = built.max_sequence_length
    for caption in captions:  # the pipeline's own refusal names neither the caption nor the setting
        tokens = _caption_tokens(pipeline, caption)
        if tokens > limit:
            raise FamilyError(
                f"the caption {caption[:80]!r}{'...' if len(caption) > 80 else ''} is {tokens} tokens "
                f"in Ideogram 4's chat format, more than model.max_sequence_length {limit} (every "
                "caption is left-padded to it): raise model.max_sequence_length (the training example "
                "uses 2048) or shorten the caption"
            )
    with torch.no_grad(), quiet_hf_libraries():
        embeds, _, _, indicator = pipeline.encode_prompt(
            list(captions), grid_h=0, grid_w=0, device=built.device, max_sequence_length=limit
        )
    return {"encoder_hidden_states": embeds, "encoder_attention_mask": (indicator == LLM_TOKEN_INDICATOR).long()}


def _model_latents(built, sample: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) posterior mode -> (B, 4C, H/2, W/2): channel (row * 2 + column) * C + c, as the example packs a
    token's features, normalised per channel with the VAE's batch-norm statistics."""
    batch, channels, height, width = sample.shape
    patches = sample.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 3, 5, 1, 2, 4)
    patches = patches.reshape(batch, 4 * channels, height // 2, width // 2)
    bn = built.vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1).to(sample.device, sample.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + built.vae.config.batch_norm_eps).to(sample.device, sample.dtype)
    return (patches - mean) / std


def _sigmas(built, latents: torch.Tensor, seed: int, step: int, indices: list[int]) -> torch.Tensor:
    """The example's sigma per sample, drawn by compute_density_for_timestep_sampling with each sample's generator:
    logit-normal about logit_mean + 0.5 log(pixels / 512^2) (the pipeline's resolution-aware mean) with logit_std
    1.5 unless set; uniform and mode as in the other examples."""
    settings = built.settings
    pixels = (latents.shape[-2] * latents.shape[-1]) * (2 * vae_spatial_factor(built.vae.config)) ** 2
    mean = (settings.logit_mean or 0.0) + 0.5 * math.log(pixels / BASE_PIXELS)
    std = LOGIT_STD if settings.logit_std is None else settings.logit_std
    return timestep_density(settings.model_copy(update={"logit_mean": mean, "logit_std": std}), seed, step, indices)


def _predict(built, forward, noisy, timesteps, text: dict, dtype) -> torch.Tensor:
    batch, features, rows, columns = noisy.shape
    embeds, mask = text["encoder_hidden_states"], text["encoder_attention_mask"]
    length, images = embeds.shape[1], rows * columns
    position_ids, segment_ids, indicator = _pipeline_class()._prepare_ids(
        mask.sum(dim=1).tolist(), rows, columns, length, noisy.device
    )
    tokens = noisy.permute(0, 2, 3, 1).reshape(batch, images, features)
    hidden = torch.cat([tokens.new_zeros(batch, length, features), tokens], dim=1).to(dtype)
    text_features = torch.cat([embeds, embeds.new_zeros(batch, images, embeds.shape[-1])], dim=1).to(dtype)
    prediction = forward(
        hidden_states=hidden,
        timestep=(1.0 - timesteps / 1000).to(dtype),
        encoder_hidden_states=text_features,
        position_ids=position_ids,
        segment_ids=segment_ids,
        indicator=indicator,
        return_dict=False,
    )[0]
    velocity = -prediction[:, length:]  # the model predicts x0 - noise
    return velocity.reshape(batch, rows, columns, features).permute(0, 3, 1, 2)


def _sampling_pipeline(built, transformer):
    """Ideogram4Pipeline with the folder's unconditional transformer (frozen, loaded for this render only); the
    text-only pipeline (no transformer) goes without it."""
    cls = _pipeline_class()
    if transformer is None:
        return cls, {"unconditional_transformer": None}
    with quiet_hf_libraries():
        from diffusers import Ideogram4Transformer2DModel

        unconditional = load_component(
            built.folder,
            "unconditional_transformer",
            Ideogram4Transformer2DModel.from_pretrained,
            torch_dtype=built.frozen_dtype,
        )
    return cls, {"unconditional_transformer": unconditional.to(built.device).eval().requires_grad_(False)}


def _guidance(built, sample_spec, prompts: list[str]) -> dict:
    """sample.guidance as the pipeline's constant guidance_scale (its default is a per-step schedule instead)."""
    return {"guidance_scale": sample_spec.guidance, "guidance_schedule": None}


IDEOGRAM4 = FlowRecipe(
    kind="ideogram4",
    transformer_class="Ideogram4Transformer2DModel",
    pipeline_class="Ideogram4Pipeline",
    components={
        "text_encoder": "Qwen3VLModel",
        "tokenizer": None,
        "unconditional_transformer": "Ideogram4Transformer2DModel",
    },
    text=TextSide(TEXT_TENSORS, _captions, lambda built: built.max_sequence_length, 2048),
    predict=_predict,
    config_mismatches=_mismatches,
    latents=LatentSpace(
        vae_class="AutoencoderKLFlux2", patch=fixed_patch(2), posterior_mode=True, to_model=_model_latents
    ),
    sampling=Sampling(options=_guidance, pipeline=_sampling_pipeline),
    draw_sigmas=_sigmas,
)
