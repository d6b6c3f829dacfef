"""Measure the working memory of every frozen encoder class dstune runs (each unit's VAE encode and decode, its text
encoders) and print the constants its card declares (`working`; dstune/memory/working.py says what
they are and how the memory plan evaluates them).

    python3 bench/working_memory.py                # every unit's classes (a few minutes on 2 busy cores)
    python3 bench/working_memory.py qwen_image     # this unit's only

Each class is measured on the stored config its declaration names (`measured_on`), as bench/working_measure.py
counts: a VAE at a quarter of its channels, encoding and decoding an entry at two sizes (a clip: two frame counts
and two sides), fitted per channel of its first level to bytes = a x voxels + b x pixels + c; a text encoder from
its built-in's stored config at three widths and three caption lengths, one caption and two a pass, fitted to
bytes = captions x (T x (a h + b f + c) + T^2 x (d + e heads)) + T^2 x (g + k heads), no term negative. Where a
class builds an attention mask over its latent tokens (HunyuanVideo 1.5's VAE), its mask is measured alone at two
token counts. tests/unit/test_working_memory.py checks every declaration at another
size and width.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from working_measure import (  # noqa: E402
    VAE_NARROWING,
    build_text_encoder,
    build_vae,
    chunk_frames,
    narrow_vae,
    peak_bytes,
    read,
    scaled_text_config,
    text_dims_of,
    text_pass,
    vae_bytes_measured,
    vae_geometry,
)

from dstune.memory.working import TextWork, VaeWork, vae_width  # noqa: E402

TEXT_WIDTHS = ((4, 4), (8, 4), (4, 8))  # (hidden, MLP) multiples of the built-in's widths the fit sees
# caption lengths where an encoder whose attention keeps its scores (T5's) holds the most while those are alive, as
# at the real size (512 tokens over 64 heads)
TEXT_TOKENS = (64, 128, 192)
TEXT_CHECK = (160, 6, 6)  # tokens, hidden and MLP multiples of the unit test


def unit_working(unit: str) -> dict:
    """A unit's declared constants (its cards' `working`: PipelineCard.working), {} where it declares none."""
    from dstune.registry import cards

    return {name: work for card in cards() if card.unit == unit for name, work in getattr(card, "working", {}).items()}


def units() -> list[str]:
    from dstune.registry import cards

    return sorted({card.unit for card in cards() if getattr(card, "working", None)})


def _lstsq(rows: list[list[float]], values: list[float]) -> list[float]:
    matrix = torch.tensor(rows, dtype=torch.float64)
    target = torch.tensor([[v] for v in values], dtype=torch.float64)
    return torch.linalg.lstsq(matrix, target, driver="gelsd").solution[:, 0].tolist()


def _nonnegative(rows: list[list[float]], values: list[float]) -> list[float]:
    """Least squares of the relative errors with every coefficient at least 0 (each term is memory a pass holds): a
    text encoder's terms from eighteen counts, where an unconstrained fit trades one term against another."""
    from scipy.optimize import nnls

    rows = [[value / target for value in row] for row, target in zip(rows, values)]  # relative errors
    scale = [max(abs(row[i]) for row in rows) or 1.0 for i in range(len(rows[0]))]
    solution, _ = nnls([[value / s for value, s in zip(row, scale)] for row in rows], [1.0] * len(rows))
    return [float(coefficient / s) for coefficient, s in zip(solution, scale)]


def vae_sizes(vae) -> tuple[list, tuple]:
    """(the (frames, side) sizes of the fit, the unit test's size)."""
    spatial, temporal, clips = vae_geometry(vae)
    if not clips or vae.config.get("_class_name", "") in IMAGE_CLIP_VAES:
        return [(1, 4 * spatial), (1, 8 * spatial)], (1, 6 * spatial)
    if getattr(vae.config, "clip_length", None):  # a VAE of chunks of clip_length frames: one to three chunks
        short, long = chunk_frames(vae, 2), chunk_frames(vae, 3)
        sizes = [(short, 2 * spatial), (long, 2 * spatial), (short, 4 * spatial), (long, 4 * spatial)]
        return sizes, (chunk_frames(vae, 4), 3 * spatial)
    # from 1 + 2t frames on: a class that works in chunks of t frames (Wan's) holds its steady state by then
    short, long = 1 + 2 * temporal, 1 + 4 * temporal
    sizes = [(short, 2 * spatial), (long, 2 * spatial), (short, 4 * spatial), (long, 4 * spatial)]
    return sizes, (1 + 3 * temporal, 3 * spatial)


# video-style VAEs of image models: entries are one-frame clips
IMAGE_CLIP_VAES = ("AutoencoderKLQwenImage", "AutoencoderKLQwenImage21")


def fit_vae(config: dict, decode: bool, vae=None) -> tuple[float, float, float]:
    """(per voxel, per pixel, fixed) bf16 bytes per width unit of one entry's encode or decode."""
    vae = vae or build_vae(narrow_vae(config))
    sizes, _ = vae_sizes(vae)
    width = vae_width(dict(vae.config))
    values = [vae_bytes_measured(vae, decode, frames, side) for frames, side in sizes]
    if len(sizes) == 2:  # stills: voxels are pixels
        per_pixel, fixed = _lstsq([[side * side, 1.0] for _, side in sizes], values)
        return per_pixel / width, 0.0, fixed / width
    rows = [[frames * side * side, side * side, 1.0] for frames, side in sizes]
    voxel, pixel, fixed = _lstsq(rows, values)
    return voxel / width, pixel / width, fixed / width


def mask_bytes(vae) -> float:
    """Bytes per (latent tokens)^2 of an attention mask the VAE builds whole (0 where it builds none)."""
    blocks = [m for m in vae.modules() if hasattr(m, "prepare_causal_attention_mask")]
    if not blocks:
        return 0.0
    make = blocks[0].prepare_causal_attention_mask
    sizes = [(2, 64), (2, 128)]
    values = [peak_bytes(lambda f=f, hw=hw: make(f, hw, torch.bfloat16, "cpu", batch_size=1)) for f, hw in sizes]
    (per_pair,) = _lstsq([[(f * hw) ** 2] for f, hw in sizes], values)
    return per_pair


def measure_vae(work: VaeWork) -> dict:
    config = read(work.measured_on)
    vae = build_vae(narrow_vae(config))
    encode = fit_vae(config, False, vae)
    decode = fit_vae(config, True, vae)
    return {
        "encode": round(encode[0], 3),
        "encode_frame": round(encode[1], 3),
        "encode_fixed": round(encode[2], 1),
        "decode": round(decode[0], 3),
        "decode_frame": round(decode[1], 3),
        "decode_fixed": round(decode[2], 1),
        "mask": round(mask_bytes(vae), 3),
    }


def text_tokens(config: dict) -> tuple[int, ...]:
    """The caption lengths of the fit: TEXT_TOKENS, or up to the encoder's positions (CLIP's 77)."""
    limit = (config.get("text_config") or config).get("max_position_embeddings") or TEXT_TOKENS[-1]
    return TEXT_TOKENS if limit >= TEXT_TOKENS[-1] else (limit // 4, limit // 2, limit)


def text_features(tokens: int, hidden: int, ffn: int, heads: int, captions: int) -> list[float]:
    per_caption = [tokens * hidden, tokens * ffn, tokens, tokens * tokens, tokens * tokens * heads]
    return [captions * value for value in per_caption] + [tokens * tokens, tokens * tokens * heads]


def measure_text(work: TextWork) -> dict:
    """A text encoder's constants: one caption and two in a batch (what a pass holds once, whatever its captions:
    T5's position bias), at three widths and three lengths."""
    config = read(work.measured_on)
    rows, values = [], []
    for hidden_mult, ffn_mult in TEXT_WIDTHS:
        encoder = build_text_encoder(scaled_text_config(config, hidden_mult, ffn_mult))
        hidden, ffn, heads = text_dims_of(encoder)
        for tokens in text_tokens(config):
            for captions in (1, 2, 4):
                rows.append(text_features(tokens, hidden, ffn, heads, captions))
                values.append(peak_bytes(text_pass(encoder, tokens, work.padding_mask, captions)))
    names = ("hidden", "ffn", "token", "square", "scores", "pass_square", "pass_scores")
    digits = {"token": 1}
    return {name: round(value, digits.get(name, 3)) for name, value in zip(names, _nonnegative(rows, values))}


def main(selected: list[str]) -> None:
    for unit in selected or units():
        print(f"{unit}:")
        for name, work in unit_working(unit).items():
            measured = measure_vae(work) if isinstance(work, VaeWork) else measure_text(work)
            if getattr(work, "tile_px", 0):  # declared, not measured: the class's own tiles
                measured["tile_px"] = work.tile_px
            if getattr(work, "padding_mask", True) is False:  # declared: how its pipeline calls it
                measured["padding_mask"] = False
            fields = ", ".join(f"{key}={value}" for key, value in measured.items() if value or value is False)
            print(f"    {name!r}: {type(work).__name__}({fields}, measured_on={work.measured_on!r}),", flush=True)
    print(f"(VAEs measured at 1/{VAE_NARROWING} of their channels; constants per channel of the first level)")


if __name__ == "__main__":
    main(sys.argv[1:])
