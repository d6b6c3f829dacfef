"""Activation memory of one training sample, per family, from the model's config (torch-free arithmetic).

Every figure is the bytes autograd keeps for backward at 2 bytes per element (bf16/fp16; dstune.memory_plan
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


def flow_sample_bytes(config: dict, resolution: int, text_tokens: int, images: int = 1) -> tuple[float, float]:
    """A flow transformer (SD3, Flux, Qwen-Image, Z-Image, FLUX.2): image tokens are 2x2 latent patches (16 px), text tokens
    join them. `images`: 2 for an edit model, whose source image's tokens follow the target's."""
    tokens = images * (resolution / 16) ** 2 + text_tokens
    if "dim" in config:  # Z-Image: single stream, SwiGLU feed-forward (8/3 wide), refiner layers before it
        hidden = config["dim"]
        return transformer_stack(tokens, hidden, int(hidden * 8 / 3), True,
                                 config["n_layers"] + config.get("n_refiner_layers", 0))
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    layers = config.get("num_layers", 0) + config.get("num_single_layers", 0)
    # FLUX.2's feed-forward is SwiGLU, mlp_ratio (3) wide; SD3, Flux and Qwen-Image use a plain 4x GELU MLP
    gated = config.get("_class_name") == "Flux2Transformer2DModel"
    return transformer_stack(tokens, hidden, int(hidden * config.get("mlp_ratio", 4.0)), gated, layers)


def wan_sample_bytes(config: dict, resolution, frames: int, text_tokens: int,
                     vae_factor: int = 8) -> tuple[float, float]:
    """A Wan transformer over one clip of `resolution` (a square side, or a bucket's (width, height)): its tokens
    are (1 + (frames - 1) / 4) latent frames x (height / 16) x (width / 16) (the VAE's 8x spatial and 4x temporal
    compression, then 1x2x2 patches; Wan 2.2's 16x VAE: / 32), so they grow with frames x height x width.
    `text_tokens`: the cross-attention context (Wan 2.1 I2V: the text and the image embedding's tokens); the
    condition channels of image-to-video only widen the patch embedding. Each block is a self-attention layer with a
    plain (GELU) MLP of ffn_dim over those tokens, plus a cross-attention to the text (its query-side norm,
    projections and output: ~8 bytes per token and width, as in the UNet estimate) and the text's key/value
    projections (4 bytes per text token and width)."""
    patch = config.get("patch_size", [1, 2, 2])
    width, height = (resolution, resolution) if isinstance(resolution, int) else resolution
    tokens = (1 + (frames - 1) // 4) / patch[0] * (height / (vae_factor * patch[1])) * \
        (width / (vae_factor * patch[2]))
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    extra = 8 * tokens * hidden + 4 * text_tokens * hidden
    layer = transformer_layer_bytes(tokens, hidden, config.get("ffn_dim", 4 * hidden), False) + extra
    layers = config["num_layers"]
    return layers * layer, layers * 2 * tokens * hidden + layer


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
