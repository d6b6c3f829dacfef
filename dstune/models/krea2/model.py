"""Krea 2's training step (its card: dstune.models.krea2.card), as diffusers'
examples/dreambooth/train_dreambooth_lora_krea2.py feeds Krea2Transformer2DModel:
- text: Krea2Pipeline.encode_prompt (the Qwen3-VL text encoder's hidden states of the pipeline's
  text_encoder_select_layers, stacked per token: (B, T, layers, width), with the boolean mask of the caption's
  tokens; the pipeline pads every caption to one length itself, so the text cache stores them as they are);
- latents: AutoencoderKLQwenImage's one-frame posterior, sampled (not its mode), normalised per channel with the
  VAE's latents_mean / latents_std (as every AutoencoderKLQwenImage model does);
- the transformer sees the latents packed 2x2 into tokens, the (t, h, w) position ids of Krea2Pipeline's
  prepare_position_ids for [text, image], and timestep / 1000; its output is unpacked back to (B, C, H, W).
The pipeline's own settings (text_encoder_select_layers, is_distilled, patch_size) live in model_index.json, not in
a component, so every Krea2Pipeline built around the parts is given the folder's values.
"""

from __future__ import annotations

import torch

from dstune.families.flow_matching import pack_latents, unpack_latents
from dstune.families.flow_model import FlowModel
from dstune.hf import quiet_hf_libraries

PIPELINE_SETTINGS = ("text_encoder_select_layers", "is_distilled", "patch_size")  # model_index.json's own values
# Krea2Pipeline's prompt_template_encode_suffix and prompt_template_encode_num_suffix_tokens (set per instance)
SUFFIX, SUFFIX_TOKENS = "<|im_end|>\n<|im_start|>assistant\n", 5


def _pipeline_class():
    with quiet_hf_libraries():
        from diffusers import Krea2Pipeline
    return Krea2Pipeline


class Krea2(FlowModel):
    def pipeline_class_and_parts(self, transformer) -> tuple[type, dict]:
        """Krea2Pipeline with the folder's settings (the taps, is_distilled, the patch): its defaults are the real
        model's, which a folder may not share (the tiny model taps 2 of 3 layers)."""
        return _pipeline_class(), {key: self.model_index[key] for key in PIPELINE_SETTINGS if key in self.model_index}

    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        with torch.no_grad(), quiet_hf_libraries():
            embeds, mask = self.pipeline().encode_prompt(
                list(captions), device=self.device, max_sequence_length=self.max_sequence_length
            )
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}

    def text_tokens(self) -> int:
        """Text tokens per caption: the pipeline pads the caption to max_sequence_length minus the 5 tokens its
        template's suffix takes with Qwen's tokenizer, then appends the suffix as the folder's tokenizer spells it."""
        return self.max_sequence_length - SUFFIX_TOKENS + len(self.tokenizers["tokenizer"](SUFFIX).input_ids)

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        _, _, height, width = noisy.shape
        embeds = conditions["encoder_hidden_states"]
        ids = _pipeline_class().prepare_position_ids(embeds.shape[1], height // 2, width // 2, noisy.device)
        prediction = forward(
            hidden_states=pack_latents(noisy).to(dtype),
            encoder_hidden_states=embeds,
            timestep=(timesteps / 1000).to(dtype),
            position_ids=ids,
            encoder_attention_mask=conditions["encoder_attention_mask"].bool(),
            return_dict=False,
        )[0]
        return unpack_latents(prediction, height, width)
