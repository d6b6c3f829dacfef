"""SDXL's class on the UNet core (dstune.families.unet_model): both CLIP encoders' penultimate hidden states side by
side, text_encoder_2's pooled projection, and six time ids per image (original height and width, crop top and left,
target height and width) from the crop the data layer made (batch keys `original_size` and `crop_top_left`,
dstune.data.images.crop_fields), as diffusers' train_text_to_image_sdxl.py conditions the UNet."""

from __future__ import annotations

import torch

from dstune.families.flow_model import vae_spatial_factor
from dstune.families.precision import compute_dtype
from dstune.families.unet_model import UnetModel, clip_states
from dstune.models.sdxl.card import SdxlCard


class Sdxl(UnetModel):
    """SDXL: both encoders' penultimate hidden states side by side, text_encoder_2's pooled projection, and the time
    ids, as the UNet's added conditions."""

    card: SdxlCard

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        first = clip_states(self, "text_encoder", "tokenizer", captions)
        second = clip_states(self, "text_encoder_2", "tokenizer_2", captions)
        hidden = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
        pooled = second[0]  # CLIPTextModelWithProjection: [0] is text_embeds
        return {"encoder_hidden_states": hidden, "text_embeds": pooled.reshape(len(captions), -1)}

    def added_conditions(self, batch: dict, mean: torch.Tensor, dtype: torch.dtype) -> dict:
        """The time ids from the crop the data layer made; the target size is the pixels' (cached latents: the
        latent size x the VAE's factor)."""
        if "pixel_values" in batch:
            target = tuple(batch["pixel_values"].shape[-2:])
        else:
            factor = vae_spatial_factor(self.vae.config)
            target = tuple(side * factor for side in mean.shape[-2:])
        missing = [name for name in ("original_size", "crop_top_left") if name not in batch]
        if missing:
            raise KeyError(
                f"SDXL needs each sample's {' and '.join(missing)} (dstune.data.images.crop_fields); this batch has "
                f"only {sorted(batch)}"
            )
        original_size = torch.as_tensor(batch["original_size"]).long()
        crop_top_left = torch.as_tensor(batch["crop_top_left"]).long()
        return {"time_ids": time_ids(original_size, crop_top_left, target).to(self.device, dtype)}

    def predict(self, forward, noisy: torch.Tensor, timesteps: torch.Tensor, encoded: dict) -> torch.Tensor:
        dtype = compute_dtype(self.trainable)
        added = {"text_embeds": encoded["text_embeds"].to(dtype), "time_ids": encoded["time_ids"].to(dtype)}
        hidden = encoded["encoder_hidden_states"].to(dtype)
        return forward(noisy.to(dtype), timesteps, hidden, return_dict=False, added_cond_kwargs=added)[0]

    def pipeline_extras(self) -> dict:
        return {"add_watermarker": False}  # its time ids say original = target = the rendered size, crop (0, 0)


def time_ids(
    original_size: torch.Tensor, crop_top_left: torch.Tensor, target_size: tuple[int, int], dtype=torch.float32
) -> torch.Tensor:
    """(B, 6): original (h, w) + crop top-left (top, left) + target (h, w), the reference script's add_time_ids."""
    original_size, crop_top_left = torch.as_tensor(original_size), torch.as_tensor(crop_top_left)
    target = torch.tensor(target_size, dtype=original_size.dtype).expand(len(original_size), 2)
    return torch.cat([original_size, crop_top_left, target], dim=1).to(dtype)
