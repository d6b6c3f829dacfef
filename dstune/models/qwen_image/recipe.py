"""The flow family's Qwen-Image recipe (dstune.families.flow_recipe), as diffusers'
examples/dreambooth/train_dreambooth_lora_qwen_image.py feeds QwenImageTransformer2DModel:

- text: QwenImagePipeline.encode_prompt (the Qwen2.5-VL text encoder's last hidden states under the pipeline's
  prompt template, the template's first tokens dropped), zero-padded to model.max_sequence_length with an
  attention mask of ones over the caption's tokens, so every caption's tensors have one shape (the text cache);
- latents: AutoencoderKLQwenImage's one-frame posterior (B, C, 1, H, W), normalised per channel with the VAE's
  latents_mean / latents_std (dstune.families.flow_recipe.normalised_latents);
- the transformer sees the latents packed 2x2 into tokens with img_shapes [(1, H/2, W/2)] per sample, the prompt
  embeds with their mask, and timestep / 1000; its output is unpacked back to (B, C, H, W).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dstune.families.flow_matching import pack_latents, unpack_latents
from dstune.families.flow_recipe import (
    FlowRecipe,
    LatentSpace,
    Sampling,
    TextSide,
    embeds_and_mask,
    fixed_patch,
    read_config,
)
from dstune.hf import quiet_hf_libraries

TEXT_TENSORS = ("encoder_hidden_states", "encoder_attention_mask")


def qwen_config_mismatches(folder: Path) -> list[str]:
    """The transformer's channels and text width against the VAE's and the text encoder's (shared with the edit
    recipe, dstune.models.qwen_image.edit_recipe)."""
    transformer, vae = read_config(folder, "transformer"), read_config(folder, "vae")
    text = read_config(folder, "text_encoder")
    width = (text.get("text_config") or {}).get("hidden_size", text.get("hidden_size"))
    checks = [
        ("in_channels", 4 * vae.get("z_dim", 16)),
        ("out_channels", vae.get("z_dim", 16)),
        ("joint_attention_dim", width),
    ]
    return [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
        for key, want in checks
        if transformer.get(key) != want
    ]


def _captions(pipeline, built, captions: list[str]) -> dict:
    with torch.no_grad(), quiet_hf_libraries():
        embeds, mask = pipeline.encode_prompt(
            captions, device=built.device, max_sequence_length=built.max_sequence_length
        )
    if mask is None:  # the pipeline drops a mask of all ones
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    padding = built.max_sequence_length - embeds.shape[1]
    embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], padding, embeds.shape[2])], dim=1)
    mask = torch.cat([mask, mask.new_zeros(mask.shape[0], padding)], dim=1)
    return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}


def _predict(built, forward, noisy, timesteps, text: dict, dtype) -> torch.Tensor:
    batch, _, height, width = noisy.shape
    prediction = forward(
        hidden_states=pack_latents(noisy).to(dtype),
        encoder_hidden_states=text["encoder_hidden_states"],
        encoder_hidden_states_mask=text["encoder_attention_mask"],
        timestep=(timesteps / 1000).to(dtype),
        img_shapes=[(1, height // 2, width // 2)] * batch,
        return_dict=False,
    )[0]
    return unpack_latents(prediction, height, width)


NEGATIVE = " "  # the negative prompt of true classifier-free guidance, as the model card samples


def qwen_sample_guidance(built, sample_spec, prompts: list[str]) -> dict:
    """Qwen-Image has no guidance embedding: sample.guidance > 1 is true classifier-free guidance against an empty
    negative prompt (QwenImagePipeline's true_cfg_scale), as its model card samples."""
    if sample_spec.guidance <= 1.0:
        return {"true_cfg_scale": 1.0}
    return {"true_cfg_scale": sample_spec.guidance, "negative_prompt": [NEGATIVE] * len(prompts)}


QWEN_IMAGE = FlowRecipe(
    kind="qwen_image",
    transformer_class="QwenImageTransformer2DModel",
    pipeline_class="QwenImagePipeline",
    components={"text_encoder": "Qwen2_5_VLForConditionalGeneration", "tokenizer": None},
    text=TextSide(TEXT_TENSORS, _captions, lambda built: built.max_sequence_length, 512),
    predict=_predict,
    config_mismatches=qwen_config_mismatches,
    latents=LatentSpace(vae_class="AutoencoderKLQwenImage", patch=fixed_patch(2)),
    sampling=Sampling(options=qwen_sample_guidance, cached_text=embeds_and_mask, negative_caption=NEGATIVE),
)
