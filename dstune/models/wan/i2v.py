"""Image-to-video for Wan (its class: dstune.models.wan.model): what WanImageToVideoPipeline (and WanPipeline with
expand_timesteps) feeds the transformer, rebuilt from a training clip's own first frame (dstune.models.wan.layouts tells the
layouts).

- Condition latents: the clip's first frame followed by zeros for the other frames (Wan 2.1 I2V, Wan 2.2 I2V A14B),
  or the first frame alone (Wan 2.2 TI2V), VAE-encoded with the posterior's mode (the pipeline's
  `retrieve_latents(..., sample_mode="argmax")`) and normalised per channel with latents_mean / latents_std.
  `condition_tensors` stores the mode unnormalised (`condition_mean`, float32): it is what the latent cache keeps
  beside the clip's posterior.
- Mask (condition-channel layouts): 4 channels per latent frame, ones on the first latent frame (the first pixel
  frame repeated over the VAE's 4 temporal slots), zeros after; the transformer reads cat([noisy, mask, condition]).
- Image embedding (Wan 2.1 I2V): the image encoder's hidden_states[-2] of the first frame through the folder's
  image_processor (`encode_image`), fed as encoder_hidden_states_image.
- Expanded timesteps (Wan 2.2 TI2V): one timestep per token (the latent grid subsampled by the patch); in
  image-to-video the first latent frame is the clean condition latent and its tokens get timestep 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from dstune.families.base import FamilyError
from dstune.families.precision import at_least_float32
from dstune.families.diffusion import batch_field, load_component
from dstune.families.flow_model import normalised_latents
from dstune.models.wan.card import CONDITION, IMAGE_EMBEDS
from dstune.models.wan.layouts import MASK_CHANNELS
from dstune.hf import quiet_hf_libraries
from dstune.families.samples import first_frames


def image_parts(model) -> dict:
    """The image encoder and its processor of a run that reads an image embedding (Wan 2.1 I2V image-to-video)."""
    if not (model.mode.image_to_video and model.transformer_config.get("image_dim") is not None):
        return {}
    encoder, processor = load_image_encoder(model.folder, model.frozen_dtype, model.device)
    return {"image_encoder": encoder, "image_processor": processor}


def load_image_encoder(folder: Path, dtype: torch.dtype, device) -> tuple:
    """(CLIPVisionModel frozen in `dtype` on `device`, the folder's CLIPImageProcessor). transformers without
    torchvision gives the PIL-based processor (the same arithmetic)."""
    import transformers

    encoder = load_component(folder, "image_encoder", transformers.CLIPVisionModel.from_pretrained, torch_dtype=dtype)
    with quiet_hf_libraries():
        try:
            processor = transformers.CLIPImageProcessor.from_pretrained(folder / "image_processor")
        except (OSError, ValueError) as err:
            raise FamilyError(
                f"{folder / 'image_processor'}: cannot load the CLIPImageProcessor ({err}). A Wan 2.1 "
                "image-to-video folder needs image_processor/ as diffusers saves it."
            ) from None
    return encoder.to(device).eval().requires_grad_(False), processor


def frame_images(frames: torch.Tensor) -> list:
    """Frames (B, 3, H, W) in [-1, 1] -> the RGB PIL images they were made from (exact for 8-bit frames): what
    the pipeline is given as `image`."""
    from PIL import Image

    values = ((frames.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(value.permute(1, 2, 0).numpy()) for value in values]


def condition_pixels(clips: torch.Tensor, first_frame_only: bool) -> torch.Tensor:
    """(B, 3, F, H, W) clips -> what the pipeline VAE-encodes: the first frame then zeros (F frames), or with
    `first_frame_only` (TI2V) the first frame alone."""
    first = clips[:, :, :1]
    if first_frame_only:
        return first
    return torch.cat(
        [first, first.new_zeros(first.shape[0], first.shape[1], clips.shape[2] - 1, *first.shape[3:])], dim=2
    )


def condition_tensors(model, clips: torch.Tensor) -> dict[str, torch.Tensor]:
    """The condition of clips (B, 3, F, H, W) in [-1, 1]: {condition_mean: the VAE mode, float32} and, where the
    transformer reads one, {image_embeds}. Deterministic; the latent cache stores exactly this."""
    pixels = condition_pixels(clips, model.mode.layout == "ti2v").to(model.device, model.vae.dtype)
    with torch.no_grad():
        out = {CONDITION: at_least_float32(model.vae.encode(pixels).latent_dist.mode())}
        if "image_encoder" in model.parts:
            out[IMAGE_EMBEDS] = image_embeddings(model, frame_images(clips[:, :, 0]))
    return out


def image_embeddings(model, images: list) -> torch.Tensor:
    """WanImageToVideoPipeline.encode_image: the image encoder's second-to-last hidden states."""
    encoder = model.parts["image_encoder"]
    inputs = model.parts["image_processor"](images=images, return_tensors="pt").to(model.device)
    inputs["pixel_values"] = inputs["pixel_values"].to(encoder.dtype)
    with torch.no_grad():
        return encoder(**inputs, output_hidden_states=True).hidden_states[-2]


def first_frame_mask(
    batch: int, latent_frames: int, height: int, width: int, temporal: int = MASK_CHANNELS, device=None
) -> torch.Tensor:
    """(B, 4, latent_frames, h, w): the pixel-frame mask (1 on frame 0) with frame 0 repeated over the VAE's
    temporal factor, regrouped 4 pixel frames per latent frame."""
    frames = 1 + (latent_frames - 1) * temporal
    mask = torch.zeros(batch, 1, frames + temporal - 1, height, width, device=device)
    mask[:, :, :temporal] = 1.0
    mask = mask.view(batch, latent_frames, temporal, height, width)
    return mask.transpose(1, 2)


def token_timesteps(timesteps: torch.Tensor, latents: torch.Tensor, patch, first_clean: bool) -> torch.Tensor:
    """(B,) timesteps -> (B, tokens): one per transformer token (latent frames x h / patch x w / patch), as the
    pipelines with expand_timesteps make them; with `first_clean` the first latent frame's tokens are 0."""
    frames, height, width = latents.shape[2:]
    keep = torch.ones(frames, height // patch[1], width // patch[2], device=latents.device)
    if first_clean:
        keep[0] = 0.0
    return keep.flatten()[None, :] * timesteps.view(-1, 1).to(keep.dtype)


def transformer_inputs(model, noisy: torch.Tensor, timesteps: torch.Tensor, encoded: dict) -> tuple:
    """(hidden_states, timestep, extra forward kwargs, first latent frame the loss counts) for this run's mode;
    text-to-video without expanded timesteps: (noisy, timesteps, {}, 0)."""
    patch, mode = model.transformer_config["patch_size"], model.mode
    if mode.layout == "ti2v":
        if mode.image_to_video:
            if noisy.shape[2] < 2:
                raise ValueError(
                    "Wan 2.2 TI2V image-to-video: a one-frame clip (a still image) has no frame to "
                    "learn, its only latent frame being the given image. Remove the stills or set "
                    "model.image_to_video: false."
                )
            condition = normalised_latents(model.vae.config, encoded[CONDITION]).to(noisy.dtype)
            noisy = torch.cat([condition[:, :, :1], noisy[:, :, 1:]], dim=2)
        return noisy, token_timesteps(timesteps, noisy, patch, mode.image_to_video), {}, clean_frames(model)
    if not mode.image_to_video:
        return noisy, timesteps, {}, 0
    condition = normalised_latents(model.vae.config, encoded[CONDITION]).to(noisy.dtype)
    mask = first_frame_mask(len(noisy), noisy.shape[2], noisy.shape[3], noisy.shape[4], device=noisy.device)
    extra = {"encoder_hidden_states_image": encoded[IMAGE_EMBEDS]} if "image_encoder" in model.parts else {}
    return torch.cat([noisy, mask.to(noisy.dtype), condition], dim=1), timesteps, extra, 0


def clean_frames(model) -> int:
    """Latent frames given clean, outside the loss: TI2V image-to-video's first (the given image)."""
    return int(model.mode.layout == "ti2v" and model.mode.image_to_video)


def needs_condition(model, encoded: dict) -> Optional[str]:
    """Why `encoded` lacks what this run's mode needs (a latent cache model for text-to-video), or None."""
    image = model.mode.image_to_video
    missing = [
        name
        for name, wanted in ((CONDITION, image), (IMAGE_EMBEDS, image and "image_encoder" in model.parts))
        if wanted and name not in encoded
    ]
    if not missing:
        return None
    return (
        f"the batch has no {', '.join(missing)} for image-to-video: a latent cache model without them. Delete "
        "data.cache.dir (or choose another) to re-encode."
    )


def encode_conditions(model, batch: dict, dtype: torch.dtype) -> dict:
    """Image-to-video's condition of a batch: from the latent cache as stored, else from the clips' first frames;
    the image embedding in `dtype`. Text-to-video: nothing."""
    if not model.mode.image_to_video:
        return {}
    cached = {name: batch[name].to(model.device) for name in (CONDITION, IMAGE_EMBEDS) if name in batch}
    out = cached or condition_tensors(model, batch_field(batch, "pixel_values"))
    problem = needs_condition(model, out)
    if problem:
        raise ValueError(problem)
    if IMAGE_EMBEDS in out:
        out[IMAGE_EMBEDS] = out[IMAGE_EMBEDS].to(dtype)
    return out


def model_inputs(model, encoded: dict, dtype: torch.dtype) -> dict:
    """The condition tensors as encoded (transformer_inputs normalises and casts them)."""
    return {name: encoded[name] for name in (CONDITION, IMAGE_EMBEDS) if name in encoded}


# ------------------------------------------------------------------------------------------------- sampling


def sample_sources(model, sample_spec, prompts: list[str]) -> Optional[list]:
    """Image-to-video: sample.control_images as RGB images, the first frame of each prompt's clip; FamilyError when
    they are missing or one cannot be read. Text-to-video: None."""
    if not model.mode.image_to_video:
        return None
    return first_frames(sample_spec, prompts)


def sample_inputs(model, text_pipeline, prompt: str, image, sample_spec) -> dict:
    """One clip's first frame and its prompt as embeddings (prompt_inputs); without a text pipeline (no text
    encoder on this rank) the first frame only: the core adds the prompt's cached embeddings."""
    if text_pipeline is None:
        return {"image": image}
    return {
        "image": image,
        **prompt_inputs(text_pipeline, prompt, sample_spec.guidance, model.max_sequence_length, model.device),
    }


def pipeline_class(model, transformer) -> tuple:
    """(the diffusers pipeline class that renders this run's samples, its extra constructor arguments)."""
    with quiet_hf_libraries():
        from diffusers import WanImageToVideoPipeline, WanPipeline
    extra = {"expand_timesteps": model.mode.layout == "ti2v"}
    if transformer is None or not model.mode.image_to_video:
        return WanPipeline, extra
    return WanImageToVideoPipeline, {
        **extra,
        "image_encoder": model.parts.get("image_encoder"),
        "image_processor": model.parts.get("image_processor"),
    }


def prompt_inputs(text_pipeline, prompt: str, guidance: float, max_sequence_length: int, device) -> dict:
    """The prompt (and for guidance above 1 the empty negative prompt) as embeddings, by WanPipeline.encode_prompt:
    the same embeddings WanImageToVideoPipeline makes of a text prompt, without its ftfy-only prompt cleaning (for
    environments without ftfy, which diffusers 0.42 does not depend on)."""
    with torch.no_grad(), quiet_hf_libraries():
        embeds, negative = text_pipeline.encode_prompt(
            prompt, do_classifier_free_guidance=guidance > 1.0, max_sequence_length=max_sequence_length, device=device
        )
    return {"prompt_embeds": embeds, "negative_prompt_embeds": negative}
