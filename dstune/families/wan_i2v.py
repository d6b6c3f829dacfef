"""Image-to-video for the `wan` family: what WanImageToVideoPipeline (and WanPipeline with expand_timesteps) feeds
the transformer, rebuilt from a training clip's own first frame (dstune.wan_layouts tells the layouts).

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
from dstune.families.diffusion import load_component
from dstune.families.flow_recipe import normalised_latents
from dstune.wan_layouts import MASK_CHANNELS
from dstune.hf import quiet_hf_libraries
from dstune.families.samples import read_control_images

CONDITION = "condition_mean"  # the condition's VAE mode, unnormalised, float32 (B, z_dim, f, h, w)
IMAGE_EMBEDS = "image_embeds"  # the image encoder's hidden_states[-2] of the first frame (Wan 2.1 I2V)


def load_image_encoder(folder: Path, dtype: torch.dtype, device) -> tuple:
    """(CLIPVisionModel frozen in `dtype` on `device`, the folder's CLIPImageProcessor). transformers without
    torchvision gives the PIL-based processor (the same arithmetic)."""
    import transformers

    encoder = load_component(folder, "image_encoder", transformers.CLIPVisionModel.from_pretrained, torch_dtype=dtype)
    with quiet_hf_libraries():
        try:
            processor = transformers.CLIPImageProcessor.from_pretrained(folder / "image_processor")
        except (OSError, ValueError) as err:
            raise FamilyError(f"{folder / 'image_processor'}: cannot load the CLIPImageProcessor ({err}). A Wan 2.1 "
                              "image-to-video folder needs image_processor/ as diffusers saves it.") from None
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
    return torch.cat([first, first.new_zeros(first.shape[0], first.shape[1], clips.shape[2] - 1, *first.shape[3:])],
                     dim=2)


def condition_tensors(built, clips: torch.Tensor) -> dict[str, torch.Tensor]:
    """The condition of clips (B, 3, F, H, W) in [-1, 1]: {condition_mean: the VAE mode, float32} and, where the
    transformer reads one, {image_embeds}. Deterministic; the latent cache stores exactly this."""
    pixels = condition_pixels(clips, built.kind == "ti2v").to(built.device, built.vae.dtype)
    with torch.no_grad():
        out = {CONDITION: built.vae.encode(pixels).latent_dist.mode().float()}
        if built.image_encoder is not None:
            out[IMAGE_EMBEDS] = image_embeddings(built, frame_images(clips[:, :, 0]))
    return out


def image_embeddings(built, images: list) -> torch.Tensor:
    """WanImageToVideoPipeline.encode_image: the image encoder's second-to-last hidden states."""
    inputs = built.image_processor(images=images, return_tensors="pt").to(built.device)
    inputs["pixel_values"] = inputs["pixel_values"].to(built.image_encoder.dtype)
    with torch.no_grad():
        return built.image_encoder(**inputs, output_hidden_states=True).hidden_states[-2]


def first_frame_mask(batch: int, latent_frames: int, height: int, width: int, temporal: int = MASK_CHANNELS,
                     device=None) -> torch.Tensor:
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


def transformer_inputs(built, noisy: torch.Tensor, timesteps: torch.Tensor, encoded: dict) -> tuple:
    """(hidden_states, timestep, extra forward kwargs, first latent frame the loss counts) for this run's mode;
    text-to-video without expanded timesteps: (noisy, timesteps, {}, 0)."""
    patch = built.transformer_config["patch_size"]
    if built.kind == "ti2v":
        if built.image_to_video:
            if noisy.shape[2] < 2:
                raise ValueError("Wan 2.2 TI2V image-to-video: a one-frame clip (a still image) has no frame to "
                                 "learn, its only latent frame being the given image. Remove the stills or set "
                                 "model.image_to_video: false.")
            condition = normalised_latents(built.vae.config, encoded[CONDITION]).to(noisy.dtype)
            noisy = torch.cat([condition[:, :, :1], noisy[:, :, 1:]], dim=2)
        return noisy, token_timesteps(timesteps, noisy, patch, built.image_to_video), {}, int(built.image_to_video)
    if not built.image_to_video:
        return noisy, timesteps, {}, 0
    condition = normalised_latents(built.vae.config, encoded[CONDITION]).to(noisy.dtype)
    mask = first_frame_mask(len(noisy), noisy.shape[2], noisy.shape[3], noisy.shape[4], device=noisy.device)
    extra = {"encoder_hidden_states_image": encoded[IMAGE_EMBEDS]} if built.image_encoder is not None else {}
    return torch.cat([noisy, mask.to(noisy.dtype), condition], dim=1), timesteps, extra, 0


def needs_condition(built, encoded: dict) -> Optional[str]:
    """Why `encoded` lacks what this run's mode needs (a latent cache built for text-to-video), or None."""
    missing = [name for name, wanted in ((CONDITION, built.image_to_video),
                                         (IMAGE_EMBEDS, built.image_to_video and built.image_encoder is not None))
               if wanted and name not in encoded]
    if not missing:
        return None
    return (f"the batch has no {', '.join(missing)} for image-to-video: a latent cache built without them. Delete "
            "data.cache.dir (or choose another) to re-encode.")


# ------------------------------------------------------------------------------------------------- sampling


def sample_images(paths: list[str], prompts: list[str]) -> list:
    """sample.control_images as RGB images, the first frame of each prompt's clip; FamilyError when they are missing
    or one cannot be read."""
    if len(paths) != len(prompts):
        raise FamilyError("sample.control_images: image-to-video renders each clip from a first frame: give one image "
                          f"per prompt ({len(prompts)} prompt(s), {len(paths)} image(s)), or set sample.prompts: []")
    try:
        return read_control_images(paths)
    except ValueError as err:
        raise FamilyError(str(err)) from None


def pipeline_class(built, transformer) -> tuple:
    """(the diffusers pipeline class that renders this run's samples, its extra constructor arguments)."""
    with quiet_hf_libraries():
        from diffusers import WanImageToVideoPipeline, WanPipeline
    extra = {"expand_timesteps": built.kind == "ti2v"}
    if transformer is None or not built.image_to_video:
        return WanPipeline, extra
    return WanImageToVideoPipeline, {**extra, "image_encoder": built.image_encoder,
                                     "image_processor": built.image_processor}


def prompt_inputs(text_pipeline, prompt: str, guidance: float, max_sequence_length: int, device) -> dict:
    """The prompt (and for guidance above 1 the empty negative prompt) as embeddings, by WanPipeline.encode_prompt:
    the same embeddings WanImageToVideoPipeline makes of a text prompt, without its ftfy-only prompt cleaning (for
    environments without ftfy, which diffusers 0.42 does not depend on)."""
    with torch.no_grad(), quiet_hf_libraries():
        embeds, negative = text_pipeline.encode_prompt(prompt, do_classifier_free_guidance=guidance > 1.0,
                                                       max_sequence_length=max_sequence_length, device=device)
    return {"prompt_embeds": embeds, "negative_prompt_embeds": negative}
