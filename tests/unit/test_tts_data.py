"""Speech data (no process group): LJSpeech / jsonl / builtin:tones indexing, length and bad-file rules with counts,
resampling, duration groups in the plan, and the spec rules that keep speech data and image families apart."""

from __future__ import annotations

import numpy as np
import pytest

from dstune.data.audio_index import duration_groups, index_audio
from dstune.data.synthetic import TONES_NUM_SAMPLES, render_tones, tones_duration, tones_text
from dstune.data.index import DataError
from dstune.spec.models import DataSpec

soundfile = pytest.importorskip("soundfile")


def _write(path, seconds: float, rate: int = 16000) -> None:
    t = np.arange(int(seconds * rate)) / rate
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(path, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate)


@pytest.fixture
def ljspeech(tmp_path):
    for name, seconds in (("a", 0.5), ("b", 1.0), ("short", 0.05), ("long", 3.0)):
        _write(tmp_path / "wavs" / f"{name}.wav", seconds)
    (tmp_path / "metadata.csv").write_text("a|Hello, Dr. X|Hello, doctor X\nb|two|\nshort|s|s\nlong|l|l\n")
    return tmp_path


def test_ljspeech_uses_normalized_text_and_skips_by_length_with_counts(ljspeech):
    result = index_audio(DataSpec(path=str(ljspeech), format="ljspeech", min_clip_seconds=0.1, max_clip_seconds=2.0))
    assert [(r.sample_id, r.caption) for r in result.records] == [
        ("wavs/a.wav", "Hello, doctor X"),
        ("wavs/b.wav", "two"),
    ]
    assert result.records[0].duration_seconds == pytest.approx(0.5)
    assert any("1 of 4 clips are shorter than 0.1 s" in w and "wavs/short.wav" in w for w in result.warnings)
    assert any("1 of 4 clips are longer than 2 s" in w and "wavs/long.wav" in w for w in result.warnings)


def test_jsonl_with_speakers_and_auto_format(tmp_path):
    _write(tmp_path / "x" / "1.wav", 0.4)
    _write(tmp_path / "x" / "2.flac", 0.6)
    (tmp_path / "metadata.jsonl").write_text(
        '{"audio": "x/1.wav", "text": "one", "speaker": "ann"}\n{"audio": "x/2.flac", "text": "two"}\n'
    )
    records = index_audio(DataSpec(path=str(tmp_path))).records
    assert [(r.caption, r.speaker) for r in records] == [("one", "ann"), ("two", "")]


def test_unreadable_audio_is_an_error_naming_the_line_or_skipped_on_request(ljspeech):
    (ljspeech / "wavs" / "b.wav").write_bytes(b"not audio")
    with pytest.raises(DataError) as err:
        index_audio(DataSpec(path=str(ljspeech), format="ljspeech"))
    assert "metadata.csv:2" in str(err.value) and "skip_bad_files" in str(err.value)
    result = index_audio(DataSpec(path=str(ljspeech), format="ljspeech", skip_bad_files=True))
    assert "wavs/b.wav" not in [r.sample_id for r in result.records]
    assert any("1 clip(s) missing or unreadable" in w for w in result.warnings)


def test_everything_skipped_is_a_clear_error(ljspeech):
    with pytest.raises(DataError, match="no clips left .* Widen the limits"):
        index_audio(DataSpec(path=str(ljspeech), format="ljspeech", min_clip_seconds=5.0, max_clip_seconds=9.0))


def test_tones_are_deterministic_and_pitch_follows_the_digit():
    assert [tones_text(i) for i in range(5)] == [tones_text(i) for i in range(5)]
    assert len(index_audio(DataSpec(path="builtin:tones", max_clip_seconds=10)).records) == TONES_NUM_SAMPLES
    low, high = render_tones("0"), render_tones("9")
    assert len(low) == round(tones_duration("0") * 16000)
    peak = lambda w: np.argmax(np.abs(np.fft.rfft(w)))  # noqa: E731
    assert peak(high) > peak(low)


def test_resample_keeps_length_ratio_and_pitch():
    from dstune.data.audio import resample

    wave = render_tones("5")
    out = resample(wave, 16000, 8000)
    assert len(out) == len(wave) // 2 and out.dtype == np.float32
    frequency = lambda w, rate: np.argmax(np.abs(np.fft.rfft(w))) * rate / len(w)  # noqa: E731
    assert frequency(out, 8000) == pytest.approx(frequency(wave, 16000), abs=15)


def test_duration_groups_cover_every_clip():
    data = DataSpec(path="builtin:tones", max_clip_seconds=10, duration_bucket_seconds=0.25)
    result = index_audio(data)
    groups = duration_groups(result.records, data)
    assert sum(groups.values()) == len(result.records) and len(groups) > 1


def test_validate_plans_audio_with_length_buckets(tmp_path):
    from dstune.validate import load_and_validate as resolve
    from dstune.world import world_from_flags

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: {family: tts_lm}\n"
        "data: {path: 'builtin:tones', max_clip_seconds: 0.6, duration_bucket_seconds: 0.25}\n"
        "train: {global_batch_size: 8, micro_batch_size: 4, max_steps: 3}\n"
    )
    resolved = resolve(str(spec), world=world_from_flags(world_size=2), cross_check=False)
    assert resolved.num_samples == 166
    assert len(resolved.plan.groups) == 3
    assert any("90 of 256 clips are longer than 0.6 s" in w.message for w in resolved.warnings)


@pytest.mark.parametrize(
    "model, data, expected",
    [
        ("{family: tts_lm}", "{path: 'builtin:shapes'}", "trains on speech"),
        ("{family: sd}", "{path: 'builtin:tones'}", "trains on images"),
        ("{family: tts_lm}", "{path: 'builtin:tones', cache: {latents: true}}", "codec_tokens"),
        ("{family: tts_lm}", "{path: 'builtin:tones', min_clip_seconds: 3, max_clip_seconds: 2}", "must be below"),
    ],
)
def test_speech_data_and_image_families_do_not_mix(tmp_path, model, data, expected):
    from dstune.spec.load import SpecError, load_spec

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: {model}\ndata: {data}\ntrain: {{micro_batch_size: 1, max_steps: 1}}\n")
    with pytest.raises(SpecError, match=expected):
        load_spec(str(spec), [])


@pytest.mark.parametrize(
    "model, refused",
    [
        ("{family: tts_lm}", True),  # dstune's layout: text then audio, no place for a voice
        ("{family: tts_lm, pretrained: 'builtin:tiny-orpheus', codec: snac}", False),  # "ann: text" prompts
    ],
)
def test_a_multi_speaker_list_needs_a_layout_that_names_the_voice(tmp_path, model, refused):
    """A GPT-SoVITS .list of two speakers: refused (data.path, why, the fix) where the token layout has no place for
    a speaker, so the run would not silently train one blended voice; taken where the prompt names the speaker."""
    from dstune.spec.load import SpecError
    from dstune.validate import load_and_validate as resolve
    from dstune.world import world_from_flags

    for name in ("a", "b", "c"):
        _write(tmp_path / "wavs" / f"{name}.wav", 0.3)
    (tmp_path / "metadata.list").write_text("wavs/a.wav|ann|en|Hello.\nwavs/b.wav|bob|en|Hi.\nwavs/c.wav|ann|en|Yes.\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model: {model}\ndata: {{path: '{tmp_path / 'metadata.list'}'}}\n"
        "train: {micro_batch_size: 1, max_steps: 1}\n"
    )
    if not refused:
        assert resolve(str(spec), world=world_from_flags(world_size=1), cross_check=False).num_samples == 3
        return
    with pytest.raises(SpecError) as caught:
        resolve(str(spec), world=world_from_flags(world_size=1), cross_check=False)
    message = str(caught.value)
    assert "data.path" in message and "2 speakers (ann, bob)" in message and "same voice" in message
    assert "one speaker's clips per run" in message and "model.token_layout: orpheus" in message
    assert "data.speakers: blend" in message
    blended = resolve(str(spec), ["data.speakers=blend"], world=world_from_flags(world_size=1), cross_check=False)
    assert blended.voices.blended == ("ann", "bob")  # taken as one voice when asked to
    (tmp_path / "metadata.list").write_text("wavs/a.wav|ann|en|Hello.\nwavs/c.wav|ann|en|Yes.\n")
    assert resolve(str(spec), world=world_from_flags(world_size=1), cross_check=False).num_samples == 2
