"""What a model unit declares so that bench/activation_table.py can measure its activations (docs/memory.md): one
`Case` per measured model, named by the unit (`activation_cases=`), and the seeded inputs and block lists the cases
are built from. A case is the REAL diffusers / transformers class at a narrow configuration of the published
model's structure (its head dimension, MLP ratio, block kinds, norms and modulation; 2-4 heads instead of 24-48, 2
blocks of each kind), with one training forward + loss on it.

Width: every tensor a block keeps is tokens x (a multiple of the width, of the MLP width, or of the heads at the real
head dimension), so its bytes per token are linear in the width and the MLP width; the measured constants are per
width unit (and per MLP unit where a model's configs set the MLP width apart, as an `ffn_dim` or an
`intermediate_size` key), and the estimate multiplies them by the real model's. The widths around the blocks (text
projections' inputs, pooled vectors) are narrowed by the same factor so that they scale alike; only the latent
channels and the rotary tables (head-dimension wide) do not, which is under 1 % of the total.

A case's sizes: `tokens` is the token count the constants are per (image tokens, video tokens, latent pixels of a
UNet, LM tokens, a speech decoder's steps), `context` the second sequence (text tokens, a transcript's tokens).
Torch-free at import: torch is imported by the functions that run a case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from dstune.spec.section import DEFAULT_LORA_TARGET_MODULES

TRANSFORMER_SIZES = ((16, 8), (36, 8), (16, 24))  # (image tokens, text tokens) of the image transformers' fits
LM_VOCAB = 1000  # a narrow LM vocabulary: the logits are counted apart, per vocabulary entry


@dataclass(frozen=True)
class Case:
    key: str  # the table's key (dstune/model_configs/activation_constants.json)
    title: str
    # (heads, ffn multiplier) -> (module, the measurement's width, ffn width, vocabulary)
    build: Callable[[int, int], tuple]
    run: Callable[..., Callable[[], Any]]  # (module, tokens, context, dtype) -> a callable computing the loss
    sizes: tuple  # (tokens, context) measured to fit the constants
    check_size: tuple  # a third (tokens, context) for the unit test
    block_lists: Callable[[Any], dict] = lambda model: {}  # module -> {kind: list of blocks}
    quadratic: bool = False  # attention that keeps its scores (not SDPA): fit T^2, C^2, T*C
    joint_mask: bool = False  # each block's SDPA keeps a (T + C)^2 attention mask, width-free: fit (T + C)^2 bytes
    ffn: bool = False  # the MLP width is a config key of its own: measure twice as wide too
    # the LM head's weights are copied once per forward and kept for backward (per-codebook heads gathered by
    # codebook): a logits term of width x vocabulary bytes, not per token
    head_copy: bool = False
    checkpointing: bool = True  # whether dstune can run it with gradient checkpointing
    # the backward's transients are measured too: the most a training step holds beyond the saved activations (a
    # logits gradient, masks a block rebuilds), which the memory plan adds to the step; at these (tokens, context)
    # sizes and this many heads (where they are a good part of the step), checked at transient_check
    transients: bool = False
    transient_sizes: tuple = ()
    transient_check: tuple = ()
    transient_heads: int = 0
    # an LM's vocabulary for them, as many entries per width unit as the real model's (its logits' gradient is
    # then as large beside its blocks' as at the real size): `build` takes it as vocab=
    transient_vocab: int = 0
    # the length the model pads a sequence to (the constants are per padded token)
    pad: Callable[[float], float] = lambda tokens: tokens
    heads: int = 2
    check_heads: int = 3  # the unit test's width (a UNet: channels x check_heads / 10)
    check_precision: str = "bf16"  # the unit test's (a UNet: fp32; the CPU's bf16 convolutions are ~20x slower)
    # the LoRA measurement's adapter targets: the family's default targets (the diffusers attention's, a causal LM's
    # attention projections for the speech models), or the model's own where those name none of its layers; the
    # plan reads the LoRA table for a run whose targets are among them (dstune.memory.activations.adapters)
    lora_targets: tuple = DEFAULT_LORA_TARGET_MODULES
    # the LoRA measurement's widths, in multiples of `heads`: two (1, 2) fit per-token terms that do not grow with
    # the width beside those that do, for a model whose LoRA step keeps head-wide tensors (rotary tables) that are a
    # good part of its narrow blocks (at one width they would be scaled with the width up to the real model's)
    lora_widths: tuple = (1,)
    notes: str = ""
    extra: dict = field(default_factory=dict)


def mse(prediction):
    """The loss a case backpropagates: the prediction's mean square against zeros, in float32."""
    import torch
    import torch.nn.functional as F

    return F.mse_loss(prediction.float(), torch.zeros_like(prediction, dtype=torch.float32))


def generator():
    import torch

    return torch.Generator().manual_seed(0)


def randn(*shape, dtype):
    import torch

    return torch.randn(*shape, generator=generator()).to(dtype)


def square_side(tokens: int) -> int:
    """The side of a square grid of `tokens` image tokens."""
    side = math.isqrt(tokens)
    assert side * side == tokens, f"{tokens} image tokens: a square count is needed"
    return side


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


# ------------------------------------------------------------------------------- the UNet models' measurements


def unet_case(config: dict):
    """A UNet measurement case's build: the UNet's structure with every channel count x heads / 10 (heads 2: a
    fifth; a UNet with a list of head widths and transformer layers per block keeps 64-wide heads)."""

    def build(heads, ffn_mult):
        from diffusers import UNet2DConditionModel

        def narrow(value: int) -> int:
            return value * heads // 10

        channels = [narrow(c) for c in config["block_out_channels"]]
        settings = dict(config, block_out_channels=channels, cross_attention_dim=narrow(config["cross_attention_dim"]))
        if "transformer_layers_per_block" in config:  # heads of 64 channels, and the pooled text + 6 time ids
            settings["attention_head_dim"] = [max(1, narrow(h)) for h in config["attention_head_dim"]]
            settings["projection_class_embeddings_input_dim"] = narrow(1280) + 6 * 256
        return UNet2DConditionModel(**settings), channels[0], 0, 0

    return build


def unet_case_run(model, tokens, context, dtype):
    """A UNet measurement case's step: `tokens` latent pixels (a square side), `context` text tokens; a text_time
    UNet also gets pooled text and its six time ids."""
    import torch

    side = square_side(tokens)
    latents = randn(1, 4, side, side, dtype=dtype)
    text = randn(1, context, model.config.cross_attention_dim, dtype=dtype)
    extra = {}
    if model.config.addition_embed_type == "text_time":
        pooled = model.config.projection_class_embeddings_input_dim - 6 * model.config.addition_time_embed_dim
        extra = {
            "added_cond_kwargs": {
                "text_embeds": randn(1, pooled, dtype=dtype),
                "time_ids": torch.tensor([[side * 8, side * 8, 0, 0, side * 8, side * 8]], dtype=dtype),
            }
        }
    return lambda: mse(model(latents, torch.tensor([500]), text, **extra).sample)
