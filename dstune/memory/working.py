"""Working memory of the frozen encoders: what a VAE's encode or decode and a text encoder's forward pass allocate
beyond their input while they run (no gradients), from constants measured on the real diffusers / transformers
classes (bench/working_memory.py; docs/memory.md, section "Working memory"). Each model's card
declares the constants of its components' classes (PipelineCard.working: `VaeWork`, `TextWork`, keyed by class
name); the memory plan evaluates them at the folder's own configs.

Width units, as for the activations (dstune.memory.activation_cases): every tensor a VAE makes is pixels (or
voxels) x a multiple of its first level's channels, so its bytes per pixel are per channel of that level
(`vae_width`); every tensor of a text encoder's layer is tokens x a multiple of its hidden or MLP width. The
constants are bf16 bytes (the frozen parts' dtype under bf16); fp32 (fp32 and fp16 runs keep the frozen parts in
fp32) counts twice them, an upper bound where a part already computes in fp32 under bf16.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

BF16_BYTES = 2  # a hidden state element kept for the caller (the constants' dtype)


@dataclass(frozen=True)
class Geometry:
    """What the encoders work on: the largest cache entry and a sample, as (frames, width, height) pixels and their
    latent tokens (a VAE's attention mask runs over them), and the samples one pipeline call renders."""

    entry: tuple
    entry_tokens: float = 0.0
    sample: tuple = (1, 0, 0)
    sample_tokens: float = 0.0
    samples_per_call: int = 1


@dataclass(frozen=True)
class VaeWork:
    """A VAE class's working memory, in bf16 bytes per width unit (vae_width): per input voxel (frames x pixels;
    a still's pixels) of an encode and per output voxel of a decode, per pixel of a frame whatever the frames (a
    class that works through a clip a few frames at a time, holding their features in between), and fixed per
    entry; and, width-free, an attention mask over the latent tokens it builds whole (bytes per token pair)."""

    encode: float
    decode: float
    encode_frame: float = 0.0
    decode_frame: float = 0.0
    encode_fixed: float = 0.0
    decode_fixed: float = 0.0
    mask: float = 0.0  # bytes per (latent tokens)^2 of one clip, encode and decode
    tile_px: int = 0  # the class's tiled encode/decode: tiles of tile_px x tile_px pixels, whole in time; 0: none
    measured_on: str = ""  # the stored config (under dstune/model_configs) it was measured on, narrowed


@dataclass(frozen=True)
class TextWork:
    """A text encoder class's working memory for one caption of T tokens, in bf16 bytes: per token per hidden
    unit and per MLP unit, per token, per token pair (the attention mask transformers builds) and per token pair
    and head (attention that keeps its scores); and once a pass whatever its captions, per token pair and per
    token pair and head (T5's relative position bias, one for the batch); with the hidden states the pipeline
    reads kept beside (dstune.families.lean_text: only those)."""

    hidden: float
    ffn: float = 0.0
    token: float = 0.0
    square: float = 0.0
    scores: float = 0.0
    pass_square: float = 0.0
    pass_scores: float = 0.0
    measured_on: str = ""
    padding_mask: bool = True  # the pipeline passes the caption's padding mask (FluxPipeline's T5 call does not)


def vae_width(config: dict) -> int:
    """A VAE config's width unit: its first level's channels."""
    channels = config.get("block_out_channels")
    return int(channels[0]) if channels else int(config.get("base_dim", 128))


def precision_factor(precision: str) -> float:
    """The constants are bf16 bytes; fp32 and fp16 runs keep the frozen parts in fp32."""
    return 1.0 if precision == "bf16" else 2.0


def vae_bytes(
    work: VaeWork,
    config: dict,
    decode: bool,
    frames: int,
    width: int,
    height: int,
    latent_tokens: float,
    tiled: bool = False,
    precision: str = "bf16",
) -> float:
    """One entry's encode (or one sample's decode) at (frames, width, height) pixels; `latent_tokens`: the clip's
    latent positions (the mask's side); `tiled`: through the class's tiled encode/decode (tiles of tile_px, the
    tiles' latents kept until they are blended)."""
    per, per_frame, fixed = (
        (work.decode, work.decode_frame, work.decode_fixed)
        if decode
        else (work.encode, work.encode_frame, work.encode_fixed)
    )
    pixels = float(width * height)
    tokens = latent_tokens
    if tiled and work.tile_px and pixels > work.tile_px**2:
        share = work.tile_px**2 / pixels
        pixels, tokens = float(work.tile_px**2), latent_tokens * share
    channels = vae_width(config)
    working = channels * ((per * frames + per_frame) * pixels + fixed) + work.mask * tokens**2
    return precision_factor(precision) * working


def text_dims(config: dict) -> tuple[int, int, int]:
    """(hidden width, MLP width, attention heads) of a text encoder config (its text_config where nested; T5's
    d_model and d_ff; a vision encoder's own)."""
    text = config.get("text_config") or config
    hidden = text.get("hidden_size") or text.get("d_model") or 0
    ffn = text.get("intermediate_size") or text.get("d_ff") or 0
    heads = text.get("num_attention_heads") or text.get("num_heads") or 0
    return int(hidden), int(ffn), int(heads)


def text_bytes(
    work: TextWork, config: dict, tokens: float, kept_states: int = 1, precision: str = "bf16", captions: int = 1
) -> float:
    """A text encoder's pass over `captions` captions of `tokens` tokens, with `kept_states` hidden states of each
    kept for the caller; captions=0: what a pass holds once whatever its captions."""
    hidden, ffn, heads = text_dims(config)
    per_token = work.hidden * hidden + work.ffn * ffn + work.token
    pairs = tokens * tokens * (work.square + work.scores * heads)
    kept = max(kept_states - 1, 0) * tokens * hidden * BF16_BYTES  # the last one is in the measured pass
    once = tokens * tokens * (work.pass_square + work.pass_scores * heads)
    return precision_factor(precision) * (captions * (tokens * per_token + pairs + kept) + once)


MAX_CHUNK_ENTRIES = 8  # entries per encoder pass of the cache build where the memory allows (dstune.cache.latents)


def text_part(name: str) -> bool:
    """A companion whose outputs data.cache.text_embeddings replaces (the text encoders and a text connector)."""
    return name.startswith("text_encoder") or name == "connectors"


def working_terms(counts, setup) -> dict:
    """Per GPU, the working memory each phase adds to its weights (bytes), by dstune.memory.phases' labels: the cache
    build's VAE and text encoder passes over one chunk; in the step, the encoders' passes over the micro batch where
    the cache does not replace them, the backward's transients and, under ZeRO 0-2, the weight gradient in flight
    (a layer's 16-bit gradient before it joins the bucket, and the one accumulating into it: 2 x the largest
    layer); while samples render, the samples' VAE decode and one sampling forward (of both guidance halves where
    the pipeline batches them: ModelCounts.sample_forward_bytes)."""
    cached = set(counts.cached_companions)
    encode, decode = counts.encode_entry_bytes, counts.decode_sample_bytes
    if setup.vae_tiling:  # model.vae_tiling, where the unit knows the VAE's tiles (else refused by validate)
        encode = counts.encode_entry_tiled_bytes or encode
        decode = counts.decode_sample_tiled_bytes or decode
    latents_cached, text_cached = "vae" in cached, any(text_part(name) for name in cached)
    layer = min(counts.largest_layer_params, counts.trainable_params)
    samples = counts.samples_per_call if setup.samples else 0
    return {
        "cache_vae": setup.cache_chunk * encode if latents_cached else 0.0,
        "cache_text": setup.cache_chunk * counts.text_entry_bytes + counts.text_pass_bytes if text_cached else 0.0,
        "step_vae": setup.micro_batch * encode if not latents_cached else 0.0,
        "step_text": setup.micro_batch * counts.text_entry_bytes + counts.text_pass_bytes if not text_cached else 0.0,
        "transients": setup.micro_batch * counts.transient_sample_bytes,
        "in_flight": 2 * setup.weight_bytes * layer if setup.zero_stage <= 2 else 0.0,
        "sample_decode": samples * decode,
        "sample_forward": samples * counts.sample_forward_bytes,
    }
