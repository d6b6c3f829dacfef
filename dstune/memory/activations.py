"""Activation memory of one training sample: the generic formulas (a transformer layer, a UNet, a causal LM, SpeechT5)
that the families' torch-free facts (dstune.families.<family>_facts) apply to their configs.

Every figure is the bytes autograd keeps for backward at 2 bytes per element (bf16/fp16; dstune.memory.plan
doubles them for fp32), for one sample: (without checkpointing, with gradient checkpointing). The basis,
derived in docs/memory.md:

- A transformer layer over s tokens of width h with an MLP of inner width i keeps s x (17h + m x i) bytes
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1 without dropout
  and without the s^2 attention scores, which fused attention (SDPA/flash) does not keep): m = 4 for a plain MLP,
  8 for a gated one (SwiGLU/GEGLU keep both halves and their product). With checkpointing a layer keeps only its
  input (2sh) and one layer at a time is recomputed in backward.
- A UNet ResNet block over s latent pixels of c channels keeps ~7 tensors of s x c (two norms, two activations,
  two convolution inputs, the residual): 14sc. A UNet transformer layer is the layer above with a GEGLU MLP of
  4c plus cross-attention (8sc), each attention module adds its norm and projections (6sc). Checkpointing
  (diffusers checkpoints every ResNet and attention module) keeps block inputs and recomputes one block at a time.
- A causal LM also keeps its logits for the loss: bf16 logits, their fp32 copy and its gradient, 10 bytes per
  token and vocabulary entry, not checkpointed.
"""

from __future__ import annotations

import math

TEXT_TOKENS_PER_SECOND = 20  # tts: a transcript's tokens per second of speech (~15 characters/s, byte-level or BPE)


def transformer_layer_bytes(tokens: float, hidden: int, inner: int, gated: bool) -> float:
    return tokens * (17 * hidden + (8 if gated else 4) * inner)


def transformer_stack(tokens: float, hidden: int, inner: int, gated: bool, layers: int) -> tuple[float, float]:
    layer = transformer_layer_bytes(tokens, hidden, inner, gated)
    return layers * layer, layers * 2 * tokens * hidden + layer


def _per_level(config: dict, key: str, levels: int) -> list[int]:
    value = config.get(key, 1)
    return list(value) if isinstance(value, (list, tuple)) else [value] * levels


def unet_sample_bytes(config: dict, resolution: int) -> tuple[float, float]:
    """A diffusers UNet2DConditionModel at resolution x resolution pixels (latents 8x smaller per side)."""
    channels = list(config["block_out_channels"])
    levels = len(channels)
    per_block = config.get("layers_per_block", 2)
    depth = _per_level(config, "transformer_layers_per_block", levels)
    side = resolution / 8
    blocks = []  # (bytes of the block, bytes of its input)

    def add(level: int, resnets: int, attention: bool) -> None:
        pixels, width = (side / 2 ** level) ** 2, channels[level]
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
    return full, sum(kept for _, kept in blocks) + max(block for block, _ in blocks)


def lm_sample_bytes(config: dict, tokens: float) -> tuple[float, float]:
    """A transformers causal LM (Llama/Qwen-class: gated MLP) and its logits."""
    hidden = config["hidden_size"]
    inner = config.get("intermediate_size", 4 * hidden)
    gated = config.get("hidden_act", "silu") in ("silu", "swiglu") or "llama" in config.get("model_type", "")
    full, checkpointed = transformer_stack(tokens, hidden, inner, gated, config["num_hidden_layers"])
    logits = 10 * tokens * config["vocab_size"] / 2  # in the 2-byte units of the rest
    return full + logits, checkpointed + logits


def speecht5_sample_bytes(config: dict, seconds: float) -> tuple[float, float]:
    """SpeechT5: an encoder over the transcript and a decoder over mel frames (16 kHz, hop 256, reduction 2)."""
    hidden = config.get("hidden_size", 768)
    text = seconds * TEXT_TOKENS_PER_SECOND
    frames = seconds * 16000 / 256 / config.get("reduction_factor", 2)
    encoder = transformer_stack(text, hidden, config.get("encoder_ffn_dim", 4 * hidden), False,
                                config.get("encoder_layers", 12))
    decoder = transformer_stack(frames, hidden, config.get("decoder_ffn_dim", 4 * hidden), False,
                                config.get("decoder_layers", 6))
    return encoder[0] + decoder[0], encoder[1] + decoder[1]


def codec_frame_rate(config: dict) -> float:
    if config.get("frame_rate"):
        return float(config["frame_rate"])
    hop = config.get("hop_length") or math.prod(config.get("upsampling_ratios", [320]))
    return config.get("sampling_rate", 24000) / hop


def tts_tokens(seconds: float, frame_rate: float, codebooks: int) -> float:
    return seconds * (frame_rate * codebooks + TEXT_TOKENS_PER_SECOND)
