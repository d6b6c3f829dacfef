"""Activation memory of one training sample, (without checkpointing, with gradient checkpointing), in two forms:

- measured: `measured_sample_bytes` evaluates the constants that bench/activation_table.py measured on the real
  diffusers / transformers class of each model dstune trains (dstune/model_configs/activation_constants.json;
  docs/memory.md says how they are measured and regenerated) at the real model's width, MLP width, vocabulary and
  block counts. Each family's torch-free facts (dstune.families.<family>_facts) name their model's key.
- generic formulas, only where no constants exist (a UNet of another block structure, as the built-in tiny ones; a
  causal LM that is not Llama-class), at 2 bytes per element (dstune.memory.plan doubles them for fp32):
  a transformer layer over s tokens of width h with an MLP of inner width i keeps s x (17h + m x i) bytes
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1 without dropout
  and without the s^2 attention scores, which fused attention (SDPA/flash) does not keep): m = 4 for a plain MLP,
  8 for a gated one. With checkpointing a layer keeps only its input (2sh) and one layer at a time is recomputed.
  A UNet ResNet block over s latent pixels of c channels keeps ~7 tensors of s x c: 14sc; a UNet transformer layer
  is the layer above with a GEGLU MLP of 4c plus cross-attention (8sc), each attention module adds 6sc. A causal
  LM also keeps its logits for the loss: 10 bytes per token and vocabulary entry, not checkpointed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

LORA_RANK = 4  # the adapters' rank in the LoRA measurements: their r-wide tensors are a few % of a narrow block's
# The LoRA figure is its fit x this: at a size and width the fit did not see, the fit alone was up to 4 % below a
# fresh count (for one model) and at most 4 % above; the plan must never count less than a LoRA step saves.
LORA_MARGIN = 1.05
GENERIC_LOGIT_TRANSIENT = 6  # bytes per token and vocabulary entry: the logits' fp32 gradient and its bf16 copy
TEXT_TOKENS_PER_SECOND = 20  # tts: a transcript's tokens per second of speech (~15 characters/s, byte-level or BPE)
CONSTANTS_FILE = Path(__file__).resolve().parents[1] / "model_configs" / "activation_constants.json"


@functools.lru_cache(maxsize=1)
def activation_constants() -> dict:
    """The measured table: model key -> its constants (see docs/memory.md)."""
    return json.loads(CONSTANTS_FILE.read_text())["models"]


@dataclass(frozen=True)
class ModelShape:
    """What the measured constants are evaluated at: the real model's width (hidden size; a UNet's first block
    channels), its MLP width where its configs set it apart, its vocabulary (LM logits) and blocks per kind."""

    width: int
    layers: dict = field(default_factory=dict)
    ffn: int = 0
    vocab: int = 0


def _evaluate(coefficients: dict, tokens: float, context: float, width: float, ffn: float) -> float:
    values = {
        "T": tokens * width,
        "C": context * width,
        "t": tokens,  # width-free per token (head-wide tensors: bench/activation_table.py fits them at two widths)
        "c": context,
        "1": width,
        "TT": tokens * tokens * width,
        "CC": context * context * width,
        "TC": tokens * context * width,
        "fT": ffn * tokens,
        "fC": ffn * context,
        "f": ffn,
        "LL": (tokens + context) ** 2,
    }
    return sum(coefficient * values[name] for name, coefficient in coefficients.items())


# What measured_sample_bytes evaluates: a training step's activations (the default), one forward pass without
# gradients ("forward": what a block holds while it runs, beside what runs outside the blocks; samples), the
# backward's transients beyond the saved activations ("transients": a logits gradient, masks a block rebuilds), or
# what model.activation_offload moves to the host ("offload": every checkpointed block's inputs, and the largest
# one block's, which come back to the device while backward recomputes that block).
# Each model's facts compute a sample's figure through the same function, so the memory plan asks them under
# `figure(kind)` for the other two.
_FIGURE = contextvars.ContextVar("activation_figure", default="training")


# The adapter targets when the training figure is a LoRA run's (the model frozen, plain LoRA adapters over an
# unquantized base), None for any other run: within `adapters(targets)` measured_sample_bytes reads a model's LoRA
# table where the targets it was measured with include them (bench/activation_table.py measures it: a frozen linear
# layer without an adapter keeps no input for backward, so adapters on fewer of them keep less), else its full one.
_ADAPTERS = contextvars.ContextVar("activation_adapters", default=None)


@contextlib.contextmanager
def adapters(targets):
    """Within it, a training figure is the one of LoRA adapters on `targets` (module names; None: not LoRA)."""
    token = _ADAPTERS.set(None if targets is None else frozenset(targets))
    try:
        yield
    finally:
        _ADAPTERS.reset(token)


def figure_kind() -> str:
    """The figure asked for now (training, forward, transients, offload)."""
    return _FIGURE.get()


@contextlib.contextmanager
def figure(kind: str):
    """Within it, measured_sample_bytes gives (that figure, that figure): "forward" or "transients"."""
    token = _FIGURE.set(kind)
    try:
        yield
    finally:
        _FIGURE.reset(token)


def measured_sample_bytes(
    key: str, shape: ModelShape, tokens: float, context: float = 0.0, precision: str = "bf16"
) -> tuple[float, float]:
    """One sample's (full, checkpointed) activation bytes in the run's precision (fp32: 4-byte tensors; bf16/fp16:
    the measured bf16 bytes, fp32 norms and modulation included), from the model's measured constants: per bucket
    width x (a tokens + c context + b ...) + ffn x (...), the blocks times their count; with checkpointing the
    inputs of every checkpointed block plus one recomputed block. A model that dstune never checkpoints has no
    checkpointed figure: the full one. Under `figure("forward")` both are the most one forward pass without
    gradients holds at once (a sampling step); under `figure("transients")` the backward's transients (0 where not
    measured)."""
    entry = activation_constants()[key]
    table = entry["fp32" if precision == "fp32" else "bf16"]
    # a LoRA run's saved activations (its forward and transients are the full table's: an upper bound), where
    # measured in this precision (bf16 for every model, fp32 too for the UNets) with (at least) the run's targets;
    # else the full figure
    measured, targets = entry.get("lora", {}), _ADAPTERS.get()
    covered = targets is not None and targets <= set(measured.get("targets", ()))
    lora = measured.get("fp32" if precision == "fp32" else "bf16") if covered else None
    saved, margin = (lora, LORA_MARGIN) if lora else (table, 1.0)

    def bucket(coefficients: dict) -> float:
        return _evaluate(coefficients, tokens, context, shape.width, shape.ffn)

    logits = _logit_bytes(saved.get("logits", {}), shape, tokens, context) * margin
    kind = _FIGURE.get()
    if kind == "offload":  # (every checkpointed block's inputs, the largest one block's); none without checkpointing
        if not entry["checkpointing"]:
            return 0.0, 0.0
        inputs = {name: bucket(table["ckpt_inputs"][name]) for name, count in shape.layers.items() if count}
        return sum(shape.layers[name] * value for name, value in inputs.items()), max(inputs.values(), default=0.0)
    if kind == "transients":  # the largest moment, at least 0: the saved activations' peak is always one of them

        def moments(prefix: str) -> float:
            logits = _logit_moment(table.get(f"{prefix}logit_transients", {}), shape, tokens)
            masks = bucket(table.get(f"{prefix}mask_transients", {}))
            return max(bucket(table.get(f"{prefix}transients", {})), logits, masks, 0.0)

        return moments(""), moments("ckpt_" if entry["checkpointing"] else "")
    if kind == "forward" and "forward" in table:  # measured as such (bench/activation_table.py)
        return bucket(table["forward"]), bucket(table["forward"])
    if kind == "forward":  # the full table's training forward, an upper bound
        saved, margin, logits = table, 1.0, _logit_bytes(table.get("logits", {}), shape, tokens, context)
    full = logits + margin * (
        bucket(saved["outside"]) + sum(count * bucket(saved["blocks"][kind]) for kind, count in shape.layers.items())
    )
    if not entry["checkpointing"] or kind == "forward":  # a table without it: the training forward, an upper bound
        return full, full
    checkpointed = logits + margin * (
        bucket(saved["ckpt_outside"])
        + bucket(saved["recompute"])
        + sum(count * bucket(saved["ckpt_inputs"][kind]) for kind, count in shape.layers.items())
    )
    return full, checkpointed


def _logit_moment(coefficients: dict, shape: ModelShape, tokens: float) -> float:
    """The backward's transients while a causal LM's logits gradients are alive: per token and width unit and per
    width unit, per token and vocabulary entry (the fp32 logits' gradient), per vocabulary entry and width unit (the
    LM head's and the embedding's gradient parts)."""
    if not coefficients:
        return 0.0
    per_vocab = coefficients.get("VT", 0.0) * tokens + coefficients.get("Vw", 0.0) * shape.width
    per_width = coefficients.get("T", 0.0) * tokens + coefficients.get("1", 0.0)
    return per_width * shape.width + shape.vocab * per_vocab


def _logit_bytes(coefficients: dict, shape: ModelShape, tokens: float, context: float) -> float:
    """The logits (and their fp32 copies) per vocabulary entry; "head": a copy of the LM head's weights kept for
    backward (a model that gathers per-codebook heads each forward), width x vocabulary."""
    per_token = {name: value for name, value in coefficients.items() if name != "head"}
    head = coefficients.get("head", 0.0) * shape.width
    return shape.vocab * (_evaluate(per_token, tokens, context, 1, 0) + head)


def unet_structure(config: dict) -> dict:
    """A UNet2DConditionModel's block structure and channel ratios: what its measured constants are for."""
    channels = list(config["block_out_channels"])
    levels = len(channels)
    return {
        "down_block_types": list(config["down_block_types"]),
        "up_block_types": list(config["up_block_types"]),
        "layers_per_block": config.get("layers_per_block", 2),
        "transformer_layers_per_block": _per_level(config, "transformer_layers_per_block", levels),
        "channel_ratios": [c / channels[0] for c in channels],
    }


def measured_unet(config: dict):
    """The measured UNet whose structure the config has (any width), or None (the generic formula applies)."""
    structure = unet_structure(config)
    return next((key for key, entry in activation_constants().items() if entry.get("structure") == structure), None)


def in_plan_units(sample_bytes: tuple[float, float], precision: str) -> tuple[int, int]:
    """dstune.memory.plan counts activations at 2 bytes per element and doubles them for fp32: a measured fp32
    figure enters it halved."""
    divisor = 2 if precision == "fp32" else 1
    return int(sample_bytes[0] / divisor), int(sample_bytes[1] / divisor)


def transformer_layer_bytes(tokens: float, hidden: int, inner: int, gated: bool) -> float:
    return tokens * (17 * hidden + (8 if gated else 4) * inner)


def transformer_stack(tokens: float, hidden: int, inner: int, gated: bool, layers: int) -> tuple[float, float]:
    layer = transformer_layer_bytes(tokens, hidden, inner, gated)
    return layers * layer, layers * 2 * tokens * hidden + layer


def _per_level(config: dict, key: str, levels: int) -> list[int]:
    value = config.get(key, 1)
    return list(value) if isinstance(value, (list, tuple)) else [value] * levels


def unet_sample_bytes(config: dict, resolution: int) -> tuple[float, float]:
    """A diffusers UNet2DConditionModel at resolution x resolution pixels (latents 8x smaller per side); no
    transients measured (under figure("transients"): 0)."""
    if _FIGURE.get() == "transients":
        return 0.0, 0.0
    channels = list(config["block_out_channels"])
    levels = len(channels)
    per_block = config.get("layers_per_block", 2)
    depth = _per_level(config, "transformer_layers_per_block", levels)
    side = resolution / 8
    blocks = []  # (bytes of the block, bytes of its input)

    def add(level: int, resnets: int, attention: bool) -> None:
        pixels, width = (side / 2**level) ** 2, channels[level]
        for _ in range(resnets):
            blocks.append((14 * pixels * width, 2 * pixels * width))
            if attention:
                layer = transformer_layer_bytes(pixels, width, 4 * width, True) + 8 * pixels * width
                blocks.append((depth[level] * layer + 6 * pixels * width, 2 * pixels * width))

    for level, kind in enumerate(config["down_block_types"]):
        add(level, per_block, "CrossAttn" in kind)
    add(levels - 1, 1, True)  # the mid block: ResNet, attention, ResNet
    add(levels - 1, 1, False)
    for position, kind in enumerate(config["up_block_types"]):
        add(levels - 1 - position, per_block + 1, "CrossAttn" in kind)
    full = sum(block for block, _ in blocks)
    if _FIGURE.get() == "offload":
        return sum(kept for _, kept in blocks), max(kept for _, kept in blocks)
    return full, sum(kept for _, kept in blocks) + max(block for block, _ in blocks)


def lm_sample_bytes(config: dict, tokens: float) -> tuple[float, float]:
    """A transformers causal LM (Llama/Qwen-class: gated MLP) and its logits; its transients (figure
    "transients"): the logits' gradient, fp32 and in the model's dtype, GENERIC_LOGIT_TRANSIENT bytes per token
    and vocabulary entry."""
    if _FIGURE.get() == "transients":
        transient = GENERIC_LOGIT_TRANSIENT * tokens * config["vocab_size"] / 2  # in the 2-byte units
        return transient, transient
    hidden = config["hidden_size"]
    inner = config.get("intermediate_size", 4 * hidden)
    gated = config.get("hidden_act", "silu") in ("silu", "swiglu") or "llama" in config.get("model_type", "")
    full, checkpointed = transformer_stack(tokens, hidden, inner, gated, config["num_hidden_layers"])
    logits = 10 * tokens * config["vocab_size"] / 2  # in the 2-byte units of the rest
    return full + logits, checkpointed + logits


def codec_frame_rate(config: dict) -> float:
    if config.get("frame_rate"):
        return float(config["frame_rate"])
    hop = config.get("hop_length") or math.prod(config.get("upsampling_ratios", [320]))
    return config.get("sampling_rate", 24000) / hop


def tts_tokens(seconds: float, frame_rate: float, codebooks: int) -> float:
    return seconds * (frame_rate * codebooks + TEXT_TOKENS_PER_SECOND)
