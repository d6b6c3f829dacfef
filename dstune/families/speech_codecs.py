"""The frozen audio codecs of the tts_lm family: loading, their facts, clip -> codes -> waveform.

EnCodec, DAC and Mimi are transformers classes with one code per codebook per frame; SNAC (the `snac` package,
the codec of Llama-based TTS models) has hierarchical codebooks at 1, 2, 4 ... codes per coarsest frame, which the layout's
`frame_order` writes as positions of a frame (dstune.families.token_layouts). Either way one clip's codes are a
(positions, frames) int64 tensor.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.hf import quiet_hf_libraries

CODEC_CLASSES = {"encodec": "EncodecModel", "dac": "DacModel", "mimi": "MimiModel", "snac": "snac.SNAC"}
SNAC_FILES = ("config.json", "pytorch_model.bin")


def load_codec(kind: str, source: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The codec in `source` (frozen, eval, in `dtype`: float32, or float64 for a float64 run, never lower, so that
    its codes do not depend on the training precision); FamilyError naming the folder when it cannot be loaded."""
    try:
        if kind == "snac":
            from snac import SNAC

            codec = SNAC.from_pretrained(str(source))
        else:
            import transformers

            with quiet_hf_libraries():
                codec = getattr(transformers, CODEC_CLASSES[kind]).from_pretrained(source, torch_dtype=torch.float32)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
        raise FamilyError(
            f"{source}: cannot load it as {CODEC_CLASSES[kind]} (model.codec: {kind}): "
            f"{(str(err).strip().splitlines() or [type(err).__name__])[0]}"
        ) from None
    return codec.to(dtype).eval().requires_grad_(False)


def save_codec(codec, kind: str, source: Path, out: Path) -> None:
    """The codec beside an export: transformers' save_pretrained, or SNAC's own two files copied (it is frozen)."""
    if kind != "snac":
        codec.save_pretrained(out)
        return
    out.mkdir(parents=True, exist_ok=True)
    for name in SNAC_FILES:
        shutil.copyfile(source / name, out / name)


def codec_facts(codec, kind: str) -> dict:
    """Codebooks, codebook size, sampling rate, samples per (coarsest) frame and codes per frame of each codebook."""
    if kind == "snac":
        strides = [int(s) for s in codec.vq_strides]
        return {
            "codebooks": len(strides),
            "codebook_size": int(codec.codebook_size),
            "sampling_rate": int(codec.sampling_rate),
            "samples_per_frame": int(codec.hop_length) * max(strides),
            "codes_per_frame": [max(strides) // s for s in strides],
        }
    config = codec.config
    codebooks = config.n_codebooks if kind == "dac" else config.num_quantizers
    frame_rate = config.sampling_rate / config.hop_length if kind == "dac" else config.frame_rate
    return {
        "codebooks": int(codebooks),
        "codebook_size": int(config.codebook_size),
        "sampling_rate": int(config.sampling_rate),
        "samples_per_frame": config.sampling_rate / frame_rate,
        "codes_per_frame": [1] * int(codebooks),
    }


def encode_clip(codec, kind: str, wave: torch.Tensor, num_codebooks: int, frame_order=None) -> torch.Tensor:
    """(positions, frames) int64 codes of one clip (1-D float tensor at the codec's rate). For EnCodec/DAC/Mimi the
    positions are the first num_codebooks codebooks; for SNAC they follow `frame_order` ((codebook, index) pairs).
    `dac_hop_padded` is DAC on the clip zero-padded to a multiple of its hop (as DiaProcessor encodes; its last
    frame differs from the unpadded clip's, which DAC cuts)."""
    weight = next(codec.parameters())
    x = wave.reshape(1, 1, -1).to(weight.device, weight.dtype)
    if kind == "dac_hop_padded":  # as DiaProcessor encodes a clip: zero-padded to a multiple of the hop
        x = torch.nn.functional.pad(x, (0, -x.shape[-1] % int(codec.config.hop_length)))
        kind = "dac"
    with torch.no_grad():
        if kind == "snac":
            levels = codec.encode(x)
            frames = levels[0].shape[-1]
            return torch.stack([levels[c][0].reshape(frames, -1)[:, i] for c, i in frame_order]).long().cpu()
        if kind == "encodec":
            codes = codec.encode(x, bandwidth=max(codec.config.target_bandwidths)).audio_codes[0, 0]
        elif kind == "mimi":
            codes = codec.encode(x, num_quantizers=num_codebooks).audio_codes[0]
        else:
            codes = codec.encode(x).audio_codes[0]
    return codes[:num_codebooks].long().cpu()


def decode_codes(codec, kind: str, codes: torch.Tensor, frame_order=None) -> np.ndarray:
    """float32 waveform of (positions, frames) codes."""
    codes = codes.long().to(next(codec.parameters()).device)
    with torch.no_grad():
        if kind == "snac":
            per_frame = [sum(1 for c, _ in frame_order if c == level) for level in range(len(codec.vq_strides))]
            levels = [torch.zeros(codes.shape[1], n, dtype=torch.long, device=codes.device) for n in per_frame]
            for position, (c, i) in enumerate(frame_order):
                levels[c][:, i] = codes[position]
            audio = codec.decode([level.reshape(1, -1) for level in levels])
        elif kind == "encodec":
            audio = codec.decode(codes[None, None], [None]).audio_values
        elif kind == "mimi":
            audio = codec.decode(codes[None]).audio_values
        else:
            audio = codec.decode(audio_codes=codes[None]).audio_values
    return audio.reshape(-1).float().cpu().numpy()
