"""Video datasets (dstune.data.video) on real MP4 files written with PyAV: indexing (folder and metadata.jsonl),
frame choice (head / uniform, fps resampling), stills as one-frame clips, and the one message naming every video
that cannot be decoded or is too short."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dstune.data.index import index_dataset, list_samples
from dstune.data.video import VideoCaptionDataset, find_bad_clips, frame_positions
from dstune.spec.models import DataSpec


def write_mp4(path: Path, count: int, fps: int = 24, side: int = 32) -> Path:
    """A real MP4 (H.264) whose frame n is a flat grey of level 10 n: the decoded frame tells which it was."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        stream.options = {"qp": "0"}  # lossless enough that a frame's level survives
        for number in range(count):
            pixels = np.full((side, side, 3), 10 * number, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def _levels(clip) -> list[int]:  # which source frame each clip frame is, from its grey level
    return [round(((frame.mean().item() + 1) * 127.5) / 10) for frame in clip.unbind(dim=1)]


@pytest.fixture()
def folder(tmp_path) -> Path:
    root = tmp_path / "videos"
    root.mkdir()
    write_mp4(root / "a.mp4", 12)
    (root / "a.txt").write_text("a grey fade")
    return root


def test_videos_are_indexed_for_video_families_only(folder):
    data = DataSpec(path=str(folder))
    assert [r.sample_id for r in list_samples(data, video=True)] == ["a.mp4"]
    assert list_samples(data, video=True)[0].caption == "a grey fade"
    assert index_dataset(data, read_captions=False, video=True).num_samples == 1  # validate counts clips
    with pytest.raises(ValueError, match="no usable samples"):
        list_samples(data)  # an image family sees no video


def test_head_uniform_and_fps_choose_the_frames(folder):
    for video, expected in (
        ({"frames": 5}, [0, 1, 2, 3, 4]),
        ({"frames": 5, "sampling": "uniform"}, [0, 3, 6, 8, 11]),
        ({"frames": 5, "fps": 12}, [0, 2, 4, 6, 8]),
    ):
        data = DataSpec(path=str(folder), video=video)
        clip = VideoCaptionDataset(data, list_samples(data, video=True), 0)[0]["pixel_values"]
        assert clip.shape == (3, 5, 32, 32) and _levels(clip) == expected, video
    assert frame_positions(30, 30.0, 5, "uniform", 10) == [0, 6, 15, 21, 27]


def test_stills_are_one_frame_clips_and_jsonl_lists_videos(folder):
    from PIL import Image

    Image.new("RGB", (40, 32), (200, 10, 10)).save(folder / "b.png")
    (folder / "metadata.jsonl").write_text(
        json.dumps({"file_name": "a.mp4", "text": "fade"})
        + "\n"
        + json.dumps({"file_name": "b.png", "text": "red"})
        + "\n"
    )
    data = DataSpec(path=str(folder))
    records = list_samples(data, video=True)
    dataset = VideoCaptionDataset(data, records, 0)
    assert [dataset[i]["pixel_values"].shape[1] for i in range(2)] == [5, 1]


def test_bad_and_short_videos_are_named_in_one_message(folder):
    write_mp4(folder / "short.mp4", 3)
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    data = DataSpec(path=str(folder), video={"frames": 5})
    bad = dict((record.sample_id, reason) for record, reason in find_bad_clips(list_samples(data, video=True), data))
    assert sorted(bad) == ["broken.mp4", "short.mp4"]
    assert "it has 3 frames, fewer than data.video.frames 5" in bad["short.mp4"] and str(folder) in bad["short.mp4"]
    assert "cannot use video" in bad["broken.mp4"]
    fps = DataSpec(path=str(folder), video={"frames": 5, "fps": 8})  # 12 frames at 24 fps: 4 at 8 fps
    reasons = dict((r.sample_id, why) for r, why in find_bad_clips(list_samples(fps, video=True), fps))
    assert "it has 4 frames at 8 fps (12 at the file's 24 fps)" in reasons["a.mp4"]


def test_the_spec_leaves_the_frame_rule_to_the_models_card():
    """Which frame counts a VAE takes is the model's fact (4k+1, 8k+1, 17k+5: tests/unit/test_clip_rule.py names
    them at validate); the data section alone accepts any count of at least one frame."""
    assert DataSpec(video={"frames": 6}).video.frame_counts == (6,)
    with pytest.raises(ValueError):
        DataSpec(video={"frames": 0})


def test_video_data_belongs_to_video_families():
    from dstune.spec.models import Spec

    train = {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": 1}
    with pytest.raises(ValueError, match="builtin:moving-shapes and data.video are for the video family"):
        Spec.model_validate({"model": {"family": "sd"}, "data": {"path": "builtin:moving-shapes"}, "train": train})
    with pytest.raises(ValueError, match="data.video are for the video family"):
        Spec.model_validate({"model": {"family": "flow"}, "data": {"video": {"frames": 9}}, "train": train})
    with pytest.raises(ValueError, match="random_flip are not offered for video"):
        Spec.model_validate({"model": {"family": "video"}, "data": {"random_flip": True}, "train": train})
    spec = Spec.model_validate(
        {"model": {"family": "video"}, "data": {"path": "builtin:moving-shapes"}, "train": train}
    )
    assert spec.data.video.frames == 5 and spec.model.pretrained == "builtin:tiny-wan"
    # a spec written before the video core's rename still loads: `wan` is the video family's alias
    spec = Spec.model_validate({"model": {"family": "wan"}, "data": {"path": "builtin:moving-shapes"}, "train": train})
    assert spec.model.family == "video" and spec.data.video.frames == 5


def _one_process_run():
    from dstune.distributed import Run
    from dstune.world import World

    world = World(world_size=1, num_nodes=1, ranks_per_node=(1,), hosts=("localhost",), source="test")
    return Run(rank=0, local_rank=0, world=world, device="cpu", accelerator="cpu", node_rank=0, launched=False)


def _startup_records(folder: Path, micro_batch_size: int = 1, **video):
    from dstune.spec.models import Spec
    from dstune.startup import checked_records

    spec = Spec.model_validate(
        {
            "model": {"family": "video"},
            "data": {"path": str(folder), "video": video},
            "train": {"micro_batch_size": micro_batch_size, "gradient_accumulation_steps": 1, "max_steps": 1},
        }
    )
    return checked_records(_one_process_run(), spec, "video")


def test_startup_stops_before_step_1_naming_every_unusable_video(folder, capsys):
    write_mp4(folder / "short.mp4", 3)
    (folder / "broken.mp4").write_bytes(b"not a video at all")
    with pytest.raises(SystemExit) as stopped:
        _startup_records(folder, frames=5)
    message = capsys.readouterr().err
    assert stopped.value.code == 1 and message.startswith("data.path: 2 unusable video(s):")
    assert f"cannot use video {folder / 'broken.mp4'}" in message
    assert f"cannot use video {folder / 'short.mp4'} (sample short.mp4): it has 3 frames" in message
    assert "a.mp4" not in message  # 12 frames: usable


def test_startup_refuses_stills_beside_videos_in_one_micro_batch(folder, capsys):
    from PIL import Image

    Image.new("RGB", (32, 32), (0, 0, 255)).save(folder / "still.png")
    assert [r.sample_id for r in _startup_records(folder)] == ["a.mp4", "still.png"]  # micro batch 1: fine
    with pytest.raises(SystemExit):
        _startup_records(folder, micro_batch_size=2)
    assert "mixes still images (one-frame clips) with 5-frame videos" in capsys.readouterr().err


def test_frames_are_decoded_only_as_far_as_needed_and_counted_either_way(folder):
    from dstune.data.video import clip_tensor, decode_frames, frame_count

    path = str(folder / "a.mp4")
    assert frame_count(path) == frame_count(path, trust_header=False) == (12, 24.0)
    assert _levels(clip_tensor(decode_frames(path, [0, 2, 2, 5]), 32)) == [0, 2, 2, 5]  # fps up-sampling repeats
    with pytest.raises(ValueError, match="only 12 frames could be decoded, frame 20 is needed"):
        decode_frames(path, [0, 20])


def test_a_model_that_trains_on_sound_needs_one_frame_rate_per_micro_batch(folder, capsys):
    """Sound is frames / fps seconds of a clip's track: files at 24 and 30 fps would stack tracks of different
    lengths in one micro batch, so a model that trains on sound stops before step 1 and names data.video.fps; one
    clip per micro batch, a set data.video.fps, or a model without sound train as before."""
    from dstune.spec.models import Spec
    from dstune.startup import checked_records

    write_mp4(folder / "b.mp4", 12, fps=30)
    (folder / "b.txt").write_text("a faster grey fade")

    def records(micro: int, sound_rate=16000, **video):
        spec = Spec.model_validate(
            {
                "model": {"family": "video"},
                "data": {"path": str(folder), "video": video},
                "train": {"micro_batch_size": micro, "gradient_accumulation_steps": 1, "max_steps": 1},
            }
        )
        return checked_records(_one_process_run(), spec, "video", sound_rate)

    with pytest.raises(SystemExit) as stopped:
        records(2)
    message = capsys.readouterr().err
    assert stopped.value.code == 1 and "2 frame rates (24, 30 fps)" in message and "data.video.fps" in message
    assert len(records(1)) == len(records(2, fps=24)) == len(records(2, sound_rate=None)) == 2
