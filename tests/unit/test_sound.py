"""A clip's sound track (dstune.data.sound, the video dataset's `sound_rate`) and builtin:moving-shapes-av: real MP4
files with AAC audio, written and decoded with PyAV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dstune.data.index import index_dataset
from dstune.data.sound import decode_sound, mp4_with_sound, to_stereo
from dstune.data.synthetic import moving_shape, render_moving_shape
from dstune.data.video import VideoCaptionDataset, collate_video
from dstune.spec.models import DataSpec

RATE = 16000


def _peak_hz(signal: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(signal * np.hanning(len(signal))))
    return float(np.argmax(spectrum) * rate / len(signal))


def _two_tone_clip(path, fps=24, frames=24, rate=44100, channels=2):
    """A 1 s clip whose sound is 300 Hz for its first half and 900 Hz for its second (the right channel an octave
    above the left when stereo), grey frames."""
    t = np.arange(int(frames / fps * rate)) / rate
    base = np.where(t < 0.5, 300.0, 900.0)
    phase = 2 * np.pi * np.cumsum(base) / rate
    waveform = np.stack([0.4 * np.sin(phase), 0.4 * np.sin(2 * phase)][:channels])
    images = [np.full((32, 32, 3), 40 + 8 * i, np.uint8) for i in range(frames)]
    path.write_bytes(mp4_with_sound(images, fps, waveform, rate))


def test_to_stereo_is_ltx_trainers_fold_down():
    mono = np.array([[1.0, -2.0]])
    assert np.array_equal(to_stereo(mono), np.array([[1.0, -2.0], [1.0, -2.0]]))
    # 5.1: L R C LFE Ls Rs -> left (L + .707 C + .707 Ls) / 2.414, right (R + .707 C + .707 Rs) / 2.414
    surround = np.array([[1.0], [2.0], [4.0], [100.0], [8.0], [16.0]])
    left, right = (1 + 0.707 * 4 + 0.707 * 8) / 2.414, (2 + 0.707 * 4 + 0.707 * 16) / 2.414
    assert np.allclose(to_stereo(surround)[:, 0], [left, right])
    # 7.1 adds the back pair Lb Rb; the weights sum to 1 (3.121)
    eight = np.array([[1.0], [2.0], [4.0], [100.0], [8.0], [16.0], [32.0], [64.0]])
    left, right = (1 + 0.707 * (4 + 8 + 32)) / 3.121, (2 + 0.707 * (4 + 16 + 64)) / 3.121
    assert np.allclose(to_stereo(eight)[:, 0], [left, right])
    assert np.allclose(to_stereo(np.ones((6, 3))), 1.0, atol=1e-3)  # a level signal keeps its level
    assert np.allclose(to_stereo(np.array([[1.0], [2.0], [3.0], [6.0]]))[:, 0], [3.0, 3.0])  # other: the mean


def test_sound_is_resampled_and_cut_to_the_clips_span(tmp_path):
    clip = tmp_path / "two-tones.mp4"
    _two_tone_clip(clip)
    whole = decode_sound(str(clip), RATE, 0.0, 1.0)
    assert whole.shape == (2, RATE) and whole.dtype == np.float32
    second_half = decode_sound(str(clip), RATE, 0.5, 0.25)
    assert second_half.shape == (2, RATE // 4)
    assert abs(_peak_hz(whole[0, 1000:7000], RATE) - 300) < 10  # the first half, away from the edges
    assert abs(_peak_hz(second_half[0, 500:], RATE) - 900) < 10
    assert abs(_peak_hz(second_half[1, 500:], RATE) - 1800) < 10  # the right channel stays the right one
    past_the_end = decode_sound(str(clip), RATE, 0.75, 0.5)  # padded with silence, as ltx-trainer pads
    assert past_the_end.shape == (2, RATE // 2)
    assert np.abs(past_the_end[:, RATE // 4 + 400 :]).max() < 1e-3 < np.abs(past_the_end[:, : RATE // 8]).max()
    mono = tmp_path / "mono.mp4"
    _two_tone_clip(mono, channels=1)
    both = decode_sound(str(mono), RATE, 0.0, 1.0)
    assert np.array_equal(both[0], both[1])


def test_dataset_reads_each_chunks_sound_and_none_without_a_track(tmp_path):
    _two_tone_clip(tmp_path / "a.mp4")  # 24 frames at 24 fps: sliding chunks of 9 start at 0 s and 0.375 s
    (tmp_path / "a.txt").write_text("two tones")
    import av

    with av.open(str(tmp_path / "b.mp4"), "w") as container:  # a silent clip: no audio stream at all
        stream = container.add_stream("libx264", rate=24)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for i in range(12):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), i, np.uint8), format="rgb24")))
        container.mux(stream.encode())
    (tmp_path / "b.txt").write_text("silence")
    data = DataSpec(path=str(tmp_path), resolution=32, video={"frames": 9, "sampling": "sliding", "fps": 24})
    from dstune.data.clips import index_clips

    records = index_clips(data).records
    assert [r.sample_id for r in records] == ["a.mp4#0", "a.mp4#1", "b.mp4#0"]
    dataset = VideoCaptionDataset(data, records, 0, sound_rate=RATE)
    samples = [dataset[i] for i in range(3)]
    samples_per_clip = 9 * RATE // 24
    assert samples[0]["sound"].shape == (2, samples_per_clip) and samples[0]["has_sound"]
    silent = samples[2]  # b.mp4's first 9 frames: silence of their length, and no sound to train on
    assert silent["sound"].shape == (2, samples_per_clip) and not silent["sound"].any() and not silent["has_sound"]
    expected = torch.from_numpy(decode_sound(str(tmp_path / "a.mp4"), RATE, 9 / 24, 9 / 24))
    assert torch.equal(samples[1]["sound"], expected)  # chunk 1: frames 9..17, i.e. 0.375 s .. 0.75 s
    batch = collate_video(samples)
    assert batch["sound"].shape == (3, 2, samples_per_clip)
    assert batch["has_sound"].tolist() == [True, True, False] and not batch["sound"][2].any()
    other_rate = dict(samples[0], sound=torch.zeros(2, samples_per_clip + 1))  # a clip of another frame rate
    with pytest.raises(ValueError, match="sound tracks of different lengths .* Set data.video.fps"):
        collate_video([samples[0], other_rate])
    assert "sound" not in VideoCaptionDataset(data, records, 0)[0]  # a model without sound reads none
    uniform = DataSpec(path=str(tmp_path), resolution=32, video={"frames": 9, "sampling": "uniform"})
    with pytest.raises(ValueError, match="sampling uniform spreads a clip's frames .* use head or sliding"):
        VideoCaptionDataset(uniform, records, 0, sound_rate=RATE)


def test_moving_shapes_av_files_are_the_same_bytes_in_every_process():
    """Every rank and run makes the same clips (libx264 did not: other bytes from process to process)."""
    import subprocess
    import sys

    code = (
        "import hashlib; from dstune.data.synthetic import moving_shape_av_mp4 as mp4; "
        "print(hashlib.sha256(b''.join(mp4(i, 32, 5) for i in range(48))).hexdigest())"
    )
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in "ab"]
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout.strip()) == 64


def test_moving_shapes_av_sound_follows_the_shape_and_frames_are_moving_shapes():
    data = DataSpec(path="builtin:moving-shapes-av", resolution=32, video={"frames": 9})
    index = index_dataset(data, video=True)
    assert len(index.records) == 144 and index.records[0].caption == moving_shape(0).caption
    dataset = VideoCaptionDataset(data, index.records, 0, sound_rate=RATE)
    left, right, up = (dataset[i] for i in (0, 18, 36))  # the same red circle moving left, right, up
    assert (moving_shape(0).direction, moving_shape(18).direction, moving_shape(36).direction) == (
        "left",
        "right",
        "up",
    )
    quarter = left["sound"].shape[1] // 4
    pitch = lambda sample, part: _peak_hz(sample["sound"][0, part * quarter : (part + 1) * quarter].numpy(), RATE)  # noqa: E731
    assert pitch(left, 0) > pitch(left, 3) * 1.3  # moving left: the pitch falls
    assert pitch(right, 3) > pitch(right, 0) * 1.3  # moving right or up: it rises
    assert pitch(up, 3) > pitch(up, 0) * 1.3
    frames, _ = render_moving_shape(18, 32, 9)
    drawn = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in frames], dim=1) / 127.5 - 1
    assert (right["pixel_values"] - drawn).abs().mean() < 0.05  # the video codec keeps the drawing
    again = VideoCaptionDataset(data, index.records, 0, sound_rate=RATE)[18]
    assert torch.equal(again["sound"], right["sound"]) and torch.equal(again["pixel_values"], right["pixel_values"])


def test_a_clip_whose_sound_cannot_be_decoded_is_named_before_step_1(tmp_path):
    """find_bad_clips, given the model's sound rate, decodes each file's sound track too: a file whose AAC packets
    are garbage is named (PyAV's codec error, which is neither an OSError nor a ValueError, made one)."""
    import av

    from dstune.data.clips import index_clips
    from dstune.data.video import find_bad_clips

    _two_tone_clip(tmp_path / "good.mp4")
    _two_tone_clip(tmp_path / "broken.mp4")
    data = bytearray((tmp_path / "broken.mp4").read_bytes())
    with av.open(str(tmp_path / "broken.mp4")) as container:
        packets = [(p.pos, p.size) for p in container.demux(audio=0) if p.size]
    for position, size in packets[1:]:
        data[position : position + size] = b"\xff" * size
    (tmp_path / "broken.mp4").write_bytes(bytes(data))
    spec = DataSpec(path=str(tmp_path), resolution=32, video={"frames": 9, "fps": 24})
    records = index_clips(spec).records
    assert find_bad_clips(records, spec) == []  # the frames decode: without sound nothing is wrong
    bad = find_bad_clips(records, spec, sound_rate=RATE)
    assert [record.sample_id for record, _ in bad] == ["broken.mp4"]
    assert "its sound track: its audio stream cannot be decoded" in bad[0][1] and "broken.mp4" in bad[0][1]


# ------------------------------------------------------------------------------ what validate says of sound


def _silent_clip(path, frames=12):
    import av

    with av.open(str(path), "w") as container:  # no audio stream at all
        stream = container.add_stream("libx264", rate=24)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), i, np.uint8), format="rgb24")))
        container.mux(stream.encode())


def _validate(capsys, tmp_path, model: str, data_path: str, *sets: str) -> tuple[int, str]:
    import yaml

    from dstune.cli import main

    spec = {
        "model": {"family": "wan", "pretrained": f"builtin:{model}"},
        "data": {"path": data_path, "resolution": 32, "video": {"frames": 5}},
        "train": {"micro_batch_size": 1, "max_steps": 2},
    }
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["validate", str(path), *[word for s in sets for word in ("--set", s)]])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture
def mixed_folder(tmp_path):
    """Two clips with a sound track and one without."""
    folder = tmp_path / "clips"
    folder.mkdir()
    for name in ("a", "b"):
        _two_tone_clip(folder / f"{name}.mp4")
        (folder / f"{name}.txt").write_text("two tones")
    _silent_clip(folder / "quiet.mp4")
    (folder / "quiet.txt").write_text("no sound")
    return folder


def test_validate_counts_the_clips_with_and_without_sound_for_a_model_that_trains_it(capsys, tmp_path, mixed_folder):
    code, text = _validate(capsys, tmp_path, "tiny-ltx2", str(mixed_folder))
    assert code == 0, text
    assert (
        "sound                2 of 3 clips have a sound track and train video and sound; 1 without train their "
        "video alone" in text
    ), text
    code, text = _validate(capsys, tmp_path, "tiny-ltx2", "builtin:moving-shapes-av")
    assert code == 0 and "all 144 clips have a sound track: each trains its video and its sound" in text, text
    code, text = _validate(capsys, tmp_path, "tiny-wan", str(mixed_folder))  # trains no sound: not a word of it
    assert code == 0 and "sound track" not in text, text


def test_a_model_that_trains_sound_on_clips_without_any_says_so(capsys, tmp_path):
    code, text = _validate(capsys, tmp_path, "tiny-ltx2", "builtin:moving-shapes")
    assert code == 0, text
    assert (
        "none of the 144 clips has a sound track: builtin:tiny-ltx2 trains each clip's sound with its frames, so "
        "this run trains the video alone" in text
    ), text
    assert "data.video.require_sound: true to make this an error" in text


def test_require_sound_refuses_each_file_without_a_track_and_a_model_without_sound(capsys, tmp_path, mixed_folder):
    code, text = _validate(capsys, tmp_path, "tiny-ltx2", str(mixed_folder), "data.video.require_sound=true")
    assert code == 1, text
    assert "data.video.require_sound: 1 file(s) have no sound track" in text and str(mixed_folder / "quiet.mp4") in text
    assert str(mixed_folder / "a.mp4") not in text
    code, text = _validate(capsys, tmp_path, "tiny-ltx2", "builtin:moving-shapes-av", "data.video.require_sound=true")
    assert code == 0, text
    code, text = _validate(capsys, tmp_path, "tiny-wan", "builtin:moving-shapes-av", "data.video.require_sound=true")
    assert code == 1 and "builtin:tiny-wan trains no sound" in text, text


def test_a_sets_own_require_sound_refuses_its_files_without_a_track_and_no_other_sets(capsys, tmp_path, mixed_folder):
    """data.sets.N.video.require_sound asks it of that set's clips alone: its silent file is named under its own key,
    and the other set's clips without sound train their video as before."""
    import yaml

    from dstune.cli import main

    def validate(require_in: int) -> tuple[int, str]:
        sets = [
            {"path": str(mixed_folder), "name": "mine", "video": {"frames": 5, "fps": 24}},
            {"path": "builtin:moving-shapes", "name": "shapes", "video": {"frames": 5, "fps": 24}},
        ]
        sets[require_in]["video"]["require_sound"] = True
        spec = {
            "model": {"family": "video", "pretrained": "builtin:tiny-ltx2"},
            "data": {"resolution": 32, "video": {"frames": 5, "fps": 24}, "sets": sets},
            "train": {"micro_batch_size": 1, "max_steps": 2},
        }
        path = tmp_path / f"sets-{require_in}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        code = main(["validate", str(path)])
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    code, text = validate(0)
    assert code == 1, text
    assert "data.sets.0.video.require_sound: 1 file(s) have no sound track" in text, text
    assert str(mixed_folder / "quiet.mp4") in text and "builtin:moving-shapes\n" not in text
    code, text = validate(1)
    assert code == 1 and "data.sets.1.video.require_sound: 1 file(s) have no sound track" in text, text
    assert str(mixed_folder / "quiet.mp4") not in text
