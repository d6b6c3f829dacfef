"""The training steps of SD3-class and Flux-class models (their cards: dstune.models.sd3_flux.card), as diffusers'
examples/dreambooth/train_dreambooth_sd3.py and train_dreambooth_flux.py feed them:
    SD3   prompt embeds: both CLIPs' penultimate hidden states side by side, zero-padded to the T5 width, then T5's
          along the sequence; pooled: both CLIP projections side by side; a 16-channel VAE with shift_factor and
          scaling_factor.
    Flux  T5's embeds and CLIP's pooled vector; latents packed 2x2 into tokens, with img_ids / txt_ids positions and
          a guidance embedding when the transformer has guidance_embeds.
"""

from __future__ import annotations

import torch

from dstune.families.flow_matching import image_ids, pack_latents, unpack_latents
from dstune.families.flow_model import FlowModel
from dstune.hf import quiet_hf_libraries
from dstune.models.sd3_flux.card import CLIP_TOKENS


class SD3(FlowModel):
    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        with torch.no_grad(), quiet_hf_libraries():
            embeds, _, pooled, _ = self.pipeline().encode_prompt(
                captions,
                captions,
                captions,
                device=self.device,
                do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
            )
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def text_tokens(self) -> int:
        return CLIP_TOKENS + self.max_sequence_length

    def latent_patch(self) -> tuple[int, int]:
        return 1, 1  # the transformer patchifies the latents itself

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        return forward(
            hidden_states=noisy.to(dtype),
            timestep=timesteps,
            encoder_hidden_states=conditions["encoder_hidden_states"],
            pooled_projections=conditions["pooled_projections"],
            return_dict=False,
        )[0]


class Flux(FlowModel):
    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        with torch.no_grad(), quiet_hf_libraries():
            embeds, pooled, _ = self.pipeline().encode_prompt(
                captions, captions, device=self.device, max_sequence_length=self.max_sequence_length
            )
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        batch, _, height, width = noisy.shape
        embeds = conditions["encoder_hidden_states"]
        guidance = None
        if self.transformer_config.get("guidance_embeds", False):
            guidance = torch.full((batch,), float(self.model_spec.guidance), device=noisy.device, dtype=dtype)
        prediction = forward(
            hidden_states=pack_latents(noisy).to(dtype),
            timestep=(timesteps / 1000).to(dtype),
            guidance=guidance,
            pooled_projections=conditions["pooled_projections"],
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=dtype),
            img_ids=image_ids(height, width, dtype, noisy.device),
            return_dict=False,
        )[0]
        return unpack_latents(prediction, height, width)
