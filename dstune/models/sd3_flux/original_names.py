"""Flux.1's original checkpoint naming (black-forest-labs' `flux` code, and the fp8 files people download from it:
`double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`, ...) mapped to diffusers' FluxTransformer2DModel names,
torch-free: each diffusers parameter is the rows of one file tensor. The fused projections split by rows: qkv into
thirds; a single block's linear1 into q, k, v (the attention width each) and the MLP's input (the rest);
final_layer.adaLN_modulation's (shift, scale) halves swapped to diffusers' (scale, shift). tests/unit/models/
sd3_flux/test_original_names.py checks this map against diffusers' own converter at Flux.1-dev's shapes."""

from __future__ import annotations

from typing import Optional

from dstune.families.quantized_file import OriginalNames

# original layer -> diffusers layer, the whole tensor (weight and bias alike)
RENAMED = {
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
}
DOUBLE_BLOCK = {
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
}
DOUBLE_BLOCK_NORMS = {  # RMSNorm scales: `.scale` -> `.weight`
    "img_attn.norm.query_norm": "attn.norm_q",
    "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q",
    "txt_attn.norm.key_norm": "attn.norm_added_k",
}
DOUBLE_BLOCK_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}
DOUBLE_BLOCK_QKV["txt_attn.qkv"] = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
SINGLE_BLOCK = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
SINGLE_BLOCK_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
SINGLE_BLOCK_LINEAR1 = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def _blocks(shapes: dict, kind: str) -> list[int]:
    return sorted({int(name.split(".")[1]) for name in shapes if name.startswith(kind + ".")})


def flux_original_names(shapes: dict[str, tuple], config: dict) -> Optional[OriginalNames]:
    """diffusers' name -> (the file's name, rows) for a file in Flux.1's original naming (it has `double_blocks.`
    keys); None for any other file. `shapes`: the file's parameter names (prefix removed) and shapes; `config`: the
    pipeline's transformer config (its attention width splits linear1)."""
    if not any(name.startswith("double_blocks.") for name in shapes):
        return None
    width = config["num_attention_heads"] * config["attention_head_dim"]
    layers = {old: (new, None) for old, new in RENAMED.items()}
    for i in _blocks(shapes, "double_blocks"):
        layers.update(
            {f"double_blocks.{i}.{o}": (f"transformer_blocks.{i}.{n}", None) for o, n in DOUBLE_BLOCK.items()}
        )
        for fused, pieces in DOUBLE_BLOCK_QKV.items():
            layers.update(
                {
                    (f"double_blocks.{i}.{fused}", k): (f"transformer_blocks.{i}.{n}", ((k * width, (k + 1) * width),))
                    for k, n in enumerate(pieces)
                }
            )
    for i in _blocks(shapes, "single_blocks"):
        layers.update(
            {f"single_blocks.{i}.{o}": (f"single_transformer_blocks.{i}.{n}", None) for o, n in SINGLE_BLOCK.items()}
        )
        rows = shapes.get(f"single_blocks.{i}.linear1.weight", (4 * width,))[0]
        bounds = (0, width, 2 * width, 3 * width, rows)
        layers.update(
            {
                (f"single_blocks.{i}.linear1", k): (f"single_transformer_blocks.{i}.{n}", ((bounds[k], bounds[k + 1]),))
                for k, n in enumerate(SINGLE_BLOCK_LINEAR1)
            }
        )
    out = {}
    for old, (new, rows) in layers.items():
        source = old[0] if isinstance(old, tuple) else old
        for kind in ("weight", "bias"):
            if f"{source}.{kind}" in shapes:
                out[f"{new}.{kind}"] = (f"{source}.{kind}", rows)
    modulation = "final_layer.adaLN_modulation.1"
    for kind in ("weight", "bias"):
        if f"{modulation}.{kind}" in shapes:
            half = shapes[f"{modulation}.{kind}"][0] // 2
            out[f"norm_out.linear.{kind}"] = (f"{modulation}.{kind}", ((half, 2 * half), (0, half)))
    norms = [
        (f"double_blocks.{i}.{o}", f"transformer_blocks.{i}.{n}")
        for i in _blocks(shapes, "double_blocks")
        for o, n in DOUBLE_BLOCK_NORMS.items()
    ]
    norms += [
        (f"single_blocks.{i}.{o}", f"single_transformer_blocks.{i}.{n}")
        for i in _blocks(shapes, "single_blocks")
        for o, n in SINGLE_BLOCK_NORMS.items()
    ]
    out.update({f"{new}.weight": (f"{old}.scale", None) for old, new in norms})
    return OriginalNames("Flux.1's original names", out)
