"""The `wan` family: the video models of the flow-matching core, by the folder's transformer class: Wan 2.1 / 2.2
(WanTransformer3DModel, AutoencoderKLWan, UMT5), HunyuanVideo 1.5 (HunyuanVideo15Transformer3DModel,
dstune.families.flow_hunyuan15) and LTX-2 (LTX2VideoTransformer3DModel, dstune.families.flow_ltx2).

Wan trains on the flow-matching core of the image models (dstune.families.flow_core): its clips' latents are
(B, C, frames, H, W) and every step (posterior draw, noise, table positions, x_t, loss, sampling, export) is the
core's. What is Wan's is its recipe, dstune.families.flow_wan (text through WanPipeline.encode_prompt, the scheduler's
flow_shift, the two experts of Wan 2.2 A14B), with its first-frame conditioning in dstune.families.wan_i2v
(image-to-video: Wan 2.1 I2V, Wan 2.2 I2V A14B; Wan 2.2 TI2V). This module is the family the stages call: the folder
checks against the spec (model.expert, model.image_to_video, model.timestep_range), build, and the caches' keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from dstune.families import flow_hunyuan15, flow_ltx2, hunyuan15_i2v, wan_i2v
from dstune.families.base import Family, FamilyError, LatentExtras, TextCache
from dstune.families.diffusion import read_component_config
from dstune.families.flow_core import (FlowBuilt, build_from, encode_batch, encode_captions, export, loss, sample,
                                       save_lora_weights, text_cache_settings)
from dstune.families.flow_wan import (COMPONENTS, TEXT_TENSORS, WAN, expert_positions, folder_problems,
                                      other_expert_loaded, train_tables)
from dstune.families.samples import save_clip_grid
from dstune.families.wan_i2v import folder_mode
from dstune.spec.models import WanModel

__all__ = ["build", "encode_batch", "encode_captions", "loss", "sample", "export", "save_lora_weights", "FAMILY",
           "COMPONENTS", "folder_problems", "folder_mode", "train_tables", "expert_positions",
           "other_expert_loaded", "wan_i2v_cache_key"]

TEXT_CACHE_FOLDERS = ("text_encoder", "tokenizer")  # Wan's UMT5; HunyuanVideo 1.5 adds its ByT5 glyph encoder's
HV15_TEXT_CACHE_FOLDERS = TEXT_CACHE_FOLDERS + ("text_encoder_2", "tokenizer_2")
LTX2_TEXT_CACHE_FOLDERS = TEXT_CACHE_FOLDERS + ("connectors",)  # the cache stores the connectors' outputs


def _transformer_class(folder: Path) -> Optional[str]:
    path = Path(folder) / "transformer" / "config.json"
    return read_component_config(Path(folder), "transformer").get("_class_name") if path.is_file() else None


def is_hunyuan_video15(folder: Path) -> bool:
    """Whether the folder's transformer is HunyuanVideo 1.5's (its recipe), else Wan's or LTX-2's."""
    return _transformer_class(folder) == flow_hunyuan15.TRANSFORMER_CLASS


def is_ltx2(folder: Path) -> bool:
    """Whether the folder's transformer is LTX-2's (dstune.families.flow_ltx2)."""
    return _transformer_class(folder) == flow_ltx2.TRANSFORMER_CLASS


def _recipe(folder: Path):
    if is_ltx2(folder):
        return flow_ltx2.LTX2
    return flow_hunyuan15.recipe_of(Path(folder)) if is_hunyuan_video15(folder) else WAN


def _text_cache_folders(folder: Path) -> tuple[str, ...]:
    if is_ltx2(folder):
        return LTX2_TEXT_CACHE_FOLDERS
    return HV15_TEXT_CACHE_FOLDERS if is_hunyuan_video15(folder) else TEXT_CACHE_FOLDERS


def build(model: WanModel, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32,
          zero3_config: Optional[dict] = None) -> FlowBuilt:
    """The transformer (model.expert's) fp32 in host memory (partitioned with `zero3_config`), the VAE, UMT5 (and Wan
    2.1 I2V's image encoder) frozen in `dtype_for_frozen`. Never downloads; FamilyError listing every problem of a
    folder that is not a Wan pipeline this spec can train."""
    folder = folders["pretrained"]
    hunyuan, ltx2 = is_hunyuan_video15(folder), is_ltx2(folder)
    check = flow_hunyuan15.folder_problems if hunyuan else flow_ltx2.folder_problems if ltx2 else folder_problems
    problems = check(folder, model.expert, model.image_to_video, model.timestep_range)
    if ltx2:
        problems += flow_ltx2.settings_problems(model)
    elif model.timestep_sampling == "shifted_logit_normal":
        problems.append("model.timestep_sampling shifted_logit_normal is LTX-2's (ltx-trainer's sampler); use "
                        "uniform, logit_normal or mode")
    if problems:
        what = "HunyuanVideo 1.5" if hunyuan else "LTX-2" if ltx2 else "Wan"
        raise FamilyError(f"{folder} cannot be used as a {what} pipeline (model.family wan):\n"
                          + "\n".join(f"  - {p}" for p in problems))
    built = build_from(_recipe(folder), model, folders, device, dtype_for_frozen, zero3_config)
    if hunyuan:  # diffusers 0.42's HunyuanVideo 1.5 VAE attention mask fits one clip: encode a batch clip by clip
        built.vae.enable_slicing()
    return built


def wan_i2v_cache_key(model: WanModel, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """What keys the latent entries of an image-to-video run beside the VAE: the mode (the condition stored with
    the posterior) and the image encoder's folders, and the tensors stored; ("", (), ()) for text-to-video (the
    entries are the posterior's)."""
    if is_ltx2(Path(folder)):
        return "", (), ()
    if is_hunyuan_video15(Path(folder)):
        if not hunyuan15_i2v.is_image_to_video(Path(folder)):
            return "", (), ()
        return ("image_to_video/hunyuan_video15", ("image_encoder", "feature_extractor"),
                (hunyuan15_i2v.IMAGE_EMBEDS,))
    mode = folder_mode(Path(folder), model.image_to_video)
    if not mode.image_to_video:
        return "", (), ()
    if read_component_config(folder, "transformer").get("image_dim") is None:
        return f"image_to_video/{mode.layout}", (), (wan_i2v.CONDITION,)
    return (f"image_to_video/{mode.layout}", ("image_encoder", "image_processor"),
            (wan_i2v.CONDITION, wan_i2v.IMAGE_EMBEDS))


def condition_tensors(built, clips: torch.Tensor) -> dict:
    """What the latent cache stores beside an image-to-video clip's posterior, per the run's recipe."""
    if built.recipe.transformer_class == flow_hunyuan15.TRANSFORMER_CLASS:
        return hunyuan15_i2v.condition_tensors(built, clips)
    return wan_i2v.condition_tensors(built, clips)


FAMILY = Family(
    name="wan", modality="video", pretrained_fields=("pretrained",), build=build, encode_batch=encode_batch,
    loss=loss, sample=sample, save_samples=save_clip_grid, export=export, save_lora_weights=save_lora_weights,
    text_cache=TextCache(TEXT_CACHE_FOLDERS, TEXT_TENSORS, encode_captions, text_cache_settings,
                         tensors_of=lambda folder: _recipe(Path(folder)).text_tensors,
                         folders_of=lambda folder: _text_cache_folders(Path(folder))),
    builds_partitioned=True, latent_extras=LatentExtras(wan_i2v_cache_key, condition_tensors))
