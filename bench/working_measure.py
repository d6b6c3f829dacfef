"""Counting the working memory of a frozen encoder pass, and of a training step's backward, on the real classes
(bench/working_memory.py fits the constants each model's card declares; tests/unit/test_working_memory.py checks
them against a fresh count at another size).

`LiveBytes` is a dispatch mode that sees every tensor an operator returns, forwards and backwards: it adds up the
storages made while it is on (a storage once, views of it free) and takes one away when its last tensor dies, so
its `peak` is the most bytes the pass held at once beyond what existed before it (weights, inputs). It sees what
torch allocates as tensors; a library's own scratch space (a convolution's workspace) it does not, and neither
does the allocator's rounding. Attention runs on SDPA's flash kernel, as the GPU's fused kernels do (no
tokens x tokens scores, where the model does not build them itself).
"""

from __future__ import annotations

import copy
import gc
import json
import math
import warnings
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

STORE = Path(__file__).resolve().parents[1] / "dstune" / "model_configs"


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages operators made while it is on, now and at most (`peak`); `tagged(tensor)` marks
    the storages counted apart too (`tagged_at_peak`: theirs when the whole was at its peak). Storages handed to
    `leave_out` (a weight's gradient, which the memory plan counts apart) are taken out of the whole timeline by
    `peaks()`."""

    def __init__(self, tagged=None) -> None:
        super().__init__()
        self.existing = alive_storages()  # weights, buffers, inputs: a view of one is no new memory
        self.live: dict[int, tuple[int, int]] = {}  # storage pointer -> (allocation serial, bytes)
        self.events: list[tuple[int, int, bool]] = []  # (allocation serial, +bytes or -bytes, tagged)
        self.tagged = tagged
        self.marked: set[int] = set()  # serials of tagged allocations
        self.left_out: set[int] = set()  # serials taken out by leave_out
        self.now = 0
        self.peak = 0

    def _free(self, key: int, serial: int) -> None:
        if self.live.get(key, (None,))[0] != serial:
            return
        nbytes = self.live.pop(key)[1]
        self.now -= nbytes
        self.events.append((serial, -nbytes, serial in self.marked))

    def leave_out(self, tensor: torch.Tensor) -> None:
        found = self.live.get(tensor.untyped_storage().data_ptr())
        if found is not None:
            self.left_out.add(found[0])

    def peaks(self, tagged_above: int = 0) -> tuple[int, int]:
        """(the peak of the timeline without the storages left out while more than `tagged_above` tagged bytes are
        alive, the peak at the other moments)."""
        now = tagged = inside = outside = 0
        for serial, delta, is_tagged in self.events:
            if serial in self.left_out:
                continue
            now += delta
            tagged += delta if is_tagged else 0
            if tagged > tagged_above:
                inside = max(inside, now)
            else:
                outside = max(outside, now)
        return inside, outside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            # a ZeroTensor (a forward-mode JVP's zero tangent) holds no memory and has no storage to read
            if isinstance(value, torch.Tensor) and not value.is_meta and not value._is_zerotensor():
                storage = value.untyped_storage()
                key = storage.data_ptr()
                if key == 0 or key in self.live or key in self.existing:
                    continue
                serial, nbytes = len(self.events), storage.nbytes()
                is_tagged = self.tagged is not None and self.tagged(value)
                if is_tagged:
                    self.marked.add(serial)
                self.live[key] = (serial, nbytes)
                self.events.append((serial, nbytes, is_tagged))
                self.now += nbytes
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._free, key, serial)
        return out


def alive_storages() -> set:
    """The storages of every tensor Python holds now."""
    with warnings.catch_warnings():  # isinstance on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [value for value in gc.get_objects() if isinstance(value, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors if not t.is_meta and not t._is_zerotensor()}


def flash_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


def peak_bytes(run) -> int:
    """The most bytes `run()` held at once beyond what existed before it, without gradients."""
    with torch.no_grad(), flash_attention():
        run()  # warm-up: what a class caches across calls exists before the counted pass
        tracker = LiveBytes()
        with tracker:
            result = run()
        del result
    return tracker.peak


def transient_tag(vocab: int):
    """What marks a step's transient moments: a tensor with a vocabulary-wide side (a causal LM's logits, their
    gradients, the LM head's and embedding's gradient parts), or a boolean attention mask (tokens x tokens)."""

    def tagged(tensor: torch.Tensor) -> bool:
        if vocab and vocab in tensor.shape:
            return True
        return tensor.dtype == torch.bool and tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] > 1

    return tagged


def step_peak(model, run_loss, vocab: int = 0, saved_logits: int = 0) -> tuple[int, int]:
    """The most bytes one training forward and backward held at once beyond the weights and inputs: (while more
    tagged bytes (transient_tag) than the saved logits were alive, at the other moments). The weights' gradients
    are left out (the memory plan counts them apart: ZeRO's gradients, the one in flight), each dropped once
    accumulated."""
    tracker = LiveBytes(tagged=transient_tag(vocab))
    trainable = [p for p in model.parameters() if p.requires_grad]
    hooks = [p.register_hook(lambda grad: tracker.leave_out(grad)) for p in trainable]
    hooks += [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in trainable]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), tracker:
            loss = run_loss()
            loss.backward()
            del loss
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    return tracker.peaks(saved_logits)


def read(relative: str) -> dict:
    return json.loads((STORE / relative / "config.json").read_text())


# --------------------------------------------------------------------------------------------------- VAEs

VAE_NARROWING = 4  # every channel count divided by this (GroupNorm's 32 groups still divide the first level's)
VAE_CHANNEL_KEYS = ("block_out_channels", "decoder_block_out_channels")
VAE_WIDTH_KEYS = ("base_dim", "decoder_base_dim")
# a VAE whose decoder is a ViT (AutoencoderKLMiniMaxH3's): its width (heads x head width) narrowed with the channels,
# so that its tokens' memory scales with the width unit as the convolutions' does
VAE_HEAD_KEYS = ("decoder_num_attention_heads",)


def narrow_vae(config: dict, factor: int = VAE_NARROWING) -> dict:
    narrow = copy.deepcopy(config)
    for key in VAE_CHANNEL_KEYS:
        if narrow.get(key):
            narrow[key] = [max(channels // factor, 1) for channels in narrow[key]]
    for key in VAE_WIDTH_KEYS + VAE_HEAD_KEYS:
        if narrow.get(key):
            narrow[key] = max(narrow[key] // factor, 1)
    if "norm_num_groups" in narrow:
        first = (narrow.get("block_out_channels") or [32])[0]
        narrow["norm_num_groups"] = min(narrow["norm_num_groups"], first)
    return narrow


def build_vae(config: dict):
    import diffusers

    vae = getattr(diffusers, config["_class_name"]).from_config(config).to(torch.bfloat16)
    # the modules a class keeps in float32 (AutoencoderKLMiniMaxH3's encoder), as from_pretrained loads them
    keep = getattr(vae, "_keep_in_fp32_modules", None) or ()
    for name, module in vae.named_modules():
        if any(part in keep for part in name.split(".")):
            module.float()
    return vae.eval()


def vae_geometry(vae) -> tuple[int, int, bool]:
    """(spatial factor, temporal factor, whether it takes clips) of a diffusers VAE."""
    config = vae.config
    if getattr(config, "spatial_downsample_factors", None):  # per level (AutoencoderKLMiniMaxH3's)
        temporal = math.prod(getattr(config, "temporal_downsample_factors", None) or (1,))
        return math.prod(config.spatial_downsample_factors), temporal, temporal > 1
    spatial = getattr(config, "spatial_compression_ratio", None) or getattr(config, "scale_factor_spatial", None)
    if spatial is None:
        spatial = 2 ** (len(config.block_out_channels) - 1) if hasattr(config, "block_out_channels") else 8
    if getattr(config, "patch_size", None) and not hasattr(config, "spatial_compression_ratio"):
        patch = config.patch_size
        spatial *= patch[0] if isinstance(patch, (list, tuple)) else patch
    temporal = getattr(config, "temporal_compression_ratio", None) or getattr(config, "scale_factor_temporal", 4)
    clips = hasattr(config, "temperal_downsample") or hasattr(config, "temporal_compression_ratio")
    return int(spatial), int(temporal), clips


def chunk_frames(vae, chunks: int) -> int:
    """A clip's frames that a VAE encoding `clip_length` frames at a time (and dropping its last chunk's
    `token_drop` latent frames) encodes in `chunks` chunks with no frame padded beyond the dropped ones: 17k+5 for
    AutoencoderKLMiniMaxH3 (17 frames a chunk, 3 latents of 4 frames dropped)."""
    config = vae.config
    _, temporal, _ = vae_geometry(vae)
    return chunks * config.clip_length - getattr(config, "token_drop", 0) * temporal


def latent_frames(vae, frames: int) -> int:
    """The latent frames a clip VAE makes of `frames` frames: the causal 1 + (frames - 1) / t, or, for one that
    encodes `clip_length` frames at a time, ceil(clip_length / t) a chunk less the `token_drop` it drops (17k+5 ->
    5k+2)."""
    _, temporal, _ = vae_geometry(vae)
    length = getattr(vae.config, "clip_length", None)
    if not length:
        return 1 + (frames - 1) // temporal
    chunks = -(-frames // length)
    return chunks * -(-length // temporal) - getattr(vae.config, "token_drop", 0)


def latent_channels(vae) -> int:
    config = vae.config
    return getattr(config, "latent_channels", None) or getattr(config, "z_dim", 4)


def vae_pass(vae, decode: bool, frames: int, side: int):
    """A callable running one entry's encode (posterior mean and std, as the cache does) or one decode."""
    spatial, temporal, clips = vae_geometry(vae)
    generator = torch.Generator().manual_seed(0)
    if decode:
        latent_side = side // spatial
        shape = (1, latent_channels(vae), latent_frames(vae, frames), latent_side, latent_side)
        if getattr(vae.config, "patch_size", None) and not clips:  # FLUX.2's VAE: patched latents
            patch = vae.config.patch_size
            shape = (1, latent_channels(vae), side // (spatial // patch[0]), side // (spatial // patch[0]))
        latents = torch.randn(shape if clips else (1, shape[1], *shape[-2:]), generator=generator)
        latents = latents.to(torch.bfloat16)
        return lambda: vae.decode(latents).sample
    channels = getattr(vae.config, "in_channels", None) or getattr(vae.config, "input_channels", 3)
    shape = (1, channels, frames, side, side) if clips else (1, channels, side, side)
    pixels = torch.randn(shape, generator=generator).to(torch.bfloat16)

    def encode():
        posterior = vae.encode(pixels).latent_dist
        return posterior.mean, posterior.std

    return encode


def vae_bytes_measured(vae, decode: bool, frames: int, side: int) -> int:
    return peak_bytes(vae_pass(vae, decode, frames, side))


# ---------------------------------------------------------------------------------------------- text encoders

HIDDEN_KEYS = ("hidden_size", "d_model")
FFN_KEYS = ("intermediate_size", "d_ff")
HEAD_KEYS = ("num_attention_heads", "num_heads")
KV_KEYS = ("num_key_value_heads",)


def _first(config: dict, keys) -> str | None:
    return next((key for key in keys if config.get(key)), None)


def scaled_text_config(config: dict, hidden_mult: int, ffn_mult: int) -> dict:
    """A text encoder config with its width (heads, at the same head width) and MLP width multiplied."""
    scaled = copy.deepcopy(config)
    text = scaled.get("text_config") or scaled
    hidden_key, heads_key = _first(text, HIDDEN_KEYS), _first(text, HEAD_KEYS)
    head_dim = text.get("head_dim") or text.get("d_kv") or text[hidden_key] // text[heads_key]
    text[heads_key] *= hidden_mult
    if text.get("num_key_value_heads"):
        text["num_key_value_heads"] *= hidden_mult
    text[hidden_key] = text[heads_key] * head_dim if "head_dim" not in text else text[hidden_key] * hidden_mult
    ffn_key = _first(text, FFN_KEYS)
    if ffn_key:
        text[ffn_key] *= ffn_mult * hidden_mult
    for vision in ("vision_config",):  # a vision tower projecting into the text width
        if scaled.get(vision) and scaled[vision].get("out_hidden_size"):
            scaled[vision]["out_hidden_size"] = text[hidden_key]
    if "projection_dim" in scaled:
        scaled["projection_dim"] = text[hidden_key]
    return scaled


def build_text_encoder(config: dict):
    import transformers

    from dstune.hf import quiet_hf_libraries

    with quiet_hf_libraries():
        cls = getattr(transformers, config["architectures"][0])
        model = cls(transformers.AutoConfig.for_model(**config))
    return model.to(torch.bfloat16).eval()


def text_pass(encoder, tokens: int, padding_mask: bool = True, captions: int = 1):
    """A callable running one caption of `tokens` tokens through the encoder as dstune runs it (only the last hidden
    state kept, no logits beyond one position: dstune.families.lean_text), padded as the pipelines pad a caption to
    their length: its last quarter masked (the attention mask transformers then builds is counted), or, as the
    pipelines that pass none call it, without a mask; `captions` of them in one batch."""
    from dstune.families.lean_text import lean_kwargs

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (captions, tokens), generator=generator)
    asked = {"input_ids": ids, "output_hidden_states": True}
    if padding_mask:
        asked["attention_mask"] = torch.ones(captions, tokens, dtype=torch.long)
        asked["attention_mask"][:, tokens - tokens // 4 :] = 0
    kwargs = lean_kwargs(encoder, asked, (-1,))
    return lambda: encoder(**kwargs)


def text_dims_of(encoder) -> tuple[int, int, int]:
    from dstune.memory.working import text_dims

    return text_dims(encoder.config.to_dict())
