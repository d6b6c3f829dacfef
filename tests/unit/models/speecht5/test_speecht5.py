"""SpeechT5 (its card and class, dstune.models.speecht5) without a process group: labels padded with -100 to a
multiple of the reduction factor, layerdrop off, speaker vectors from a file or the fixed default, the loss falling,
export with 0-dim parameters."""

from __future__ import annotations

import pytest
import torch

from dstune.pretrained import build_model
from dstune.data.audio import SpeechDataset, collate_speech, speech_records
from dstune.models.speecht5.card import SPEECHT5_CARD
from dstune.models.speecht5.model import SpeechT5
from dstune.families.base import FamilyError
from dstune.builtin import ensure_builtin_model
from dstune.spec.models import DataSpec
from dstune.models.speecht5.spec import SpeechT5ModelSpec
from loaded_models import CACHE_DIR

pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def cache_dir():
    ensure_builtin_model("builtin:tiny-speecht5", CACHE_DIR)
    return CACHE_DIR


@pytest.fixture(scope="module")
def built(cache_dir):
    return build_model(SpeechT5ModelSpec(family="speecht5"), cache_dir, "cpu")


def _batch(built, speakers=None):
    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))
    dataset = SpeechDataset(records[:5], built.sample_rate)
    batch = collate_speech([dataset[i] for i in range(5)])
    if speakers:
        batch["speakers"] = speakers
    return batch


def test_labels_are_minus_100_padded_to_the_reduction_factor(built):
    assert type(built) is SpeechT5 and built.card is SPEECHT5_CARD
    config = built.trainable.config
    assert config.encoder_layerdrop == 0.0 and config.decoder_layerdrop == 0.0
    batch = _batch(built)
    encoded = built.encode_batch(batch)
    labels = encoded["labels"]
    assert labels.shape[1] % config.reduction_factor == 0 and labels.shape[2] == config.num_mel_bins
    frames = [int((row != -100).all(-1).sum()) for row in labels]
    assert len(set(frames)) > 1  # clips of different lengths: the shorter ones are padded
    for row, n in zip(labels, frames):
        assert (row[n:] == -100).all() and (row[:n] != -100).all()
    assert encoded["speaker_embeddings"].shape == (5, config.speaker_embedding_dim)


def test_loss_falls(built):
    encoded = built.encode_batch(_batch(built))
    optimizer = torch.optim.AdamW(built.trainable.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        loss = built.loss(built.trainable, encoded, 0, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_dropout_draws_are_a_function_of_seed_step_and_sample(built):
    """The loss of one batch at one step is the same however much random state the process used before (what a
    resumed run sees), and differs at another step (fresh dropout masks); the global RNG is left untouched."""
    encoded = built.encode_batch(_batch(built))
    torch.manual_seed(1)
    first = built.loss(built.trainable, encoded, 7, 3).item()
    torch.rand(1000)  # another history of draws
    state = torch.get_rng_state()
    again = built.loss(built.trainable, encoded, 7, 3).item()
    assert torch.equal(torch.get_rng_state(), state)
    assert again == first
    assert built.loss(built.trainable, encoded, 7, 4).item() != first


def test_speaker_vectors_from_a_file(cache_dir, tmp_path, built):
    from safetensors.torch import save_file

    save_file({"ann": torch.ones(16), "bob": -torch.ones(16)}, str(tmp_path / "spk.safetensors"))
    with_file = build_model(
        SpeechT5ModelSpec(family="speecht5", speaker_embeddings=str(tmp_path / "spk.safetensors")), cache_dir, "cpu"
    )
    encoded = with_file.encode_batch(_batch(built, ["ann", "bob", "", "ann", "bob"]))
    assert torch.equal(encoded["speaker_embeddings"][0], torch.ones(16))
    assert torch.equal(encoded["speaker_embeddings"][2], with_file.speakers["default"])
    with pytest.raises(FamilyError, match="'carl'"):
        with_file.encode_batch(_batch(built, ["carl"] * 5))
    save_file({"ann": torch.ones(8)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(FamilyError, match="must have 16 values"):
        build_model(
            SpeechT5ModelSpec(family="speecht5", speaker_embeddings=str(tmp_path / "bad.safetensors")), cache_dir, "cpu"
        )


def test_bf16_runs_with_parameters_cast_as_deepspeed_does(cache_dir, built):
    """DeepSpeed's bf16 casts parameters only: the class casts SpeechT5's fp32 buffers, or LayerNorm fails."""
    half = build_model(SpeechT5ModelSpec(family="speecht5"), cache_dir, "cpu", torch.bfloat16)
    for parameter in half.trainable.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    encoded = half.encode_batch(_batch(built), torch.bfloat16)
    assert torch.isfinite(half.loss(half.trainable, encoded, 0, 0))
