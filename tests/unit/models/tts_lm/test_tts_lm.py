"""The codec-token TTS LMs (their card and class, dstune.models.tts_lm) without a process group: the built-in model,
the token layout and its label mask, the loss falling on builtin:tones, sampling to WAV, export + reload + synthesis,
the DAC codec path, layout mismatches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dstune.pretrained import build_model
from dstune.data.audio import SpeechDataset, collate_speech, speech_records
from dstune.families.speech_codecs import decode_codes
from dstune.models.tts_lm.card import TTS_LM_CARD
from dstune.models.tts_lm.model import TtsLm
from dstune.families.speech import save_wavs
from dstune.families.base import FamilyError
from dstune.builtin import ensure_builtin_model
from dstune.spec.models import DataSpec, SampleSpec
from dstune.models.tts_lm.spec import TtsLmModelSpec
from loaded_models import CACHE_DIR

soundfile = pytest.importorskip("soundfile")


@pytest.fixture(scope="module")
def cache_dir():
    """The tests' shared model cache (as tests/dist/harness.py): the built-in model is built once (~20 s)."""
    ensure_builtin_model("builtin:tiny-tts-lm", CACHE_DIR)
    return CACHE_DIR


@pytest.fixture(scope="module")
def built(cache_dir):
    torch.manual_seed(0)
    return build_model(TtsLmModelSpec(family="tts_lm", max_sample_seconds=0.5), cache_dir, "cpu")


@pytest.fixture(scope="module")
def batch(built):
    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))
    dataset = SpeechDataset(records, built.sample_rate)
    return collate_speech([dataset[i] for i in range(8)])


def test_builtin_is_tiny_and_codes_follow_the_sound(built):
    assert type(built) is TtsLm and built.card is TTS_LM_CARD
    assert built.codec_kind == "encodec" and built.layout["num_codebooks"] == 2
    assert sum(p.numel() for p in built.trainable.parameters()) < 300_000
    from dstune.data.audio import resample
    from dstune.data.synthetic import render_tones

    codes = [built.encode_clip(torch.from_numpy(resample(render_tones(d), 16000, 8000))) for d in "09"]
    assert codes[0].shape == (2, 7) and not torch.equal(codes[0], codes[1])


def test_sequence_layout_masks_the_text_prefix(built, batch):
    encoded = built.encode_batch(batch)
    layout = built.layout
    for row, text in enumerate(batch["texts"]):
        prefix = len(text.encode()) + 1
        ids, labels = encoded["input_ids"][row], encoded["labels"][row]
        assert ids[prefix - 1] == layout["audio_bos"] and (labels[:prefix] == -100).all()
        length = int(encoded["attention_mask"][row].sum())
        audio = ids[prefix : length - 1]
        assert ids[length - 1] == layout["audio_eos"] and torch.equal(labels[prefix:length], ids[prefix:length])
        codebook = (audio - layout["audio_offset"]) // layout["codebook_size"]
        assert torch.equal(codebook, torch.arange(len(audio)) % layout["num_codebooks"])
        assert (labels[length:] == -100).all()


def test_loss_falls_and_samples_change(built, batch, tmp_path):
    lm = built.trainable
    before = built.sample(lm, ["12"], SampleSpec(seed=3), None)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    encoded = built.encode_batch(batch)
    losses = []
    for step in range(25):
        loss = built.loss(lm, encoded, 0, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
    after = built.sample(lm, ["12"], SampleSpec(seed=3), None)
    assert len(before[0].wave) != len(after[0].wave) or not np.array_equal(before[0].wave, after[0].wave)
    folder = save_wavs(after, ["12"], tmp_path / "samples" / "step-000008.png")
    wave, rate = soundfile.read(folder / "00.wav")
    assert rate == 8000 and len(wave) == len(after[0].wave)
    assert "12" in (folder / "prompts.txt").read_text()


def test_export_reloads_and_synthesizes(built, tmp_path):
    from transformers import AutoModelForCausalLM

    out = built.export(built.trainable.state_dict(), tmp_path / "export")
    assert json.loads((out / "dstune_tts.json").read_text()) == built.layout
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in built.trainable.state_dict().items())
    clip = TtsLm.synthesize(out, "7", seconds=0.2, temperature=0.0, seed=0)
    assert clip.sample_rate == 8000 and 0 < clip.wave.size <= 0.2 * 8000 and np.isfinite(clip.wave).all()
    from dstune.cli import main

    assert (
        main(["synthesize", str(out), "7", "-o", str(tmp_path / "seven.wav"), "--seconds", "0.2", "--temperature", "0"])
        == 0
    )
    wave, rate = soundfile.read(tmp_path / "seven.wav")
    assert rate == 8000 and np.array_equal(wave.astype(np.float32), clip.wave)


def test_plain_lm_with_a_dac_codec_gets_audio_tokens_appended(tmp_path):
    """An LM without dstune_tts.json (text vocabulary only) + a DAC codec folder: the vocabulary is resized."""
    from transformers import DacConfig, DacModel, LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path / "lm")
    DacModel(
        DacConfig(
            encoder_hidden_size=8,
            downsampling_ratios=[2, 4],
            decoder_hidden_size=16,
            n_codebooks=3,
            codebook_size=16,
            codebook_dim=4,
            sampling_rate=16000,
        )
    ).save_pretrained(tmp_path / "dac")
    built = build_model(
        TtsLmModelSpec(
            family="tts_lm",
            pretrained=str(tmp_path / "lm"),
            codec="dac",
            codec_pretrained=str(tmp_path / "dac"),
            num_codebooks=2,
        ),
        tmp_path,
        "cpu",
    )
    assert built.layout["audio_offset"] == 300 and built.layout["num_codebooks"] == 2
    assert built.trainable.get_input_embeddings().num_embeddings == 300 + 2 * 16 + 3
    encoded = built.encode_batch({"index": [0], "texts": ["hi"], "audio": [torch.randn(1600) * 0.1]})
    assert torch.isfinite(built.loss(built.trainable, encoded, 0, 0))
    assert built.codec_kind == "dac"
    codes = built.encode_clip(torch.randn(1600) * 0.1)
    assert codes.shape == (2, 200) and decode_codes(built.codec, "dac", codes).size == 1600


def test_a_mimi_codec_trains_and_round_trips(tmp_path):
    """model.codec: mimi (Kyutai's codec, 12.5 frames/s, split RVQ): tokens for the LM and audio back."""
    from transformers import LlamaConfig, LlamaForCausalLM, MimiConfig, MimiModel

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path / "lm")
    MimiModel(
        MimiConfig(
            hidden_size=64,
            num_filters=4,
            codebook_size=32,
            codebook_dim=16,
            vector_quantization_hidden_dimension=16,
            num_quantizers=4,
            num_semantic_quantizers=1,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=64,
            sliding_window=16,
            upsample_groups=64,
        )
    ).save_pretrained(tmp_path / "mimi")
    built = build_model(
        TtsLmModelSpec(
            family="tts_lm",
            pretrained=str(tmp_path / "lm"),
            codec="mimi",
            codec_pretrained=str(tmp_path / "mimi"),
            num_codebooks=2,
        ),
        tmp_path,
        "cpu",
    )
    assert built.layout["num_codebooks"] == 2 and built.sample_rate == 24000
    assert built.trainable.get_input_embeddings().num_embeddings == 300 + 2 * 32 + 3
    wave = torch.randn(24000) * 0.1  # one second: 12.5 frames, rounded up
    encoded = built.encode_batch({"index": [0], "texts": ["hi"], "audio": [wave]})
    assert torch.isfinite(built.loss(built.trainable, encoded, 0, 0))
    assert built.codec_kind == "mimi"
    codes = built.encode_clip(wave)
    assert codes.shape == (2, 13) and decode_codes(built.codec, "mimi", codes).size >= 24000


def test_missing_codec_and_mismatched_layout_are_clear_errors(cache_dir, tmp_path):
    folder = ensure_builtin_model("builtin:tiny-tts-lm", cache_dir)
    with pytest.raises(FamilyError, match="cannot load it as EncodecModel"):
        build_model(TtsLmModelSpec(family="tts_lm", codec_pretrained=str(tmp_path)), cache_dir, "cpu")
    with pytest.raises(FamilyError, match="num_codebooks 2 != model.num_codebooks 3"):
        build_model(TtsLmModelSpec(family="tts_lm", pretrained=str(folder), num_codebooks=3), cache_dir, "cpu")
