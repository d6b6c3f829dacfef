"""The flow family's Z-Image recipe (dstune.families.flow_recipe), as diffusers'
examples/dreambooth/train_dreambooth_lora_z_image.py feeds ZImageTransformer2DModel:

- text: ZImagePipeline.encode_prompt (the Qwen3 text encoder's second-to-last hidden states of the chat-templated
  caption, its padding removed: one (tokens, width) tensor per caption), stored zero-padded to
  model.max_sequence_length with a mask of its tokens so that every caption's tensors have one shape (the text
  cache), and unpadded again for the transformer;
- latents: the AutoencoderKL posterior's mode (the example encodes with latent_dist.mode(), not a sample), as
  (mode - shift_factor) * scaling_factor;
- the transformer takes a list of one-frame latents (C, 1, H, W), the timestep as (1000 - t) / 1000 and the list of
  caption embeddings, and predicts the negative velocity: the example negates its output.
"""

from __future__ import annotations

from pathlib import Path

import torch

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

TEXT_TENSORS = ("encoder_hidden_states", "encoder_attention_mask")


def _mismatches(folder: Path) -> list[str]:
    transformer, vae = read_config(folder, "transformer"), read_config(folder, "vae")
    text = read_config(folder, "text_encoder")
    checks = [("in_channels", vae.get("latent_channels", 16)), ("cap_feat_dim", text.get("hidden_size"))]
    return [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
        for key, want in checks
        if transformer.get(key) != want
    ]


def _captions(pipeline, built, captions: list[str]) -> dict:
    with torch.no_grad(), quiet_hf_libraries():  # a copy: the pipeline writes the chat template into the list
        embeds, _ = pipeline.encode_prompt(
            list(captions),
            device=built.device,
            do_classifier_free_guidance=False,
            max_sequence_length=built.max_sequence_length,
        )
    padded = embeds[0].new_zeros(len(embeds), built.max_sequence_length, embeds[0].shape[-1])
    mask = torch.zeros(len(embeds), built.max_sequence_length, dtype=torch.long, device=embeds[0].device)
    for row, caption in enumerate(embeds):
        padded[row, : len(caption)] = caption
        mask[row, : len(caption)] = 1
    return {"encoder_hidden_states": padded, "encoder_attention_mask": mask}


def _predict(built, forward, noisy, timesteps, text: dict, dtype) -> torch.Tensor:
    latents = list(noisy.to(dtype).unsqueeze(2).unbind(dim=0))  # (C, 1, H, W) each
    captions = [
        embeds[mask.bool()]  # each caption's own tokens, as the pipeline gives them
        for embeds, mask in zip(text["encoder_hidden_states"], text["encoder_attention_mask"])
    ]
    prediction = forward(latents, ((1000 - timesteps) / 1000).to(dtype), captions, return_dict=False)[0]
    return -torch.stack(prediction, dim=0).squeeze(2)


ZIMAGE = FlowRecipe(
    kind="z_image",
    transformer_class="ZImageTransformer2DModel",
    pipeline_class="ZImagePipeline",
    components={"text_encoder": "Qwen3Model", "tokenizer": None},
    text=TextSide(TEXT_TENSORS, _captions, lambda built: built.max_sequence_length, 512),
    predict=_predict,
    config_mismatches=_mismatches,
    latents=LatentSpace(patch=fixed_patch(2), posterior_mode=True),
    sampling=Sampling(cached_text=per_caption_embeds),
)
