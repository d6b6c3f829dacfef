"""MiniMax-H3's first-frame workflow (fl2va, `model.image_to_video: true`) for its class (dstune.models.minimax_h3.model):
what MiniMaxH3ModularPipeline's fl2va blocks build from a keyframe, rebuilt from each training clip's own first frame.

- The keyframe's latent: the frame's 8-bit pixels through the video VAE alone (one frame: its spatial encoder, no
  17-frame chunking), ImageNet-normalised from [0, 1], the posterior *sampled* under a generator seeded 42 (the
  pipeline's keyframe_encode_seed, independent of any other draw), rounded through float16, normalised per channel:
  diffusers' own encode_vae_condition, called as MiniMaxH3KeyframeVaeEncoderStep calls it. The latent cache stores
  it beside the clip's posterior with the frame's pixels (the text needs them).
- The presentation (the text rows): `"<Picture 1>: "`, a vision block `<|vision_start|> <|image_pad|> x n
  <|vision_end|>` of the frame through Qwen3-VL's image processor and vision tower, then the caption verbatim, all
  through the text encoder at once (MiniMaxH3FL2VATextEncoderStep); the vision block's rows are tagged video (0),
  the rest text (1). So a clip's text rows belong to its caption *and* its frame: they are not cached per caption.
- The layout: `[text | keyframe rows | audio | video]`, the keyframe rows at the first latent frame's rotary time
  (MiniMaxH3PrepareLayoutStep with keyframe_anchors ("first",)), noised to t = 0.999 (x = 0.999 x0 + 0.001 noise,
  the scheduler's scale_noise) and held at timestep max(t, 0.999); the loss reads the target rows only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstune.families.base import FamilyError
from dstune.hf import quiet_hf_libraries
from dstune.models.minimax_h3.card import KEYFRAME_SEED, TEXT_TAG, VIDEO_TAG

QWEN3_VL_PIXEL_MEAN = QWEN3_VL_PIXEL_STD = (0.5, 0.5, 0.5)  # Qwen3-VL's image processor's normalisation


def image_processor(folder: Path, text_encoder):
    """Qwen3-VL's image processor: the folder's `processor/preprocessor_config.json` where it has one (the released
    folder does), else one of the text encoder's vision geometry (patch, temporal patch, merge) with Qwen3-VL's
    normalisation (the built-in tiny folder has no processor: transformers builds a Qwen3VLProcessor only with
    torchvision). The PIL-based class: the same arithmetic without torchvision."""
    with quiet_hf_libraries():
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Path(folder) / "processor" / "preprocessor_config.json"
    if config.is_file():
        try:
            settings = json.loads(config.read_text())
        except ValueError as err:
            raise FamilyError(f"{config}: not JSON ({err}); the folder's Qwen3-VL processor is unreadable") from None
        keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "size")
        return Qwen2VLImageProcessorPil(**{key: settings[key] for key in keys if key in settings})
    vision = text_encoder.config.vision_config
    return Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        image_mean=list(QWEN3_VL_PIXEL_MEAN),
        image_std=list(QWEN3_VL_PIXEL_STD),
    )


def frame_bytes(clips: torch.Tensor) -> torch.Tensor:
    """Clips (B, 3, F, H, W) in [-1, 1] -> their first frames' 8-bit pixels (B, 3, H, W) (exact for 8-bit frames)."""
    return ((clips[:, :, 0].detach().float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)


def keyframe_tensors(vae, clips: torch.Tensor, pixel_mean, pixel_std) -> dict[str, torch.Tensor]:
    """Each clip's first frame encoded as the pipeline encodes a keyframe (encode_vae_condition, one frame a call: its
    generator is seeded per keyframe), (B, C, 1, h, w) float32, and the frame's pixels (B, 3, H, W) uint8."""
    with quiet_hf_libraries():
        from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    pixels = frame_bytes(clips).to(clips.device)
    with torch.no_grad():
        latents = [
            encode_vae_condition(vae, frame[None, :, None], pixel_mean, pixel_std, KEYFRAME_SEED) for frame in pixels
        ]
    return {"keyframe_latent": torch.cat(latents).to(clips.device), "keyframe_pixels": pixels}


def pil_images(pixels: torch.Tensor) -> list:
    """(B, 3, H, W) uint8 -> RGB PIL images."""
    from PIL import Image

    return [Image.fromarray(frame.permute(1, 2, 0).cpu().numpy()) for frame in pixels.to(torch.uint8)]


def presentation(tokenizer, processor, caption_ids: list[int], images: list) -> tuple[list[int], list[int], dict]:
    """(token ids, MiniMax-H3 row tags, the vision tower's inputs) of a caption after its keyframes: per keyframe a
    `"<Picture i>: "` label (text) and a vision block (video), then the caption (text); as
    MiniMaxH3FL2VATextEncoderStep tokenizes it (no chat template, no special tokens)."""
    if not images:
        return list(caption_ids), [TEXT_TAG] * len(caption_ids), {}
    vision = processor(images=images, return_tensors="pt")
    grid = vision["image_grid_thw"]
    merge = processor.merge_size**2
    start, pad, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    ids, tags = [], []
    for number in range(len(images)):
        label = tokenizer(f"<Picture {number + 1}>: ", add_special_tokens=False)["input_ids"]
        block = [start] + [pad] * (int(grid[number].prod()) // merge) + [end]
        ids += label + block
        tags += [TEXT_TAG] * len(label) + [VIDEO_TAG] * len(block)
    ids += caption_ids
    tags += [TEXT_TAG] * len(caption_ids)
    return ids, tags, {"pixel_values": vision["pixel_values"], "image_grid_thw": grid}


def noised_keyframe(latent: torch.Tensor, noise: torch.Tensor, scheduler, level: float) -> torch.Tensor:
    """The keyframe's latent held just short of clean: the scheduler's scale_noise at t = `level` (0.999), as
    MiniMaxH3PrepareConditionLatentsStep noises it (float32)."""
    return scheduler.scale_noise(latent.float(), level, noise.float())


def canvas_keyframe(image, width: int, height: int):
    """A sample's first frame on the width x height canvas, as MiniMaxH3ResizeStep stretches the first keyframe (PIL's
    LANCZOS resize): the presentation the class encodes then sees the frame the pipeline's VAE encodes."""
    from PIL import Image

    return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.LANCZOS)
