"""Wan 2.1's original checkpoint naming (Wan-Video's code, and the fp8 files people download from it:
`blocks.N.self_attn.q`, `head.head`, ...) mapped to diffusers' WanTransformer3DModel names, torch-free. Every tensor
keeps its rows (Wan fuses no projection): the map is names only, with the cross-attention's norm `norm3` (affine)
being diffusers' `norm2`. tests/unit/models/wan/test_original_names.py checks it against diffusers' own converter."""

from __future__ import annotations

import re
from typing import Optional

from dstune.families.quantized_file import OriginalNames

# original name -> diffusers name, outside the blocks (layers, or whole parameters)
TOP = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "head.modulation": "scale_shift_table",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
BLOCK_NORMS = {
    "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.norm_q": "attn2.norm_q",
    "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "norm3": "norm2",  # the cross-attention's input norm (diffusers' norm3 is the feed-forward's, not affine)
    "modulation": "scale_shift_table",
}
BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def wan_original_names(shapes: dict[str, tuple], config: dict, block_names: dict) -> Optional[OriginalNames]:
    """diffusers' name -> (the file's name, None) for a file in Wan's original naming (it has
    `blocks.N.self_attn.` keys); None for any other file. `block_names`: diffusers' block layer -> original (the
    card's original_lora_names)."""
    if not any(BLOCK.match(name) and ".self_attn." in name for name in shapes):
        return None
    in_block = {old: new for new, old in block_names.items()} | BLOCK_NORMS
    out = {}
    for name in shapes:
        layer, _, kind = name.rpartition(".")
        block = BLOCK.fullmatch(name)
        if block is not None:
            rest, prefix = block.group(2), f"blocks.{block.group(1)}."
            layer, _, kind = rest.rpartition(".")
            new = (
                in_block.get(rest)
                and prefix + in_block[rest]
                or in_block.get(layer)
                and f"{prefix}{in_block[layer]}.{kind}"
            )
        else:
            new = TOP.get(name) or (TOP.get(layer) and f"{TOP[layer]}.{kind}")
        if new:
            out[new] = (name, None)
    return OriginalNames("Wan's original names", out)
