"""The encoders' working memory each unit declares (its card's `working`, dstune.memory.working), against a
fresh count of the real diffusers / transformers class (bench/working_measure.py: the bytes a pass allocates beyond
its input) at a size, and for a text encoder a width and a batch, the fit did not see: within 10 % (T5's and UMT5's,
whose peak is the larger of two moments, never more than 10 % below nor 20 % above). A VAE's encode of one cache
entry and decode of one sample, a text encoder's lean pass over one caption (dstune.families.lean_text), as the
memory plan's cache and sample phases count them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from working_measure import (  # noqa: E402
    build_text_encoder,
    build_vae,
    narrow_vae,
    peak_bytes,
    read,
    scaled_text_config,
    text_pass,
    vae_bytes_measured,
)
from working_memory import TEXT_CHECK, unit_working, units, vae_sizes  # noqa: E402

from dstune.memory.working import TextWork, VaeWork, text_bytes, vae_bytes  # noqa: E402

TOLERANCE = 0.10
SCORES_OVER = 0.20
DECLARED = [(unit, name, work) for unit in units() for name, work in unit_working(unit).items()]
VAES = [(unit, name, work) for unit, name, work in DECLARED if isinstance(work, VaeWork)]
TEXT = [(unit, name, work) for unit, name, work in DECLARED if isinstance(work, TextWork)]


def test_every_unit_on_the_diffusers_cores_declares_its_encoders():
    declaring = set(units())
    expected = {"sd", "sd3_flux", "qwen_image", "zimage", "flux2", "ideogram4", "krea2", "qwen_image_21"}
    assert expected | {"ernie_image", "wan", "hunyuan_video15", "ltx2", "minimax_h3"} <= declaring
    assert all(work.measured_on for _, _, work in DECLARED)


@pytest.mark.parametrize("unit,name,work", VAES, ids=[f"{unit}-{name}" for unit, name, _ in VAES])
def test_a_vaes_encode_and_decode_at_a_third_size(unit, name, work):
    config = read(work.measured_on)
    narrow = narrow_vae(config)
    vae = build_vae(narrow)
    _, (frames, side) = vae_sizes(vae)
    tokens = 0.0
    if work.mask:  # its latent tokens (the mask's side), at the VAE's own compression
        spatial, temporal = narrow["spatial_compression_ratio"], narrow["temporal_compression_ratio"]
        tokens = (1 + (frames - 1) // temporal) * (side // spatial) ** 2
    for decode in (False, True):
        measured = vae_bytes_measured(vae, decode, frames, side)
        predicted = vae_bytes(work, narrow, decode, frames, side, side, tokens)
        assert predicted == pytest.approx(measured, rel=TOLERANCE), (unit, name, decode, predicted, measured)


@pytest.mark.parametrize("unit,name,work", TEXT, ids=[f"{unit}-{name}" for unit, name, _ in TEXT])
def test_a_text_encoders_pass_at_a_third_length_width_and_batch(unit, name, work):
    tokens, hidden_mult, ffn_mult = TEXT_CHECK
    config = scaled_text_config(read(work.measured_on), hidden_mult, ffn_mult)
    limit = (config.get("text_config") or config).get("max_position_embeddings")
    tokens = min(tokens, limit * 3 // 4) if limit else tokens  # CLIP's 77 positions
    encoder = build_text_encoder(config)
    # an encoder whose attention keeps its scores (T5's) holds the most either while they are alive or in its MLP:
    # the sum of both moments' terms is above the larger, at most SCORES_OVER here
    over = SCORES_OVER if work.scores or work.pass_scores else TOLERANCE
    for captions in (1, 3):  # a chunk of captions in one pass: the position bias T5 computes once among them
        measured = peak_bytes(text_pass(encoder, tokens, work.padding_mask, captions))
        predicted = text_bytes(work, encoder.config.to_dict(), tokens, captions=captions)
        assert (1 - TOLERANCE) * measured <= predicted <= (1 + over) * measured, (
            unit,
            name,
            captions,
            predicted,
            measured,
        )


def test_hunyuan_video15s_vae_mask_is_two_bytes_a_token_pair_and_its_tiles_bound_a_clip():
    """The VAE's causal attention mask (diffusers' prepare_causal_attention_mask: a (tokens, tokens) tensor in the
    query's dtype) is what makes a whole 720p clip impossible: 31 x 45 x 45 latent tokens, 7.9 GB; through 256 px
    tiles a clip costs what a 256 px one does, whatever its size."""
    from dstune.models.hunyuan_video15.card import WORKING_MEMORY

    work = WORKING_MEMORY["AutoencoderKLHunyuanVideo15"]
    config = read(work.measured_on)
    tokens = 31 * 45 * 45
    whole = vae_bytes(work, config, False, 121, 720, 720, tokens)
    assert work.mask == pytest.approx(2.0, rel=0.01) and work.mask * tokens**2 == pytest.approx(7.9e9, rel=0.01)
    assert whole > 110e9  # no GPU encodes it whole
    tiled = vae_bytes(work, config, False, 121, 720, 720, tokens, tiled=True)
    assert tiled == vae_bytes(work, config, False, 121, 256, 256, 31 * 16 * 16) < 16e9
