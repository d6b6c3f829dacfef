"""Quantized single-file transformers written from a model's real weights in the layouts people download them in
(test helpers, not tests): ComfyUI's scaled fp8 (musubi-tuner and diffusion-pipe write the same) and ComfyUI's
int8_tensorwise layers. The layouts: dstune/families/quantized_file.py."""

from __future__ import annotations

import json

import torch

FP8_MAX = 448.0  # the largest float8_e4m3fn value


def linear_weights(module: torch.nn.Module) -> set[str]:
    """The names of the module's nn.Linear weights (what a quantized file stores quantized)."""
    return {f"{name}.weight" for name, layer in module.named_modules() if type(layer) is torch.nn.Linear}


def write_scaled_fp8(module: torch.nn.Module, path, prefix: str = "", plain=torch.bfloat16) -> dict:
    """ComfyUI's scaled fp8: each linear weight in float8_e4m3fn with its fp32 `scale_weight` (absmax / 448, one
    per tensor), a `scaled_fp8` marker, the other tensors in `plain`. Returns what was written."""
    from safetensors.torch import save_file

    quantized, out = linear_weights(module), {}
    for name, tensor in module.state_dict().items():
        tensor = tensor.detach().float()
        if name in quantized:
            scale = tensor.abs().max().clamp(min=1e-12) / FP8_MAX
            out[prefix + name] = (tensor / scale).to(torch.float8_e4m3fn)
            out[prefix + name.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
        else:
            out[prefix + name] = tensor.to(plain)
    out[prefix + "scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    save_file(out, str(path))
    return out


def write_comfy_int8(module: torch.nn.Module, path, plain=torch.bfloat16) -> dict:
    """ComfyUI's int8_tensorwise layers: int8 weights, one fp32 `weight_scale` per output row (absmax / 127), a
    `comfy_quant` JSON tensor per layer."""
    from safetensors.torch import save_file

    quantized, out = linear_weights(module), {}
    marker = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    for name, tensor in module.state_dict().items():
        tensor = tensor.detach().float()
        if name in quantized:
            layer = name.removesuffix(".weight")
            scale = tensor.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            out[name] = (tensor / scale).round().clamp(-127, 127).to(torch.int8)
            out[layer + ".weight_scale"], out[layer + ".comfy_quant"] = scale, marker.clone()
        else:
            out[name] = tensor.to(plain)
    save_file(out, str(path))
    return out


# ------------------------------------------------------------------ a model's original naming (the inverse, by hand)
# Each original tensor is its diffusers pieces concatenated by rows: [(diffusers name, its rows or None), ...]. The
# maps are written here from diffusers' names toward the originals (the direction dstune does not read), so that a
# test compares dstune's reading with an independent writing; tests check these maps against diffusers' converters.


def flux_original_pieces(names: dict) -> dict[str, list]:
    """Flux.1's original tensors from FluxTransformer2DModel's parameters (`names`: name -> tensor)."""
    out = {}

    def layer(original, *pieces, suffixes=("weight", "bias")):
        for kind in suffixes:
            if f"{pieces[0]}.{kind}" in names:
                out[f"{original}.{kind}"] = [(f"{piece}.{kind}", None) for piece in pieces]

    for old, new in [("time_in", "timestep"), ("vector_in", "text"), ("guidance_in", "guidance")]:
        layer(f"{old}.in_layer", f"time_text_embed.{new}_embedder.linear_1")
        layer(f"{old}.out_layer", f"time_text_embed.{new}_embedder.linear_2")
    layer("txt_in", "context_embedder")
    layer("img_in", "x_embedder")
    layer("final_layer.linear", "proj_out")
    for kind in ("weight", "bias"):  # original (shift, scale) = diffusers' (scale, shift) halves swapped
        rows = len(names[f"norm_out.linear.{kind}"])
        half = rows // 2
        pieces = [(f"norm_out.linear.{kind}", (half, rows)), (f"norm_out.linear.{kind}", (0, half))]
        out[f"final_layer.adaLN_modulation.1.{kind}"] = pieces
    doubles = {int(n.split(".")[1]) for n in names if n.startswith("transformer_blocks.")}
    for i in sorted(doubles):
        d, b = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        layer(d + "img_mod.lin", b + "norm1.linear")
        layer(d + "txt_mod.lin", b + "norm1_context.linear")
        layer(d + "img_attn.qkv", b + "attn.to_q", b + "attn.to_k", b + "attn.to_v")
        layer(d + "txt_attn.qkv", b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj")
        layer(d + "img_attn.proj", b + "attn.to_out.0")
        layer(d + "txt_attn.proj", b + "attn.to_add_out")
        layer(d + "img_mlp.0", b + "ff.net.0.proj")
        layer(d + "img_mlp.2", b + "ff.net.2")
        layer(d + "txt_mlp.0", b + "ff_context.net.0.proj")
        layer(d + "txt_mlp.2", b + "ff_context.net.2")
        for old, new in [("img_attn", "norm_"), ("txt_attn", "norm_added_")]:
            out[f"{d}{old}.norm.query_norm.scale"] = [(f"{b}attn.{new}q.weight", None)]
            out[f"{d}{old}.norm.key_norm.scale"] = [(f"{b}attn.{new}k.weight", None)]
    singles = {int(n.split(".")[1]) for n in names if n.startswith("single_transformer_blocks.")}
    for i in sorted(singles):
        s, b = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        layer(s + "modulation.lin", b + "norm.linear")
        layer(s + "linear1", b + "attn.to_q", b + "attn.to_k", b + "attn.to_v", b + "proj_mlp")
        layer(s + "linear2", b + "proj_out")
        out[s + "norm.query_norm.scale"] = [(b + "attn.norm_q.weight", None)]
        out[s + "norm.key_norm.scale"] = [(b + "attn.norm_k.weight", None)]
    return out


WAN_ORIGINAL = [  # diffusers' name part -> Wan's original (first match wins)
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("attn1.to_out.0", "self_attn.o"),
    ("attn2.to_out.0", "cross_attn.o"),
    ("attn2.add_k_proj", "cross_attn.k_img"),
    ("attn2.add_v_proj", "cross_attn.v_img"),
    ("attn2.norm_added_k", "cross_attn.norm_k_img"),
    ("attn1.to_", "self_attn."),
    ("attn2.to_", "cross_attn."),
    ("attn1.", "self_attn."),
    ("attn2.", "cross_attn."),
    (".norm2.", ".norm3."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
]


def wan_original_pieces(names) -> dict[str, list]:
    """Wan 2.1's original tensors from WanTransformer3DModel's parameter names (renamed only)."""
    out = {}
    for name in names:
        original = name
        if name == "scale_shift_table":
            original = "head.modulation"
        elif name.endswith(".scale_shift_table"):
            original = name.replace("scale_shift_table", "modulation")
        for new, old in WAN_ORIGINAL:
            if new in original:
                original = original.replace(new, old)
                if not new.startswith("attn"):
                    break
        out[original] = [(name, None)]
    return out


def to_original(state: dict, pieces: dict) -> dict:
    """The original-named tensors: each its diffusers pieces concatenated by rows."""
    return {
        original: torch.cat([state[name] if rows is None else state[name][slice(*rows)] for name, rows in parts])
        for original, parts in pieces.items()
    }


def _split(tensor: torch.Tensor, parts: list, state: dict) -> dict:
    """An original tensor's rows back into its diffusers pieces (fp8 moved as int8 bytes: torch.cat's dtypes)."""
    values = tensor.view(torch.int8) if tensor.dtype == torch.float8_e4m3fn else tensor
    start, rows_of = 0, {}
    for name, rows in parts:
        count = (rows[1] - rows[0]) if rows else state[name].shape[0]
        rows_of.setdefault(name, []).append(((rows or (0,))[0], values[start : start + count]))
        start += count
    out = {}
    for name, found in rows_of.items():
        whole = torch.cat([piece for _, piece in sorted(found, key=lambda item: item[0])])
        out[name] = whole.view(tensor.dtype) if tensor.dtype == torch.float8_e4m3fn else whole
    return out


def write_original_quantized(module: torch.nn.Module, pieces_of, original_path, diffusers_path, prefix="", kind="fp8"):
    """The module's weights as a quantized file in the model's original naming (each original linear weight, a
    fused one whole): `kind` fp8, ComfyUI's scaled fp8 (float8_e4m3fn, one fp32 scale a tensor), or int8, ComfyUI's
    int8_tensorwise (one fp32 scale a row); and the same bytes in diffusers' naming: each piece of a fused weight
    its rows of the fused bytes, with the fused tensor's scale (fp8) or its rows' scales (int8). Returns the
    original file's tensors."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().float() for name, tensor in module.state_dict().items()}
    linear, pieces = linear_weights(module), pieces_of(state)
    marker = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    original, diffusers = {}, {}
    for key, tensor in to_original(state, pieces).items():
        parts = pieces[key]
        if not all(name in linear for name, _ in parts):
            original[prefix + key] = tensor.to(torch.bfloat16)
            diffusers.update(_split(original[prefix + key], parts, state))
            continue
        layer = key.removesuffix(".weight")
        if kind == "fp8":
            scale = (tensor.abs().max().clamp(min=1e-12) / FP8_MAX).reshape(())
            stored = (tensor / scale).to(torch.float8_e4m3fn)
            original[prefix + layer + ".scale_weight"] = scale
            diffusers.update({n.removesuffix(".weight") + ".scale_weight": scale.clone() for n, _ in parts})
        else:
            scale = tensor.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            stored = (tensor / scale).round().clamp(-127, 127).to(torch.int8)
            original[prefix + layer + ".weight_scale"], original[prefix + layer + ".comfy_quant"] = scale, marker
            scales = _split(scale, parts, state)
            diffusers.update({n.removesuffix(".weight") + ".weight_scale": s for n, s in scales.items()})
            diffusers.update({n.removesuffix(".weight") + ".comfy_quant": marker.clone() for n, _ in parts})
        original[prefix + key] = stored
        diffusers.update(_split(stored, parts, state))
    if kind == "fp8":
        original[prefix + "scaled_fp8"] = diffusers["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    save_file({k: v.clone() if k.endswith(".comfy_quant") else v for k, v in original.items()}, str(original_path))
    save_file(diffusers, str(diffusers_path))
    return original
