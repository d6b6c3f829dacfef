"""`model.base_precision`: the frozen denoiser's linear weights stored quantized under LoRA (QLoRA-style).

Why bitsandbytes (tried against torchao and optimum-quanto, see docs/lora-and-ema.md): its quantized weights are
`torch.nn.Parameter` subclasses holding plain int8/uint8 data with the scales beside it, so
`deepspeed.initialize` handles them like any frozen weight (its parameter broadcast views every weight as bytes,
its bf16 cast skips integer tensors); it runs on CPU and CUDA; peft adds adapters on top of its layers. torchao's
quantized tensors fail that broadcast (`aten.view.dtype` is not implemented for them); peft has no LoRA layer for
optimum-quanto's.

Only `nn.Linear` weights are quantized (the attention and feed-forward projections: most of a transformer's or a
UNet's weights); biases stay in the original dtype, as do convolutions, norms and embeddings. Quantizing happens
after the fp32 model is loaded in host memory and before the adapters are added, so peft wraps the quantized layers;
each layer is quantized on its way to the accelerator, so the fp32 base never reaches it.
"""

from __future__ import annotations

import warnings

import torch

NF4_BLOCK_SIZE = 64  # weights per fp32 absmax: 0.5 + 4 / 64 bytes per weight (spec.BASE_PRECISION_BYTES["nf4"])


def _quantized_linear(linear: torch.nn.Linear, precision: str, device=None) -> torch.nn.Module:
    """A bitsandbytes layer holding `linear`'s weight quantized, on `device` (None: the layer's own); frozen."""
    import bitsandbytes as bnb

    device = linear.weight.device if device is None else torch.device(device)
    weight = linear.weight.detach().to("cpu", torch.float32)  # bitsandbytes quantizes when the layer is moved
    has_bias = linear.bias is not None
    if precision == "int8":
        # threshold 0: no fp16 outlier columns, every weight is int8 (LLM.int8's outlier path needs fp16 copies).
        layer = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False, threshold=0.0
        )
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:  # nf4; compute dtype follows the input (train.precision)
        layer = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=has_bias, quant_type="nf4", compress_statistics=False
        )
        layer.weight = bnb.nn.Params4bit(
            weight, requires_grad=False, quant_type="nf4", blocksize=NF4_BLOCK_SIZE, compress_statistics=False
        )
    if has_bias:
        layer.bias = torch.nn.Parameter(linear.bias.detach().to("cpu").clone(), requires_grad=False)
    return layer.to(device).requires_grad_(False)


def quantize_linear_weights(module: torch.nn.Module, precision: str, device=None) -> int:
    """Replace every `nn.Linear` inside `module` by its quantized bitsandbytes counterpart (in place), each placed
    on `device` as it is quantized (None: where the layer is), so a base loaded in host memory reaches the
    accelerator quantized, one fp32 layer in flight at most. Returns the number of layers replaced."""
    if precision == "int8":
        # LLM.int8 casts activations to fp16 before quantizing them by design; bitsandbytes says so on every call.
        warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast from")
    replaced = 0
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:  # exactly Linear: subclasses may carry behaviour a swap would drop
            setattr(module, name, _quantized_linear(child, precision, device))
            replaced += 1
        else:
            replaced += quantize_linear_weights(child, precision, device)
    return replaced


def stored_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes the module's parameters occupy as stored (quantized data, not counting scales kept outside)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())
