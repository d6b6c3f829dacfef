"""A dataset in a language the model's tokenizer does not cover is named by `dstune validate` (exit 1: the samples
over data.max_unknown_tokens, each with its share of unknown tokens and the characters, the limit and the fixes), for
every speech model dstune trains, on its tiny built-in (byte-level BPE: CSM, VibeVoice, Orpheus; UTF-8 bytes: Dia, the
codec-token LM without a tokenizer; a vocabulary with <unk>: Pocket TTS; SentencePiece characters: SpeechT5); a
dataset in a covered language passes. dstune.families.text_coverage's rules per tokenizer kind, and the ways to
accept or extend."""

from __future__ import annotations

import re

import pytest

from dstune.builtin import ensure_builtin_model
from dstune.families.text_coverage import coverage, text_tokenizer
from dstune.models.speecht5.card import SPEECHT5_CARD
from dstune.models.tts_lm.card import TTS_LM_CARD
from loaded_models import CACHE_DIR
from speaker_data import validate_output

soundfile = pytest.importorskip("soundfile")

ENGLISH = (
    ("en", "Printing, in the only sense with which we are at present concerned."),
    ("en", "The quick brown fox jumps over 13 lazy dogs!"),
)
GEORGIAN = (("ka", "გამარჯობა, მსოფლიო."), ("ka", "დილა მშვიდობისა."))
MODELS = (  # built-in, family: every speech model's unit
    ("tiny-csm", "tts_codebooks"),
    ("tiny-dia", "tts_codebooks"),
    ("tiny-vibevoice", "tts_codebooks"),
    ("tiny-pocket-tts", "tts_codebooks"),
    ("tiny-speecht5", "speecht5"),
    ("tiny-tts-lm", "tts_lm"),
    ("tiny-orpheus", "tts_lm"),
)


def language_list(root, clips):
    """root/metadata.list (GPT-SoVITS: path|speaker|language|text) over one-second silent clips; returns root."""
    import numpy as np

    (root / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for number, (language, text) in enumerate(clips):
        soundfile.write(str(root / "clips" / f"{language}{number}.wav"), np.zeros(16000, dtype="float32"), 16000)
        rows.append(f"clips/{language}{number}.wav|ann|{language}|{text}")
    (root / "metadata.list").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return root


@pytest.mark.parametrize("builtin,family", MODELS, ids=[m[0] for m in MODELS])
def test_validate_names_the_samples_of_a_language_the_tokenizer_lacks(builtin, family, tmp_path, capsys):
    ensure_builtin_model(builtin, CACHE_DIR)  # validate reads a built-in's tokenizer where it is built
    model = {"family": family, "pretrained": f"builtin:{builtin}"}
    both = language_list(tmp_path / "both", ENGLISH + GEORGIAN)
    code, out = validate_output(capsys, tmp_path, model, {"path": str(both), "format": "gptsovits"})
    assert code == 1, out
    assert "2 of 4 samples have more than 10% unknown tokens" in out, out
    named = re.findall(r"clips/(\w+)\.wav: (\d+)% of \d+ tokens unknown", out)
    assert sorted(name for name, _ in named) == ["ka2", "ka3"], out  # the Georgian clips, not the English ones
    assert all(int(share) >= 50 for _, share in named), named
    assert "data.max_unknown_tokens" in out and "'გ' U+10D2" in out, out

    english = language_list(tmp_path / "english", ENGLISH)
    code, out = validate_output(capsys, tmp_path, model, {"path": str(english), "format": "gptsovits"})
    assert code == 0, out
    assert "unknown tokens" not in out, out


def test_a_raised_limit_accepts_them_with_a_warning(tmp_path, capsys):
    ensure_builtin_model("tiny-csm", CACHE_DIR)
    both = language_list(tmp_path / "both", ENGLISH + GEORGIAN)
    data = {"path": str(both), "format": "gptsovits", "max_unknown_tokens": 1.0}
    code, out = validate_output(capsys, tmp_path, {"family": "tts_codebooks", "pretrained": "builtin:tiny-csm"}, data)
    assert code == 0, out
    assert "2 of 4 samples have unknown tokens, each under the 100% limit" in out, out


def test_added_tokens_cover_a_new_language_for_the_codec_token_lm(tmp_path, capsys):
    """model.added_tokens (tts_lm's tokenizer extension) makes the characters known: validate passes, and the plan
    counts their embedding rows."""
    ensure_builtin_model("tiny-orpheus", CACHE_DIR)
    both = language_list(tmp_path / "both", ENGLISH + GEORGIAN)
    characters = sorted({c for _, text in GEORGIAN for c in text if c.isalpha()})
    model = {"family": "tts_lm", "pretrained": "builtin:tiny-orpheus", "added_tokens": characters}
    code, out = validate_output(capsys, tmp_path, model, {"path": str(both), "format": "gptsovits"})
    assert code == 0, out
    assert "unknown tokens" not in out, out


def test_added_tokens_rows_are_in_the_plan():
    """Each added token is a row of the embeddings (tiny-orpheus ties its head: one row of its width)."""
    from dstune.spec.models import Spec

    def params(added):
        spec = Spec.model_validate(
            {
                "model": {"family": "tts_lm", "pretrained": "builtin:tiny-orpheus", "added_tokens": added},
                "data": {"path": "builtin:tones"},
                "train": {"micro_batch_size": 1, "max_steps": 2},
            }
        )
        return TTS_LM_CARD.count(spec, 8).trainable_params

    assert params(["ა", "ბ", "გ"]) - params(None) == 3 * 16  # tiny-orpheus: hidden size 16, tied embeddings


def test_sentencepiece_counts_each_lost_character(tmp_path):
    """SpeechT5's SentencePiece folds a run of characters it lacks into one <unk>: each counts as one unknown token
    (a sample of Georgian words is mostly unknown, not one token in three)."""
    folder = ensure_builtin_model("tiny-speecht5", CACHE_DIR)
    report = coverage(text_tokenizer(SPEECHT5_CARD.text_tokenizer_kind(folder), folder), [("ka", GEORGIAN[0][1])])
    (sample,) = report.samples
    assert report.fate == "lost"
    assert sample.unknown == sum(c.isalpha() for c in GEORGIAN[0][1]), sample
    assert sample.share >= 0.8, sample  # the rest: the word separators and the punctuation


def test_the_limit_is_refused_for_an_image_family(tmp_path):
    from dstune.spec.load import SpecError, load_spec

    path = tmp_path / "spec.yaml"
    path.write_text(
        "model: {family: sd}\ndata: {max_unknown_tokens: 0.5}\ntrain: {micro_batch_size: 1, max_steps: 2}\n"
    )
    with pytest.raises(SpecError, match="data.max_unknown_tokens are for the speech families"):
        load_spec(path)


def test_byte_fallback_pieces_are_unknown_and_nothing_is_lost(tmp_path):
    """A SentencePiece-style vocabulary with byte fallback (as converted to tokenizer.json) never emits <unk>: a
    character it lacks is written as its UTF-8 bytes (<0xC4> <0x9F>), each an unknown token, and the report says
    nothing is lost."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab.update({c: len(vocab) + n for n, c in enumerate("\u2581abcdefghijklmnopqrstuvwxyz")})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    report = coverage(text_tokenizer("files", tmp_path), [("tr", "dağ"), ("en", "mountain")])
    turkish, english = report.samples
    assert report.fate == "bytes"
    assert (turkish.unknown, turkish.characters) == (2, "ğ"), turkish  # its two bytes
    assert english.unknown == 0
