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
