"""GPT-SoVITS `.list` and F5-TTS csv speech datasets: parsed offline into records (speaker kept), and every
malformed line refused with its file and line number."""

from __future__ import annotations

from pathlib import Path

import pytest

from dstune.data.audio_index import index_audio
from dstune.data.index import DataError
from dstune.spec.models import DataSpec

soundfile = pytest.importorskip("soundfile")


def _clips(root: Path, names: list[str]) -> None:
    from dstune.data.synthetic import render_tones

    (root / "wavs").mkdir(parents=True, exist_ok=True)
    for number, name in enumerate(names):
        soundfile.write(root / "wavs" / name, render_tones(str(12 + number)), 16000)


def test_gptsovits_list_keeps_speakers_and_accepts_absolute_paths(tmp_path):
    _clips(tmp_path, ["a.wav", "b.wav"])
    (tmp_path / "metadata.list").write_text(
        f"wavs/a.wav|ann|en|Hello there.\n\n{tmp_path / 'wavs' / 'b.wav'}|bob|ZH|ni hao | with a bar\n"
    )
    records = index_audio(DataSpec(path=str(tmp_path), format="auto")).records
    assert [(r.caption, r.speaker) for r in records] == [("Hello there.", "ann"), ("ni hao | with a bar", "bob")]
    same = index_audio(DataSpec(path=str(tmp_path / "metadata.list"))).records
    assert [r.audio_path for r in same] == [r.audio_path for r in records]


def test_f5_csv_is_told_from_ljspeech_by_its_header(tmp_path):
    _clips(tmp_path, ["a.wav"])
    (tmp_path / "metadata.csv").write_text("audio_file|text\nwavs/a.wav|Bonjour.\n")
    records = index_audio(DataSpec(path=str(tmp_path))).records
    assert [(r.sample_id, r.caption) for r in records] == [("wavs/a.wav", "Bonjour.")]
    with pytest.raises(DataError, match="format 'ljspeech' needs"):
        index_audio(DataSpec(path=str(tmp_path), format="ljspeech"))


@pytest.mark.parametrize(
    "file, text, line, message",
    [
        (
            "metadata.list",
            "wavs/a.wav|ann|en|ok\nwavs/a.wav|ann|en\n",
            2,
            "expected `audio path|speaker|language|text`",
        ),
        ("metadata.list", "wavs/a.wav|ann|en|   \n", 1, "expected `audio path|speaker|language|text`"),
        ("metadata.list", "|ann|en|hello\n", 1, "the audio path field is empty"),
        ("metadata.list", "../outside.wav|ann|en|hello\n", 1, "climbs out of the list's folder"),
        ("metadata.csv", "audio_file|text\nwavs/a.wav|fine\n\nwavs/a.wav\n", 4, "expected `audio_file|text`"),
        ("metadata.csv", "audio_file|text\nwavs/missing.wav|hello\n", 2, "does not exist"),
    ],
)
def test_malformed_lines_are_named_by_file_and_line(tmp_path, file, text, line, message):
    _clips(tmp_path, ["a.wav"])
    (tmp_path / file).write_text(text)
    with pytest.raises(DataError) as caught:
        index_audio(DataSpec(path=str(tmp_path)))
    assert f"{tmp_path / file}:{line}: " in str(caught.value) and message in str(caught.value)
