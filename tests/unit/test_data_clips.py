"""Clips after frame extraction (dstune.data.clips) on real MP4 files written with PyAV: sliding chunks after fps
resampling, frame-count buckets combined with aspect buckets, one (frames, width, height) group per global batch,
the batch check on grouped clip loaders, the cache keys of chunks, and what `dstune validate` prints and plans."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from dstune.cache.entries import plan_entries
from dstune.batch_check import Expected, RankReport, bucket_report, expected_from_plan, find_mismatches
from dstune.cli import main
from dstune.data.clips import chunk_starts, clip_counts, frame_positions, index_clips, is_grouped
from dstune.card import ClipRule
from dstune.data.loader import make_loader, size_matches_bucket
from dstune.data.video import VideoCaptionDataset, collate_video
from dstune.plan import key_label, make_plan
from dstune.spec.load import SpecSource
from dstune.spec.models import DataSpec, TrainSpec, VideoSpec
from dstune.world import world_from_flags

STEP = 6  # frame n of a test video is a flat grey of level 6 n: the decoded frame tells which it was
SLIDING = {"frames": [5, 9], "fps": 12, "sampling": "sliding"}
BUCKETS = {"enabled": True, "sizes": [[32, 32], [48, 32], [32, 48]]}
WORLD2 = world_from_flags(world_size=2)


def write_mp4(path: Path, count: int, fps: int = 24, width: int = 32, height: int = 32) -> Path:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"qp": "0"}
        for number in range(count):
            pixels = np.full((height, width, 3), STEP * number, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    path.with_suffix(".txt").write_text(f"grey {path.stem}")
    return path


def _levels(clip: torch.Tensor) -> list[int]:
    return [round(((frame.mean().item() + 1) * 127.5) / STEP) for frame in clip.unbind(dim=1)]


@pytest.fixture()
def folder(tmp_path) -> Path:
    """Four 12-frame squares, two 40-frame squares, three 12-frame 2:1 landscapes at 24 fps, a 2:3 portrait still,
    and a 3-frame video."""
    root = tmp_path / "videos"
    root.mkdir()
    for number in range(4):
        write_mp4(root / f"sq{number}.mp4", 12)
    for number in range(2):
        write_mp4(root / f"long{number}.mp4", 40)
    for number in range(3):
        write_mp4(root / f"wide{number}.mp4", 12, width=64, height=32)
    Image.new("RGB", (32, 48), (200, 10, 10)).save(root / "still.png")
    (root / "still.txt").write_text("a red still")
    write_mp4(root / "short.mp4", 3)
    return root


def test_sliding_chunks_take_consecutive_frames_after_fps_resampling(tmp_path):
    assert chunk_starts(20, 5, "sliding", 3) == [0, 3, 6, 9, 12, 15]  # 15 + 5 = 20: the last whole chunk
    assert chunk_starts(20, 9, "sliding") == [0, 9]  # stride omitted: the frame count, no overlap, no gap
    assert chunk_starts(20, 5, "head") == chunk_starts(20, 5, "uniform") == [0]
    assert frame_positions(40, 24.0, 5, "sliding", 12, start=6) == [12, 14, 16, 18, 20]  # 24 -> 12 fps
    assert frame_positions(45, 30.0, 5, "sliding", 16, start=5) == [9, 11, 13, 15, 17]  # 30 -> 16 fps: nearest
    with pytest.raises(
        ValueError, match="it has 20 frames at 12 fps .40 at the file's 24 fps., fewer than frames 18..22"
    ):
        frame_positions(40, 24.0, 5, "sliding", 12, start=18)
    root = tmp_path / "one"
    root.mkdir()
    write_mp4(root / "long.mp4", 40)
    data = DataSpec(path=str(root), video={"frames": 5, "fps": 12, "sampling": "sliding", "stride": 7})
    clips = index_clips(data).records  # 20 frames at 12 fps: chunks at 0, 7, 14
    assert [(c.sample_id, c.start, c.frames) for c in clips] == [
        ("long.mp4#0", 0, 5),
        ("long.mp4#1", 7, 5),
        ("long.mp4#2", 14, 5),
    ]
    dataset = VideoCaptionDataset(data, clips, 0)
    assert [_levels(dataset[i]["pixel_values"]) for i in range(3)] == [
        [0, 2, 4, 6, 8],
        [14, 16, 18, 20, 22],
        [28, 30, 32, 34, 36],
    ]
    assert [dataset[i]["sample_id"] for i in range(3)] == ["long.mp4#0", "long.mp4#1", "long.mp4#2"]


def test_each_clip_takes_the_largest_frame_count_it_fills_and_its_size_bucket(folder):
    data = DataSpec(path=str(folder), resolution=32, video=SLIDING, buckets=BUCKETS, num_workers=0)
    index = index_clips(data)
    got = {c.sample_id: (c.frames, c.size) for c in index.records}
    assert got["sq0.mp4#0"] == (5, (32, 32))  # 12 frames at 24 fps: 6 at 12 fps -> 5
    assert got["long0.mp4#0"] == got["long0.mp4#1"] == (9, (32, 32))  # 20 at 12 fps -> two chunks of 9
    assert got["wide0.mp4#0"] == (5, (48, 32)) and got["still.png"] == (1, (32, 48))
    assert "short.mp4" not in " ".join(got) and len(index.problems) == 1
    assert (
        f"cannot use video {folder / 'short.mp4'} (sample short.mp4): it has 1 frames at 12 fps (3 at the "
        "file's 24 fps), fewer than data.video.frames 5" in index.problems[0]
    )
    assert {key_label(k): n for k, n in clip_counts(index.records, data).items()} == {
        "1f 32x48": 1,
        "5f 32x32": 4,
        "5f 48x32": 3,
        "9f 32x32": 4,
    }
    dataset = VideoCaptionDataset(data, index.records, 0)
    keys = dataset.group_keys()
    for i in range(len(dataset)):  # every clip has its key's shape: (3, frames, height, width)
        frames, width, height = keys[i]
        assert tuple(dataset[i]["pixel_values"].shape) == (3, frames, height, width)
    plain = DataSpec(path=str(folder), video=SLIDING)  # frame buckets without size buckets: the square
    assert is_grouped(plain) and {k for k in clip_counts(index_clips(plain).records, plain)} == {
        (1, 32, 32),
        (5, 32, 32),
        (9, 32, 32),
    }
    single = DataSpec(path=str(folder), video={"frames": 5})
    assert not is_grouped(single) and VideoCaptionDataset(single, index_clips(single).records, 0).group_keys() is None


def test_grouped_clip_loaders_keep_one_shape_per_step_and_the_batch_check_agrees(folder):
    (folder / "short.mp4").unlink()
    data = DataSpec(path=str(folder), resolution=32, video=SLIDING, buckets=BUCKETS, num_workers=0)
    records = index_clips(data).records
    groups = {key_label(k): n for k, n in clip_counts(records, data).items()}
    plan = make_plan(
        TrainSpec(micro_batch_size=1, gradient_accumulation_steps=1, max_steps=4),
        WORLD2,
        len(records),
        SpecSource("spec.yaml"),
        groups,
    )
    assert plan.steps_per_epoch == 0 + 2 + 1 + 2  # the still's bucket (1 clip) never trains
    reports = []
    for rank in range(2):
        dataset = VideoCaptionDataset(data, records, 0)
        loader, sampler = make_loader(dataset, collate_video, dataset.group_keys(), data, plan, rank, 0)
        shapes = [tuple(batch["pixel_values"].shape) for batch in loader]  # the loader checks each batch's key
        steps = [sampler.step_group(0, step) for step in range(plan.steps_per_epoch)]
        assert shapes == [(1, 3, f, h, w) for f, w, h in steps]
        first = next(iter(make_loader(dataset, collate_video, dataset.group_keys(), data, plan, rank, 0)[0]))
        report = bucket_report(sampler, first)
        assert report["mixed_bucket_steps"] == 0 and report["first_batch_in_bucket"]
        reports.append(
            RankReport(
                rank=rank,
                host="h",
                ds_micro_batch=1,
                ds_accumulation=1,
                ds_global_batch=2,
                ds_data_parallel=2,
                loader_micro_batches=plan.steps_per_epoch,
                first_batch_size=1,
                num_samples=plan.num_samples,
                **report,
            )
        )
    expected = expected_from_plan(plan)
    assert expected.bucket_steps == "5f 32x32: 2, 5f 48x32: 1, 9f 32x32: 2"
    assert find_mismatches(reports, expected) == []
    wrong = Expected(**{**expected.__dict__, "bucket_steps": "5f 32x32: 3, 9f 32x32: 2"})
    assert "steps per bucket are 5f 32x32: 2, 5f 48x32: 1, 9f 32x32: 2" in "\n".join(find_mismatches(reports, wrong))
    clip = {"pixel_values": torch.zeros(2, 3, 5, 32, 48)}
    assert size_matches_bucket(clip, (5, 48, 32)) and not size_matches_bucket(clip, (9, 48, 32))
    assert not size_matches_bucket(clip, (5, 32, 48)) and not size_matches_bucket(clip, (48, 32))
    latents = {"latent_mean": torch.zeros(2, 16, 3, 4, 6)}  # 9 frames -> 3 latent frames; 48x32 -> 6x4
    assert size_matches_bucket(latents, (9, 48, 32)) and not size_matches_bucket(latents, (5, 48, 32))
    chunked = ClipRule(17, 5, 5, 2)  # a VAE of 17-frame chunks: 22 frames -> 7 latent frames, 39 -> 12
    latents = {"latent_mean": torch.zeros(2, 16, 7, 4, 6)}
    assert size_matches_bucket(latents, (22, 48, 32), chunked) and not size_matches_bucket(latents, (22, 48, 32))
    assert not size_matches_bucket(latents, (39, 48, 32), chunked)


def test_chunks_have_their_own_cache_keys_and_old_video_keys_stay(folder):
    data = DataSpec(path=str(folder), video=SLIDING, buckets=BUCKETS)
    chunks = [c for c in index_clips(data).records if c.sample_id.startswith("long0.mp4")]
    hashes = {c.sample_id: "same-file" for c in chunks}
    entries = plan_entries(
        chunks, hashes, {"vae": "v"}, 32, False, 0.0, "float32", True, False, {c.sample_id: c.size for c in chunks}
    )
    assert [e.sample_id for e in entries] == ["long0.mp4#0", "long0.mp4#1"] and len({e.key for e in entries}) == 2
    # repr(data.video) is part of a clip's content key: specs without a stride keep the keys they had
    assert repr(VideoSpec()) == "VideoSpec(frames=5, sampling='head', fps=None)"
    assert repr(VideoSpec(sampling="sliding", stride=3)).endswith("stride=3)")
    with pytest.raises(ValueError, match="stride 3 applies to sampling: sliding only"):
        VideoSpec(stride=3)
    # the counts a model's VAE takes are its card's clip rule (tests/unit/test_clip_rule.py); the spec checks the rest
    assert VideoSpec(frames=[5, 22]).frame_counts == (5, 22)
    with pytest.raises(ValueError, match="0 frames: a clip has at least one frame"):
        VideoSpec(frames=[5, 0])


def _spec(tmp_path, data: dict) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "video", "pretrained": "builtin:tiny-wan"},
                "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": 4},
                "data": data,
            }
        )
    )
    return spec


def test_validate_counts_clips_prints_their_buckets_and_tokens_and_names_short_videos(folder, tmp_path, capsys):
    spec = _spec(tmp_path, {"path": str(folder), "resolution": 32, "video": SLIDING, "buckets": BUCKETS})
    assert main(["validate", str(spec), "--world-size", "2"]) == 1  # short.mp4 gives no clip
    out = capsys.readouterr().out
    assert "1 video(s) give no clip" in out and "(sample short.mp4): it has 1 frames at 12 fps" in out
    assert main(["validate", str(spec), "--world-size", "2", "--json"]) == 1
    clips = json.loads(capsys.readouterr().out)["clips"]
    assert (clips["video_files"], clips["clips"], clips["stills"], clips["unusable_videos"]) == (10, 12, 1, 1)
    assert clips["frames"] == {"1": 1, "5": 7, "9": 4} and clips["sizes"] == {"32x48": 1, "32x32": 8, "48x32": 3}
    # tokens: (1 + (frames - 1) / 4) latent frames x (H / 8 / 2) x (W / 8 / 2) from tiny-wan's configs
    assert {k: b["tokens"] for k, b in clips["buckets"].items()} == {
        "1f 32x48": 6,
        "5f 32x32": 8,
        "5f 48x32": 12,
        "9f 32x32": 12,
    }
    (folder / "short.mp4").unlink()
    assert main(["validate", str(spec), "--world-size", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long rows
    assert "12 clips (repeats included)" in out and "frame buckets 1 frames: 1, 5 frames: 7, 9 frames: 4" in out
    assert "size buckets 32x48: 1, 32x32: 8, 48x32: 3" in out and "5f 48x32 3 clips, 12 tokens per sample" in out
    assert "5f 48x32 3 samples, 1 global batch per epoch, leaves out 1" in out  # what each epoch uses
    assert "1f 32x48 1 sample, 0 global batches per epoch, leaves out 1 (never trains" in out  # one, singular
    assert "5 optimizer steps (5 micro-batches per rank, the sum over 4 buckets)" in out
    assert "largest 12 per sample" in out


def test_memory_plan_uses_the_largest_bucket(folder, tmp_path):
    from dstune.families import get_facts

    count_model = get_facts("video").count
    from dstune.spec.load import load_spec

    spec, _ = load_spec(_spec(tmp_path, {"path": str(folder), "video": SLIDING, "cache": {"latents": True}}), [])
    small, large = count_model(spec, 2, [(5, 32, 32, 2)]), count_model(spec, 2, [(5, 32, 32, 1), (9, 48, 32, 1)])
    assert large.activation_sample_bytes > small.activation_sample_bytes
    assert large.activation_sample_bytes == count_model(spec, 1, [(9, 48, 32, 1)]).activation_sample_bytes
    # the latent cache: 2 x 16 channels x latent frames x h x w x 4 bytes per clip, summed over the buckets
    assert large.cache_bytes == 2 * 16 * 4 * (2 * 4 * 4 + 3 * 4 * 6)


def test_startup_lists_the_clips_validate_counted_and_stops_on_short_videos(folder, capsys):
    from dstune.distributed import Run
    from dstune.spec.models import Spec
    from dstune.startup import checked_records
    from dstune.world import World

    world = World(world_size=1, num_nodes=1, ranks_per_node=(1,), hosts=("localhost",), source="test")
    run = Run(rank=0, local_rank=0, world=world, device="cpu", accelerator="cpu", node_rank=0, launched=False)

    def startup(micro_batch_size: int):
        spec = Spec.model_validate(
            {
                "model": {"family": "video"},
                "data": {"path": str(folder), "video": SLIDING},
                "train": {"micro_batch_size": micro_batch_size, "gradient_accumulation_steps": 1, "max_steps": 1},
            }
        )
        return checked_records(run, spec, "video")

    with pytest.raises(SystemExit):
        startup(2)
    message = capsys.readouterr().err
    assert message.startswith("data.path: 1 unusable video(s):") and "(sample short.mp4): it has 1 frames" in message
    (folder / "short.mp4").unlink()
    records = startup(2)  # grouped by frame count: stills beside clips are fine with micro batches of 2
    assert [r.sample_id for r in records][:3] == ["long0.mp4#0", "long0.mp4#1", "long1.mp4#0"]
    assert sum(r.repeats for r in records) == 12 and {r.frames for r in records} == {1, 5, 9}
