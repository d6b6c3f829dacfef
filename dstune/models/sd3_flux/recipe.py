"""The flow family's SD3-class and Flux-class recipes (dstune.families.flow_recipe).

    SD3-class  SD3Transformer2DModel; CLIP x2 (CLIPTextModelWithProjection) + T5. Prompt embeds: both CLIPs'
               penultimate hidden states side by side, zero-padded to the T5 width, then T5's along the sequence;
               pooled: both CLIP projections side by side. 16-channel VAE with shift_factor and scaling_factor.
    Flux-class FluxTransformer2DModel; CLIPTextModel (pooled only) + T5. Latents packed 2x2 into tokens, with
               img_ids / txt_ids positions and a guidance embedding when the transformer has guidance_embeds.

Both as diffusers' examples/dreambooth/train_dreambooth_sd3.py and train_dreambooth_flux.py feed them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dstune.families.flow_matching import image_ids, pack_latents, unpack_latents
from dstune.families.flow_recipe import FlowRecipe, LatentSpace, Sampling, TextSide, fixed_patch, read_config
from dstune.hf import quiet_hf_libraries

CLIP_TOKENS = 77  # SD3's CLIP part of the prompt embeds is always the CLIP tokenizers' 77 tokens
TEXT_TENSORS = ("encoder_hidden_states", "pooled_projections")


def _sd3_mismatches(folder: Path) -> list[str]:
    transformer, vae = read_config(folder, "transformer"), read_config(folder, "vae")
    t5 = read_config(folder, "text_encoder_3")
    clips = [read_config(folder, name) for name in ("text_encoder", "text_encoder_2")]
    checks = [
        ("in_channels", vae.get("latent_channels", 4)),
        ("joint_attention_dim", t5.get("d_model")),
        ("pooled_projection_dim", sum(c.get("projection_dim", 0) for c in clips)),
    ]
    return [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
        for key, want in checks
        if transformer.get(key) != want
    ]


def _flux_mismatches(folder: Path) -> list[str]:
    transformer, vae = read_config(folder, "transformer"), read_config(folder, "vae")
    t5, clip = read_config(folder, "text_encoder_2"), read_config(folder, "text_encoder")
    checks = [
        ("in_channels", 4 * vae.get("latent_channels", 4)),
        ("joint_attention_dim", t5.get("d_model")),
        ("pooled_projection_dim", clip.get("hidden_size")),
    ]
    return [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
        for key, want in checks
        if transformer.get(key) != want
    ]


def _sd3_captions(pipeline, built, captions: list[str]) -> dict:
    with torch.no_grad(), quiet_hf_libraries():
        embeds, _, pooled, _ = pipeline.encode_prompt(
            captions,
            captions,
            captions,
            device=built.device,
            do_classifier_free_guidance=False,
            max_sequence_length=built.max_sequence_length,
        )
    return {"encoder_hidden_states": embeds, "pooled_projections": pooled}


def _flux_captions(pipeline, built, captions: list[str]) -> dict:
    with torch.no_grad(), quiet_hf_libraries():
        embeds, pooled, _ = pipeline.encode_prompt(
            captions, captions, device=built.device, max_sequence_length=built.max_sequence_length
        )
    return {"encoder_hidden_states": embeds, "pooled_projections": pooled}


def _sd3_predict(built, forward, noisy, timesteps, text: dict, dtype) -> torch.Tensor:
    return forward(
        hidden_states=noisy.to(dtype),
        timestep=timesteps,
        encoder_hidden_states=text["encoder_hidden_states"],
        pooled_projections=text["pooled_projections"],
        return_dict=False,
    )[0]


def _flux_predict(built, forward, noisy, timesteps, text: dict, dtype) -> torch.Tensor:
    batch, _, height, width = noisy.shape
    embeds = text["encoder_hidden_states"]
    guidance = None
    if built.transformer_config.get("guidance_embeds", False):
        guidance = torch.full((batch,), float(built.settings.guidance), device=noisy.device, dtype=dtype)
    prediction = forward(
        hidden_states=pack_latents(noisy).to(dtype),
        timestep=(timesteps / 1000).to(dtype),
        guidance=guidance,
        pooled_projections=text["pooled_projections"],
        encoder_hidden_states=embeds,
        txt_ids=torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=dtype),
        img_ids=image_ids(height, width, dtype, noisy.device),
        return_dict=False,
    )[0]
    return unpack_latents(prediction, height, width)


def _sd3_cached_text(built, pipeline, prompt: dict, negative: dict) -> dict:
    """StableDiffusion3Pipeline's embeddings (CLIP's and T5's joined) and pooled vectors, and the negative's."""
    return {
        "prompt_embeds": prompt["encoder_hidden_states"],
        "pooled_prompt_embeds": prompt["pooled_projections"],
        "negative_prompt_embeds": negative["encoder_hidden_states"],
        "negative_pooled_prompt_embeds": negative["pooled_projections"],
    }


def _flux_cached_text(built, pipeline, prompt: dict, negative: dict) -> dict:
    """FluxPipeline's T5 embeddings and CLIP pooled vector; its guidance is the distilled embedding, no negative."""
    return {"prompt_embeds": prompt["encoder_hidden_states"], "pooled_prompt_embeds": prompt["pooled_projections"]}


SD3 = FlowRecipe(
    kind="sd3",
    transformer_class="SD3Transformer2DModel",
    pipeline_class="StableDiffusion3Pipeline",
    components={
        "text_encoder": "CLIPTextModelWithProjection",
        "text_encoder_2": "CLIPTextModelWithProjection",
        "text_encoder_3": "T5EncoderModel",
        "tokenizer": None,
        "tokenizer_2": None,
        "tokenizer_3": None,
    },
    text=TextSide(TEXT_TENSORS, _sd3_captions, lambda built: CLIP_TOKENS + built.max_sequence_length, 77),
    predict=_sd3_predict,
    config_mismatches=_sd3_mismatches,
    sampling=Sampling(cached_text=_sd3_cached_text),
)

FLUX = FlowRecipe(
    kind="flux",
    transformer_class="FluxTransformer2DModel",
    pipeline_class="FluxPipeline",
    components={
        "text_encoder": "CLIPTextModel",
        "text_encoder_2": "T5EncoderModel",
        "tokenizer": None,
        "tokenizer_2": None,
    },
    text=TextSide(TEXT_TENSORS, _flux_captions, lambda built: built.max_sequence_length, 512),
    predict=_flux_predict,
    config_mismatches=_flux_mismatches,
    latents=LatentSpace(patch=fixed_patch(2)),
    sampling=Sampling(cached_text=_flux_cached_text),
)
