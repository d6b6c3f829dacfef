"""What a Wan pipeline folder is and what `model.image_to_video` makes of it: torch-free (its configs only), so that
`dstune validate` and the family's build give the same answer and the same messages.

Three layouts, told by the transformer's and the VAE's configs and model_index.json:

- `t2v`: text-to-video (Wan 2.1 T2V, Wan 2.2 T2V A14B): transformer in_channels = the VAE's z_dim.
- `i2v`: image-to-video with condition channels (Wan 2.1 I2V, Wan 2.2 I2V A14B): in_channels = 2 x z_dim + 4 (the
  noisy latents, the 4-channel first-frame mask and the condition latents, as WanImageToVideoPipeline stacks them).
  Wan 2.1's transformer has an `image_dim` and the folder an `image_encoder` (CLIPVisionModel) and
  `image_processor`; Wan 2.2 A14B's has neither.
- `ti2v`: Wan 2.2 TI2V 5B (`expand_timesteps: true`): in_channels = z_dim; text-to-video with per-token timesteps,
  or image-to-video with the first latent frame replaced by the clean image latent (its tokens at timestep 0).

`model.image_to_video` (None, true, false) picks the mode: None is what the folder is (t2v: text, i2v: image, ti2v:
text); i2v folders need it true or unset, t2v folders false or unset.
"""

from __future__ import annotations

import os
from typing import Optional

MASK_CHANNELS = 4  # WanImageToVideoPipeline's first-frame mask: the VAE's temporal factor, one channel per frame


def layout(index: dict, transformer: dict, vae: dict) -> tuple[Optional[str], list[str]]:
    """("t2v" | "i2v" | "ti2v", problems) of a folder from its model_index.json and the transformer's and VAE's
    configs; (None, problems) when the channels fit no Wan layout."""
    z_dim, channels = vae.get("z_dim"), transformer.get("in_channels")
    has_encoder = (index.get("image_encoder") or [None, None])[1] is not None
    problems = []
    if index.get("expand_timesteps"):
        kind = "ti2v" if channels == z_dim else None
        if kind is None:
            problems.append(
                f"it expands timesteps per token (Wan 2.2 TI2V) but transformer in_channels {channels} "
                f"!= the VAE's z_dim {z_dim}"
            )
    elif channels == z_dim:
        kind = "t2v"
    elif z_dim is not None and channels == 2 * z_dim + MASK_CHANNELS:
        kind = "i2v"
    else:
        return None, [
            f"transformer in_channels {channels} is neither the VAE's z_dim {z_dim} (text-to-video) nor "
            f"2 x {z_dim} + {MASK_CHANNELS} (image-to-video: noisy latents, first-frame mask, condition)"
        ]
    wants_encoder = transformer.get("image_dim") is not None
    if kind is not None and wants_encoder and not has_encoder:
        problems.append(
            f"the transformer takes image embeddings (image_dim {transformer['image_dim']}) but there is "
            "no image_encoder (CLIPVisionModel) in model_index.json"
        )
    if kind is not None and wants_encoder and not (index.get("image_processor") or [None, None])[1]:
        problems.append("it has an image_encoder but no image_processor (CLIPImageProcessor) in model_index.json")
    if kind is not None and has_encoder and not wants_encoder:
        problems.append(
            "it has an image_encoder but the transformer has no image_dim, so nothing would read the image embeddings"
        )
    return kind, problems


def image_to_video(kind: str, setting: Optional[bool]) -> tuple[bool, Optional[str]]:
    """(whether the run trains image-to-video, why `model.image_to_video` does not fit a `kind` folder or None)."""
    if kind == "i2v" and setting is False:
        return True, (
            "model.image_to_video is false, but this is an image-to-video folder: its transformer takes "
            f"2 x z_dim + {MASK_CHANNELS} input channels (noisy latents, first-frame mask, condition "
            "latents), so it only denoises from a first frame. Remove model.image_to_video (or set it "
            "true), or use a text-to-video folder"
        )
    if kind == "t2v" and setting:
        return False, (
            "model.image_to_video is true, but this is a text-to-video folder: its transformer's input "
            "channels are the VAE's z_dim, with no room for a first-frame condition. Use an "
            "image-to-video folder (e.g. Wan-AI/Wan2.1-I2V-14B-480P-Diffusers, or Wan 2.2 TI2V 5B), or "
            "remove model.image_to_video"
        )
    if kind == "i2v":
        return True, None
    return bool(setting), None


def describe(kind: str, image: bool) -> str:
    """One line for messages and the plan: what the run trains."""
    if kind == "ti2v":
        return "Wan 2.2 TI2V, " + (
            "image-to-video (first latent frame from the image)" if image else "text-to-video (per-token timesteps)"
        )
    return "image-to-video (first-frame condition channels)" if image else "text-to-video"


def spec_problems(index: dict, transformer: dict, vae: dict, setting: Optional[bool], sample) -> list[tuple[str, str]]:
    """(dotted key, problem) of a spec on a folder with these configs: the layout, model.image_to_video, and samples
    (image-to-video renders from sample.control_images, one first frame per prompt). `sample`: the SampleSpec."""
    kind, problems = layout(index, transformer, vae)
    if kind is None or problems:
        return [("model.pretrained", problem) for problem in problems]
    image, problem = image_to_video(kind, setting)
    if problem:
        return [("model.image_to_video", problem)]
    found = []
    if image and sample.prompts and not sample.control_images:
        found.append(
            (
                "sample.prompts",
                "image-to-video renders each clip from a first frame: give "
                "sample.control_images, one image per prompt in the same order, or set sample.prompts: []",
            )
        )
    if not image and sample.control_images:
        found.append(
            (
                "sample.control_images",
                "a text-to-video run renders from the prompt alone: remove them, or "
                "set model.image_to_video: true (an image-to-video or Wan 2.2 TI2V folder)",
            )
        )
    missing = [path for path in sample.control_image_paths if not os.path.isfile(os.path.expanduser(path))]
    if image and missing:
        found.append(("sample.control_images", f"{len(missing)} image(s) do not exist: {', '.join(missing)}"))
    return found
