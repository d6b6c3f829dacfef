"""Image-to-video for HunyuanVideo 1.5 (HunyuanVideo15ImageToVideoPipeline folders): what the official trainer's
i2v task feeds the transformer, rebuilt from a training clip's own first frame.

- Condition latents (latent channels + 1): the clip's first latent frame in the transformer's scale, then zeros,
  and a mask channel of ones on that frame (train.py's get_condition(latents, "i2v")). dstune takes the first
  frame's posterior mean (the latent cache already holds it: nothing more is stored); train.py takes the same
  frame of its posterior sample, HunyuanVideo15ImageToVideoPipeline the mode of the first frame encoded alone,
  which a causal VAE makes the same latent frame.
- Image embedding: SigLIP's last hidden state of the first frame through the folder's feature_extractor
  (HunyuanVideo15ImageToVideoPipeline._get_image_embeds; train.py's encode_images), `image_embeds`: the latent
  cache stores it beside the clip's posterior.
- The loss covers every latent frame, the conditioned first one too (train.py's mse_loss over the whole clip).
"""

from __future__ import annotations

from typing import Optional

import torch

from dstune.families.diffusion import batch_field
from dstune.families.precision import at_least_float32
from dstune.families.flow_model import normalised_latents
from dstune.models.hunyuan_video15.card import IMAGE_EMBEDS
from dstune.families.samples import first_frames


def frame_images(frames: torch.Tensor) -> list:
    """Frames (B, 3, H, W) in [-1, 1] -> RGB PIL images (exact for 8-bit frames): what the pipeline is given."""
    from PIL import Image

    values = ((frames.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(value.permute(1, 2, 0).numpy()) for value in values]


def condition_tensors(model, clips: torch.Tensor) -> dict[str, torch.Tensor]:
    """{image_embeds} of clips (B, 3, F, H, W) in [-1, 1]: deterministic; what the latent cache stores."""
    encoder, extractor = model.parts["image_encoder"], model.parts["feature_extractor"]
    inputs = extractor.preprocess(
        images=frame_images(clips[:, :, 0]), do_resize=True, return_tensors="pt", do_convert_rgb=True
    )
    with torch.no_grad():
        hidden = encoder(pixel_values=inputs["pixel_values"].to(model.device, encoder.dtype)).last_hidden_state
    return {IMAGE_EMBEDS: at_least_float32(hidden)}


def encode_conditions(model, batch: dict, dtype: torch.dtype) -> dict:
    """Image-to-video: the batch's image embedding (from the latent cache as stored, else from its first frames) in
    `dtype`; text-to-video: nothing."""
    if not model.mode:
        return {}
    if IMAGE_EMBEDS in batch:
        embeds = batch[IMAGE_EMBEDS].to(model.device)
    else:
        embeds = condition_tensors(model, batch_field(batch, "pixel_values"))[IMAGE_EMBEDS]
    return {IMAGE_EMBEDS: embeds.to(dtype)}


def model_inputs(model, encoded: dict, dtype: torch.dtype) -> dict:
    """{condition_latents: (B, C + 1, F, h, w), image_embeds} for image-to-video (flow_hunyuan15 feeds zeros for
    text-to-video)."""
    if not model.mode:
        return {}
    mean = encoded["latent_mean"]
    condition = mean.new_zeros(mean.shape[0], mean.shape[1] + 1, *mean.shape[2:])
    condition[:, :-1, :1] = normalised_latents(model.vae.config, mean[:, :, :1])
    condition[:, -1, 0] = 1.0
    return {"condition_latents": condition.to(dtype), IMAGE_EMBEDS: encoded[IMAGE_EMBEDS].to(dtype)}


def sample_sources(model, sample_spec, prompts: list[str]) -> Optional[list]:
    """Image-to-video: sample.control_images, one first frame per prompt; text-to-video: None."""
    if not model.mode:
        return None
    return first_frames(sample_spec, prompts)
