"""The flow family's Krea 2 recipe (dstune.families.flow_recipe), as diffusers'
examples/dreambooth/train_dreambooth_lora_krea2.py feeds Krea2Transformer2DModel (Raw and Turbo folders alike:
they differ in their weights and in model_index.json's is_distilled, which only the sampling schedule reads):

- text: Krea2Pipeline.encode_prompt (the Qwen3-VL text encoder's hidden states of the pipeline's
  text_encoder_select_layers, stacked per token: (B, T, layers, width), with the boolean mask of the caption's
  tokens; the pipeline pads every caption to one length itself, so the text cache stores them as they are);
- latents: AutoencoderKLQwenImage's one-frame posterior, sampled (not its mode), normalised per channel with the
  VAE's latents_mean / latents_std (as every AutoencoderKLQwenImage model does);
- the transformer sees the latents packed 2x2 into tokens, the (t, h, w) position ids of Krea2Pipeline's
  prepare_position_ids for [text, image], and timestep / 1000; its output is unpacked back to (B, C, H, W).

The pipeline's own settings (text_encoder_select_layers, is_distilled, patch_size) live in model_index.json, not in
a component, so every Krea2Pipeline dstune builds around the parts is given the folder's values (_pipeline).
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
PIPELINE_SETTINGS = ("text_encoder_select_layers", "is_distilled", "patch_size")  # model_index.json's own values
DEFAULT_TEXT_LAYERS = 12  # Krea2Pipeline's default taps (2, 5, ..., 35) of Qwen3-VL-4B


def _pipeline_class():
    with quiet_hf_libraries():
        from diffusers import Krea2Pipeline
    return Krea2Pipeline


def _pipeline(built, transformer) -> tuple:
    """Krea2Pipeline with the folder's settings (the taps, is_distilled, the patch): its defaults are the real
    model's, which a folder may not share (the tiny model taps 2 of 3 layers)."""
    return _pipeline_class(), {key: built.model_index[key] for key in PIPELINE_SETTINGS if key in built.model_index}


def _mismatches(folder: Path) -> list[str]:
    """Channels, the text width and the number of tapped layers the transformer expects, against the other parts."""
    transformer, vae = read_config(folder, "transformer"), read_config(folder, "vae")
    text = read_config(folder, "text_encoder")
    text = text.get("text_config", text)
    index = read_config(folder, ".", "model_index.json")
    layers = index.get("text_encoder_select_layers") or [None] * DEFAULT_TEXT_LAYERS
    checks = [
        ("in_channels", 4 * vae.get("z_dim", 16)),
        ("text_hidden_dim", text.get("hidden_size")),
        ("num_text_layers", len(layers)),
    ]
    problems = [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs and "
        "model_index.json's text_encoder_select_layers)"
        for key, want in checks
        if transformer.get(key) != want
    ]
    deepest = max((layer for layer in layers if layer is not None), default=0)
    if deepest > text.get("num_hidden_layers", 0):
        problems.append(
            f"model_index.json taps the text encoder's hidden states {layers}, but it has "
            f"{text.get('num_hidden_layers')} layers"
        )
    return problems


def _captions(pipeline, built, captions: list[str]) -> dict:
    with torch.no_grad(), quiet_hf_libraries():
        embeds, mask = pipeline.encode_prompt(
            list(captions), device=built.device, max_sequence_length=built.max_sequence_length
        )
    return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}


# Krea2Pipeline's prompt_template_encode_suffix and prompt_template_encode_num_suffix_tokens (set per instance)
_SUFFIX, _SUFFIX_TOKENS = "<|im_end|>\n<|im_start|>assistant\n", 5


def _tokens(built) -> int:
    """Text tokens per caption: the pipeline pads the caption to max_sequence_length minus the 5 tokens its
    template's suffix takes with Qwen's tokenizer, then appends the suffix as the folder's tokenizer spells it."""
    return built.max_sequence_length - _SUFFIX_TOKENS + len(built.tokenizers["tokenizer"](_SUFFIX).input_ids)


def _predict(built, forward, noisy, timesteps, text: dict, dtype) -> torch.Tensor:
    _, _, height, width = noisy.shape
    embeds = text["encoder_hidden_states"]
    ids = _pipeline_class().prepare_position_ids(embeds.shape[1], height // 2, width // 2, noisy.device)
    prediction = forward(
        hidden_states=pack_latents(noisy).to(dtype),
        encoder_hidden_states=embeds,
        timestep=(timesteps / 1000).to(dtype),
        position_ids=ids,
        encoder_attention_mask=text["encoder_attention_mask"].bool(),
        return_dict=False,
    )[0]
    return unpack_latents(prediction, height, width)


KREA2 = FlowRecipe(
    kind="krea2",
    transformer_class="Krea2Transformer2DModel",
    pipeline_class="Krea2Pipeline",
    components={"text_encoder": "Qwen3VLModel", "tokenizer": None},
    text=TextSide(TEXT_TENSORS, _captions, _tokens, 512),
    predict=_predict,
    config_mismatches=_mismatches,
    latents=LatentSpace(vae_class="AutoencoderKLQwenImage", patch=fixed_patch(2)),
    sampling=Sampling(pipeline=_pipeline, cached_text=embeds_and_mask),
)
