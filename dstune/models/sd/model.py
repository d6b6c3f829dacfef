"""Stable Diffusion 1.x / 2.x's class on the UNet core (dstune.families.unet_model): one CLIP text encoder's last
hidden state as the UNet's text."""

from __future__ import annotations

import torch

from dstune.families.unet_model import UnetModel, clip_states


class Sd(UnetModel):
    """Stable Diffusion 1.x/2.x: one CLIP text encoder's last hidden state."""

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return {"encoder_hidden_states": clip_states(self, "text_encoder", "tokenizer", captions).last_hidden_state}

    def pipeline_extras(self) -> dict:
        return {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
