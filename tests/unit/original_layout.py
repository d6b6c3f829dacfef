"""Test helper: a diffusers UNet2DConditionModel's weights renamed to the original Stable Diffusion (ldm / sgm)
checkpoint layout, `model.diffusion_model.input_blocks.N.M...`, the layout single-file checkpoints from model hubs
and ComfyUI use and diffusers' `from_single_file` reads. Written here from the two layouts' structure (the UNet's
blocks in order: conv_in, then per resolution level its layers and a downsampler; the middle block; the up levels
with one layer more each), for building test fixtures only."""

from __future__ import annotations

import re

UNET_PREFIX = "model.diffusion_model."
# diffusers resnet parts -> the original ResBlock's Sequential indices
_RESNET_PARTS = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_TOP_LEVEL = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}


def _resnet(rest: str) -> str:
    part, _, tail = rest.partition(".")
    return f"{_RESNET_PARTS[part]}.{tail}"


def original_unet_name(name: str, config) -> str:
    """One diffusers UNet weight name -> its name in the original layout (without the model prefix)."""
    per_level = config.layers_per_block + 1  # layers of a down level plus its downsampler (an up level: layers)
    for diffusers_name, original in _TOP_LEVEL.items():
        if name.startswith(diffusers_name + "."):
            return original + name[len(diffusers_name) :]
    found = re.fullmatch(
        r"(down_blocks|mid_block|up_blocks)\.(?:(\d+)\.)?(resnets|attentions|downsamplers|upsamplers)"
        r"\.(\d+)\.(.*)",
        name,
    )
    if found is None:
        raise ValueError(f"no original name for {name}")
    where, level, kind, layer, rest = found.groups()
    level, layer = int(level or 0), int(layer)
    if where == "mid_block":
        return f"middle_block.{2 * layer}.{_resnet(rest)}" if kind == "resnets" else f"middle_block.1.{rest}"
    if kind == "downsamplers":
        return f"input_blocks.{(level + 1) * per_level}.0.op.{rest.removeprefix('conv.')}"
    if kind == "upsamplers":
        attention = "CrossAttn" in config.up_block_types[level]
        return f"output_blocks.{level * per_level + per_level - 1}.{2 if attention else 1}.{rest}"
    block = (
        f"input_blocks.{1 + level * per_level + layer}"
        if where == "down_blocks"
        else f"output_blocks.{level * per_level + layer}"
    )
    return f"{block}.0.{_resnet(rest)}" if kind == "resnets" else f"{block}.1.{rest}"


def original_unet_state(unet) -> dict:
    return {
        UNET_PREFIX + original_unet_name(name, unet.config): tensor.contiguous()
        for name, tensor in unet.state_dict().items()
    }
