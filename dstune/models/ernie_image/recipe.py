"""The flow family's ERNIE-Image recipe (dstune.families.flow_recipe): ErnieImageTransformer2DModel fed as
ErnieImagePipeline feeds it and as kohya-ss/musubi-tuner's ernie_image_train_network.py trains it (no diffusers
training example exists and Baidu has released no trainer; docs/family-flow.md, ERNIE-Image):

- text: ErnieImagePipeline.encode_prompt (the Mistral3 text encoder's second-to-last hidden states of the caption,
  one tensor per caption of its own length), padded with zeros to model.max_sequence_length so that a caption's
  tensors have one shape (the text cache), with the mask of its tokens; the transformer is given the mask's sum as
  text_lens, so the padding is never attended and the image tokens' positions are those of the unpadded caption;
- latents: the AutoencoderKLFlux2 posterior's mode, patchified 2x2 with the pipeline's _patchify_latents and
  normalised with the VAE's batch-norm running statistics and eps 1e-5, exactly what the pipeline's decode undoes
  (its constant, not vae.config.batch_norm_eps: the released config's 1e-4 is not the trained value): the model
  space is (B, 4C, H/2, W/2), where noise, x_t and the target live;
- the transformer takes those latents as they are (patch_size 1), the timestep as the scheduler's (sigma x 1000,
  as the pipeline passes it) and predicts noise - x0, the flow core's target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dstune.families.base import FamilyError
from dstune.families.flow_recipe import (
    FlowRecipe,
    LatentSpace,
    Sampling,
    TextSide,
    fixed_patch,
    per_caption_embeds,
    read_config,
)
from dstune.hf import quiet_hf_libraries
from dstune.models.ernie_image.facts import DEFAULT_TEXT_TOKENS

TEXT_TENSORS = ("encoder_hidden_states", "encoder_attention_mask")
BATCH_NORM_EPS = 1e-5  # ErnieImagePipeline's decode: bn_std = sqrt(running_var + 1e-5)


def _pipeline_class():
    with quiet_hf_libraries():
        from diffusers import ErnieImagePipeline
    return ErnieImagePipeline


def _mismatches(folder: Path) -> list[str]:
    """Channels, the text width and the rotary axes the transformer expects, against the other parts."""
    transformer, vae = read_config(folder, "transformer"), read_config(folder, "vae")
    text = read_config(folder, "text_encoder")
    text = text.get("text_config", text)  # Mistral3Model nests its language model's config
    channels = 4 * vae.get("latent_channels", 32)
    checks = [
        ("in_channels", channels),
        ("out_channels", channels),
        ("text_in_dim", text.get("hidden_size")),
    ]
    problems = [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
        for key, want in checks
        if transformer.get(key) != want
    ]
    head_dim = transformer.get("hidden_size", 0) // max(1, transformer.get("num_attention_heads", 1))
    axes = transformer.get("rope_axes_dim") or []
    if sum(axes) != head_dim:
        problems.append(f"transformer rope_axes_dim {axes} does not sum to its head dimension {head_dim}")
    return problems


def _caption_tokens(pipeline, caption: str) -> int:
    """A caption's tokens as ErnieImagePipeline.encode_prompt tokenizes it (special tokens added; an empty caption
    is one token)."""
    return max(1, len(pipeline.tokenizer(caption, add_special_tokens=True, truncation=True)["input_ids"]))


def _captions(pipeline, built, captions: list[str]) -> dict:
    """encode_prompt's per-caption hidden states, zero-padded to max_sequence_length, and their tokens' mask."""
    limit = built.max_sequence_length
    for caption in captions:  # the pipeline has no length limit; the text cache needs one shape per caption
        tokens = _caption_tokens(pipeline, caption)
        if tokens > limit:
            raise FamilyError(
                f"the caption {caption[:80]!r}{'...' if len(caption) > 80 else ''} is {tokens} tokens, more than "
                f"model.max_sequence_length {limit} (every caption is padded to it): raise "
                "model.max_sequence_length or shorten the caption"
            )
    with torch.no_grad(), quiet_hf_libraries():
        hiddens = pipeline.encode_prompt(list(captions), device=built.device)
    embeds = hiddens[0].new_zeros(len(hiddens), limit, hiddens[0].shape[-1])
    mask = torch.zeros(len(hiddens), limit, dtype=torch.long, device=embeds.device)
    for row, hidden in enumerate(hiddens):
        embeds[row, : hidden.shape[0]] = hidden
        mask[row, : hidden.shape[0]] = 1
    return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}


def _model_latents(built, sample: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) posterior mode -> patchified, batch-norm-normalised (B, 4C, H/2, W/2)."""
    bn = built.vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1).to(sample.device, sample.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + BATCH_NORM_EPS).to(sample.device, sample.dtype)
    return (_pipeline_class()._patchify_latents(sample) - mean) / std


def _predict(built, forward, noisy, timesteps, text: dict, dtype) -> torch.Tensor:
    """The transformer on the model-space latents; text_lens from the mask, so padded text is not attended."""
    return forward(
        hidden_states=noisy.to(dtype),
        timestep=timesteps.to(dtype),
        text_bth=text["encoder_hidden_states"],
        text_lens=text["encoder_attention_mask"].sum(dim=1),
        return_dict=False,
    )[0]


ERNIE_IMAGE = FlowRecipe(
    kind="ernie_image",
    transformer_class="ErnieImageTransformer2DModel",
    pipeline_class="ErnieImagePipeline",
    components={"text_encoder": "Mistral3Model", "tokenizer": None},
    text=TextSide(TEXT_TENSORS, _captions, lambda built: built.max_sequence_length, DEFAULT_TEXT_TOKENS),
    predict=_predict,
    config_mismatches=_mismatches,
    latents=LatentSpace(
        vae_class="AutoencoderKLFlux2", patch=fixed_patch(2), posterior_mode=True, to_model=_model_latents
    ),
    sampling=Sampling(takes_max_sequence_length=False, cached_text=per_caption_embeds),
)
