"""The precision the training step computes in: at least float32, and float64 when the model is float64.

The reference trainers upcast a bf16/fp16 prediction to float32 for the loss (`model_pred.float()`), and dstune's
frozen codecs and VAE posteriors are float32 whatever the frozen parts' dtype. Written as "at least float32" rather
than `.float()`, the same code keeps a float64 model in float64 end to end: that is how the golden loss trajectories
(tests/unit/test_golden_losses.py) run, so that no float32 matrix product, whose last bits depend on the CPU's
kernels, sits between the weights and the loss. For bf16, fp16 and fp32 it is exactly `.float()`.
"""

from __future__ import annotations

import torch


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as float32, or as it is when it is float64."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def at_least_float32_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 when `dtype` is float64 (the frozen codecs' dtype for a run whose frozen parts are `dtype`)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype a module computes in: its first floating parameter's (a frozen base read from a quantized file, or
    an int8 base under ZeRO-3, holds its stored bytes in integer parameters, which may come first)."""
    return next(p.dtype for p in module.parameters() if p.is_floating_point())
