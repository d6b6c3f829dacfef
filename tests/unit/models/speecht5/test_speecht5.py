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
from dstune.families.speakers import voices_for
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
    speakers = ["ann", "bob", "", "ann", "bob"]
    with_file.voices = voices_for(SPEECHT5_CARD, with_file.model_spec, "separate", speakers, ["12"] * 5)
    assert with_file.voices.given == {"": "default", "ann": "ann", "bob": "bob"}
    encoded = with_file.encode_batch(_batch(built, speakers))
    assert torch.equal(encoded["speaker_embeddings"][0], torch.ones(16))
    assert torch.equal(encoded["speaker_embeddings"][1], -torch.ones(16))
    assert torch.equal(encoded["speaker_embeddings"][2], with_file.speakers["default"])
    with pytest.raises(FamilyError, match="speakers carl are not in the run's speaker map"):
        with_file.encode_batch(_batch(built, ["carl"] * 5))
    with_file.voices = None
    with pytest.raises(FamilyError, match=r"name speakers \(ann, bob\) but SpeechT5 was not given how to hear them"):
        with_file.encode_batch(_batch(built, speakers))
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


def _vectors(path, **vectors):
    from safetensors.torch import save_file

    save_file({name: torch.full((size,), value) for name, (value, size) in vectors.items()}, str(path))
    return str(path)


def test_validate_maps_speakers_to_their_vectors_and_names_a_missing_or_wrong_one(cache_dir, tmp_path, capsys):
    """SpeechT5 hears a speaker through its vector: validate reads model.speaker_embeddings offline and prints each
    speaker's vector; a speaker without one or a vector of another size is exit 1 naming the speaker and the file
    (before: a traceback on every rank at step 1, or at start-up); two speakers without vectors are refused (one
    blended voice) unless data.speakers: blend."""
    from speaker_data import two_speaker_list, validate_output

    root = two_speaker_list(tmp_path / "data")
    data = {"path": str(root)}
    model = {"family": "speecht5"}
    code, out = validate_output(capsys, tmp_path, model, data)
    assert code == 1 and "the data names 2 speakers (ann, bob), but SpeechT5 has no speaker vectors here" in out
    assert "model.speaker_embeddings" in out and "data.speakers: blend" in out
    code, out = validate_output(capsys, tmp_path, model, {**data, "speakers": "blend"})
    assert code == 0 and "2 (ann, bob), blended into SpeechT5's default voice" in out
    good = _vectors(tmp_path / "good.safetensors", ann=(1.0, 16), bob=(-1.0, 16))
    code, out = validate_output(capsys, tmp_path, {**model, "speaker_embeddings": good}, data)
    assert code == 0 and "speakers 2 (names sorted): ann -> ann, bob -> bob" in out and "good.safetensors" in out
    missing = _vectors(tmp_path / "missing.safetensors", ann=(1.0, 16))
    code, out = validate_output(capsys, tmp_path, {**model, "speaker_embeddings": missing}, data)
    assert code == 1 and "model.speaker_embeddings" in out
    assert f"{missing} has no vector for 1 of the data's speakers: bob (it holds ann)" in out
    wrong = _vectors(tmp_path / "wrong.safetensors", ann=(1.0, 16), bob=(-1.0, 8))
    code, out = validate_output(capsys, tmp_path, {**model, "speaker_embeddings": wrong}, data)
    assert code == 1 and f"{wrong}: speaker vectors must have 16 values" in out and "bob (8) do not" in out


def test_export_keeps_the_speakers_and_synthesize_speaks_as_one(cache_dir, tmp_path, capsys):
    """End to end on tiny-speecht5: the export writes speakers.json beside the model, `dstune synthesize --speaker
    bob` speaks with bob's vector (the clip the class makes with it, not ann's), and an unknown name is a usage
    error (exit 2) that lists the known speakers."""
    import json

    import numpy as np
    import soundfile

    from dstune.cli import main
    from speaker_data import speaker_batch, two_speaker_list

    good = _vectors(tmp_path / "spk.safetensors", ann=(0.3, 16), bob=(-0.3, 16))
    model = build_model(SpeechT5ModelSpec(family="speecht5", speaker_embeddings=good), cache_dir, "cpu")
    speaker_batch(model, two_speaker_list(tmp_path / "data"))  # sets model.voices as start-up does
    out = model.export(model.trainable.state_dict(), tmp_path / "export")
    assert json.loads((out / "speakers.json").read_text())["speakers"] == {"ann": "ann", "bob": "bob"}
    said = {}
    for name in ("ann", "bob"):
        wav = tmp_path / f"{name}.wav"
        args = ["synthesize", str(out), "12", "-o", str(wav), "--seconds", "0.3", "--speaker", name]
        assert main(args) == 0, capsys.readouterr()
        said[name] = soundfile.read(wav, dtype="float32")[0]
        assert np.array_equal(said[name], SpeechT5.synthesize(out, "12", 0.3, 0.8, 0, name).wave)
    assert said["ann"].shape != said["bob"].shape or not np.array_equal(said["ann"], said["bob"])
    capsys.readouterr()
    assert main(["synthesize", str(out), "12", "-o", str(tmp_path / "x.wav"), "--speaker", "carl"]) == 2
    err = capsys.readouterr().err
    assert "--speaker carl" in err and "does not know this speaker: its speakers are ann, bob" in err
