"""Z-Image's training step (its card: dstune.models.zimage.card), as diffusers'
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

import torch

from dstune.families.flow_model import FlowModel
from dstune.hf import quiet_hf_libraries


class ZImage(FlowModel):
    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        with torch.no_grad(), quiet_hf_libraries():  # a copy: the pipeline writes the chat template into the list
            embeds, _ = self.pipeline().encode_prompt(
                list(captions),
                device=self.device,
                do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
            )
        padded = embeds[0].new_zeros(len(embeds), self.max_sequence_length, embeds[0].shape[-1])
        mask = torch.zeros(len(embeds), self.max_sequence_length, dtype=torch.long, device=embeds[0].device)
        for row, caption in enumerate(embeds):
            padded[row, : len(caption)] = caption
            mask[row, : len(caption)] = 1
        return {"encoder_hidden_states": padded, "encoder_attention_mask": mask}

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        latents = list(noisy.to(dtype).unsqueeze(2).unbind(dim=0))  # (C, 1, H, W) each
        captions = [
            embeds[mask.bool()]  # each caption's own tokens, as the pipeline gives them
            for embeds, mask in zip(conditions["encoder_hidden_states"], conditions["encoder_attention_mask"])
        ]
        prediction = forward(latents, ((1000 - timesteps) / 1000).to(dtype), captions, return_dict=False)[0]
        return -torch.stack(prediction, dim=0).squeeze(2)
