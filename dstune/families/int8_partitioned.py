"""`model.base_precision: int8` under ZeRO-3: the frozen base's linear weights as plain int8 parameters that ZeRO-3
partitions and gathers like any other.

Why not bitsandbytes here: its int8 layer keeps the per-row scales as attributes of the weight's parameter object,
which ZeRO-3 neither partitions nor gathers (a gathered weight comes back without them). DeepSpeed's own
`zero_quantized_nontrainable_weights` quantizes with CUDA kernels only. This layer instead holds two ordinary frozen
parameters, the int8 weight and its per-output-row scale, so ZeRO-3 partitions each (DeepSpeed 0.19.8 gathers a
module's parameters grouped by dtype: each rank stores 1 / N of the int8 bytes as int8) and gathers both before the
layer's forward, which dequantizes the weight to the input's dtype. It runs wherever DeepSpeed does (CPU ranks with
gloo included).

The engine keeps every floating parameter in the training dtype (bf16 / fp16), the scale included: each scale is
chosen representable in that dtype (absmax / 127 rounded up to it) before the weights are quantized with it, so the
stored scale is exactly the one the codes were made with, and every weight lies within half a scale step of its
dequantized value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_LEVELS = 127  # symmetric codes -127..127 (-128 unused: the range stays symmetric)


def representable_scale(absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """absmax / 127 per row as an fp32 tensor whose values are exactly representable in `dtype` and never below
    absmax / 127 (rounded up to `dtype`), so no weight's code leaves [-127, 127]; at least `dtype`'s smallest normal."""
    wanted = (absmax.float() / INT8_LEVELS).clamp(min=torch.finfo(dtype).tiny)
    scale = wanted.to(dtype)
    low = scale.float() < wanted
    if low.any():
        scale[low] = torch.nextafter(scale[low], torch.full_like(scale[low], float("inf")))
    return scale.float()


class Int8Linear(torch.nn.Linear):
    """A frozen nn.Linear whose weight is stored as int8 codes (`weight`, out x in) with one scale per output row
    (`weight_scale`, out); the bias as it was. An nn.Linear subclass, so peft adds its LoRA layers on top."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(
            torch.zeros(out_features, in_features, dtype=torch.int8, device=device), requires_grad=False
        )
        self.weight_scale = torch.nn.Parameter(torch.ones(out_features, device=device), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, scale_dtype: torch.dtype) -> "Int8Linear":
        """`linear` quantized per output row with scales exactly representable in `scale_dtype` (the dtype the
        engine keeps floating parameters in); in host memory."""
        weight = linear.weight.detach().to("cpu", torch.float32)
        scale = representable_scale(weight.abs().amax(dim=1), scale_dtype)
        codes = torch.round(weight / scale[:, None]).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        layer.weight = torch.nn.Parameter(codes, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.to(scale_dtype), requires_grad=False)
        if linear.bias is not None:
            layer.bias = torch.nn.Parameter(linear.bias.detach().to("cpu").clone(), requires_grad=False)
        return layer

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return _dequantized(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _Int8LinearFunction.apply(x, self.weight, self.weight_scale, bias)


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype) * scale.to(dtype)[:, None]


class _Int8LinearFunction(torch.autograd.Function):
    """x @ W.T + b with W dequantized for the product only. Backward keeps the int8 parameter, not W: F.linear on a
    dequantized W would save W for the input's gradient, every layer's bf16 copy alive until backward (the whole
    base at the compute dtype, more than the base it replaces). Saved as the parameter itself, ZeRO-3 may release
    it after forward and gathers it again before this layer's backward (its pre-backward hook), as DeepSpeed's own
    ZeRO-3 linear function saves its weight."""

    @staticmethod
    def forward(ctx, x, codes, scale, bias):
        ctx.save_for_backward(codes, scale)
        return F.linear(x, _dequantized(codes, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        codes, scale = ctx.saved_tensors
        grad_x = grad_out @ _dequantized(codes, scale, grad_out.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


def quantize_linear_weights_int8(module: torch.nn.Module, scale_dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` inside `module` (exactly Linear, as quantized_base does) by an Int8Linear, in place,
    in host memory; returns the number of layers replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:
            setattr(module, name, Int8Linear.from_linear(child, scale_dtype))
            replaced += 1
        else:
            replaced += quantize_linear_weights_int8(child, scale_dtype)
    return replaced
