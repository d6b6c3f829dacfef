"""What bench/activation_models.py and bench/activation_speech.py share: a `Case` (one model whose activations
bench/activation_table.py measures) and the seeded inputs and block lists the cases build from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Case:
    key: str  # the table's key (dstune/model_configs/activation_constants.json)
    title: str
    build: Callable  # (heads, ffn multiplier) -> module, with the measurement's width, ffn width and vocab
    run: Callable  # (module, tokens, context, dtype) -> a callable computing the loss
    sizes: tuple  # (tokens, context) measured to fit the constants
    check_size: tuple  # a third (tokens, context) for the unit test
    block_lists: Callable = lambda model: {}  # module -> {kind: list of blocks}
    quadratic: bool = False  # attention that keeps its scores (not SDPA): fit T^2, C^2, T*C
    joint_mask: bool = False  # each block's SDPA keeps a (T + C)^2 attention mask, width-free: fit (T + C)^2 bytes
    ffn: bool = False  # the MLP width is a config key of its own: measure twice as wide too
    # the LM head's weights are copied once per forward and kept for backward (CSM's per-codebook heads, gathered
    # by codebook): a logits term of width x vocabulary bytes, not per token
    head_copy: bool = False
    checkpointing: bool = True  # whether dstune can run it with gradient checkpointing
    pad: Callable = lambda tokens: (
        tokens
    )  # the length the model pads a sequence to (the constants are per padded token)
    heads: int = 2
    check_heads: int = 3  # the unit test's width (a UNet: channels x check_heads / 10)
    check_precision: str = "bf16"  # the unit test's (a UNet: fp32; the CPU's bf16 convolutions are ~20x slower)
    notes: str = ""
    extra: dict = field(default_factory=dict)


def mse(prediction: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(prediction.float(), torch.zeros_like(prediction, dtype=torch.float32))


def generator():
    return torch.Generator().manual_seed(0)


def randn(*shape, dtype):
    return torch.randn(*shape, generator=generator()).to(dtype)


def attr(*names, **kinds):
    """kind -> the model's attribute path of its blocks (a bare name is its own kind)."""
    paths = {**{name.rsplit(".", 1)[-1]: name for name in names}, **kinds}

    def lists(model):
        found = {}
        for kind, path in paths.items():
            value = model
            for part in path.split("."):
                value = getattr(value, part)
            found[kind] = list(value)
        return found

    return lists
