"""The flow family's FLUX.2 [klein] recipe (dstune.families.flow_recipe), as diffusers'
examples/dreambooth/train_dreambooth_lora_flux2_klein.py feeds Flux2Transformer2DModel:

- text: Flux2KleinPipeline.encode_prompt (the Qwen3 text encoder's hidden states of layers 9, 18 and 27 of the
  chat-templated caption, padded to max_sequence_length by the tokenizer, stacked side by side), one shape per
  caption; the 4-axis text position ids come from the pipeline's _prepare_text_ids;
- latents: the AutoencoderKLFlux2 posterior's mode (the example's latent_dist.mode()), patchified 2x2 into 4x the
  channels and normalised with the VAE's batch-norm running mean and std: the model space of this family member is
  (B, 4C, H/2, W/2), where noise, x_t and the target live;
- the transformer sees those latents flattened into tokens with 4-axis position ids, timestep / 1000, and a
  guidance value when it has a guidance embedding; its output is unpacked with the same ids.

FLUX.2 [dev] (FLUX2_DEV) trains the same way with another text side: Flux2Pipeline.encode_prompt (its `tokenizer`,
a PixtralProcessor in a real folder, applies the Mistral chat template with FLUX.2's system message, padded to
max_sequence_length; the Mistral3 hidden states of layers 10, 20 and 30 stacked side by side). Both recipes share
the transformer class, so flow.detect_kind tells them apart by the pipeline class (model_index.json's _class_name)
or, failing that, by the text encoder class.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dstune.families.flow_recipe import FlowRecipe, LatentSpace, Sampling, TextSide, fixed_patch, read_config
from dstune.hf import quiet_hf_libraries

TEXT_TENSORS = ("encoder_hidden_states",)
TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers default
DEV_TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline's (and train_dreambooth_lora_flux2.py's) default


def _pipeline_class():
    """Klein's and dev's pipelines share these static helpers (_patchify_latents, _pack_latents, ids)."""
    with quiet_hf_libraries():
        from diffusers import Flux2KleinPipeline
    return Flux2KleinPipeline


def _config_mismatches(folder: Path, layers: tuple[int, ...]) -> list[str]:
    """Channels and widths that must agree; `layers`: the text encoder hidden states the pipeline stacks."""
    transformer, vae = read_config(folder, "transformer"), read_config(folder, "vae")
    text = read_config(folder, "text_encoder")
    text = text.get("text_config", text)  # Mistral3ForConditionalGeneration nests its language model's config
    checks = [
        ("in_channels", 4 * vae.get("latent_channels", 32)),
        ("joint_attention_dim", len(layers) * text.get("hidden_size", 0)),
    ]
    problems = [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
        for key, want in checks
        if transformer.get(key) != want
    ]
    if text.get("num_hidden_layers", 0) < max(layers):
        problems.append(
            f"text_encoder has {text.get('num_hidden_layers')} layers; the pipeline reads the hidden "
            f"states of layers {', '.join(map(str, layers))}"
        )
    return problems


def _captions(pipeline, built, captions: list[str]) -> dict:
    with torch.no_grad(), quiet_hf_libraries():
        embeds, _ = pipeline.encode_prompt(
            list(captions), device=built.device, max_sequence_length=built.max_sequence_length
        )
    return {"encoder_hidden_states": embeds}


def _model_latents(built, sample: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) posterior mode -> patchified, batch-norm-normalised (B, 4C, H/2, W/2)."""
    vae = built.vae
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(sample.device, sample.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(sample.device, sample.dtype)
    return (_pipeline_class()._patchify_latents(sample) - mean) / std


def _predict(built, forward, noisy, timesteps, text: dict, dtype) -> torch.Tensor:
    pipeline = _pipeline_class()
    embeds = text["encoder_hidden_states"]
    latent_ids = pipeline._prepare_latent_ids(noisy).to(noisy.device)
    packed = pipeline._pack_latents(noisy).to(dtype)
    guidance = None
    if built.transformer_config.get("guidance_embeds", False):
        guidance = torch.full((noisy.shape[0],), float(built.settings.guidance), device=noisy.device, dtype=dtype)
    prediction = forward(
        hidden_states=packed,
        timestep=(timesteps / 1000).to(dtype),
        guidance=guidance,
        encoder_hidden_states=embeds,
        txt_ids=pipeline._prepare_text_ids(embeds).to(noisy.device),
        img_ids=latent_ids,
        return_dict=False,
    )[0]
    return pipeline._unpack_latents_with_ids(prediction[:, : packed.shape[1]], latent_ids)


TEXT_SIDE = TextSide(TEXT_TENSORS, _captions, lambda built: built.max_sequence_length, 512)
LATENT_SPACE = LatentSpace(
    vae_class="AutoencoderKLFlux2", patch=fixed_patch(2), posterior_mode=True, to_model=_model_latents
)


def _klein_cached_text(built, pipeline, prompt: dict, negative: dict) -> dict:
    """Flux2KleinPipeline's stacked Qwen3 hidden states, and the negative's ("" is its negative prompt)."""
    return {
        "prompt_embeds": prompt["encoder_hidden_states"],
        "negative_prompt_embeds": negative["encoder_hidden_states"],
    }


def _dev_cached_text(built, pipeline, prompt: dict, negative: dict) -> dict:
    """Flux2Pipeline's stacked Mistral3 hidden states; its guidance is the distilled embedding, no negative."""
    return {"prompt_embeds": prompt["encoder_hidden_states"]}


FLUX2_KLEIN = FlowRecipe(
    kind="flux2_klein",
    transformer_class="Flux2Transformer2DModel",
    pipeline_class="Flux2KleinPipeline",
    components={"text_encoder": "Qwen3ForCausalLM", "tokenizer": None},
    text=TEXT_SIDE,
    predict=_predict,
    config_mismatches=lambda folder: _config_mismatches(folder, TEXT_LAYERS),
    latents=LATENT_SPACE,
    sampling=Sampling(cached_text=_klein_cached_text),
)

# FLUX.2 [dev]: klein's latents, prediction and loss; the text through Flux2Pipeline.encode_prompt at its defaults
# (max_sequence_length 512, layers 10, 20, 30), which _captions calls without naming the layers. The tokenizer is
# whatever the folder lists (a PixtralProcessor in a real folder), so it is checked loosely (None).
FLUX2_DEV = FlowRecipe(
    kind="flux2_dev",
    transformer_class="Flux2Transformer2DModel",
    pipeline_class="Flux2Pipeline",
    components={"text_encoder": "Mistral3ForConditionalGeneration", "tokenizer": None},
    text=TEXT_SIDE,
    predict=_predict,
    config_mismatches=lambda folder: _config_mismatches(folder, DEV_TEXT_LAYERS),
    latents=LATENT_SPACE,
    sampling=Sampling(cached_text=_dev_cached_text),
)
