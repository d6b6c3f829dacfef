"""Rank 0's metrics beyond metrics.jsonl: the TensorBoard tags and event files (read back with TensorBoard's own
reader), and the loss / LR curves of the samples page, whose drawn points must be the logged values."""

from __future__ import annotations

import re

import pytest

from dstune.curves import PANEL_HEIGHT_PX, curves_svg, nice_step, series
from dstune.families.samples import write_contact_sheet
from dstune.progress import MetricsFile, read_metrics
from dstune.trackers import open_trackers, scalar_tag

RECORDS = [
    {"step": 1, "loss": 0.9, "lr": 1e-4, "grad_norm": 2.0, "samples_per_s": 10.0},
    {
        "step": 2,
        "loss": 0.7,
        "lr": 2e-4,
        "grad_norm": None,
        "samples_per_s": 12.0,
        "eval_loss": 0.8,
        "eval_samples": 5,
        "memory_host_peak_gib": 1.5,
    },
    {"step": 4, "loss": 0.4, "lr": 1e-4, "grad_norm": 1.0, "samples_per_s": 11.0, "eval_loss": 0.6, "eval_samples": 5},
]


def test_tags_group_the_metrics_keys():
    assert [
        scalar_tag(k)
        for k in (
            "loss",
            "loss_audio",
            "lr",
            "grad_norm",
            "eval_loss",
            "memory_host_peak_gib",
            "epoch",
            "data_wait_fraction",
        )
    ] == [
        "train/loss",
        "train/loss_audio",
        "train/lr",
        "train/grad_norm",
        "eval/loss",
        "memory/host_peak_gib",
        "progress/epoch",
        "perf/data_wait_fraction",
    ]


def test_tensorboard_event_files_hold_every_logged_number_and_the_sample_grid(tmp_path):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    grid = tmp_path / "grid.png"
    Image.new("RGB", (6, 4), (255, 0, 0)).save(grid)
    metrics = MetricsFile(tmp_path / "metrics.jsonl", True, open_trackers(tmp_path, tensorboard=True, wandb=False))
    for record in RECORDS:
        metrics.write(record)
    metrics.samples(4, grid)
    metrics.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == RECORDS
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")] == [(1, 0.9), (2, 0.7), (4, 0.4)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("eval/loss")] == [(2, 0.8), (4, 0.6)]
    assert [e.step for e in events.Scalars("train/grad_norm")] == [1, 4]  # None is not a number: left out
    [image] = events.Images("samples")
    assert (image.step, image.width, image.height) == (4, 6, 4)


def test_a_disabled_metrics_file_writes_nothing(tmp_path):
    metrics = MetricsFile(tmp_path / "metrics.jsonl", False, None)
    metrics.write(RECORDS[0])
    metrics.close()
    assert not (tmp_path / "metrics.jsonl").exists() and read_metrics(tmp_path / "metrics.jsonl") == []


def _points(svg: str, name: str) -> list[tuple[float, float]]:
    text = re.search(rf'<polyline data-series="{name}" points="([^"]*)"', svg).group(1)
    return [tuple(map(float, pair.split(","))) for pair in text.split()]


def _axis(svg: str, panel: int) -> tuple[float, float, float, float]:
    """(left, right, top, bottom) of the panel's plot frame."""
    x, y, width, height = map(
        float,
        re.findall(
            r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" '
            r'height="([\d.]+)" class="frame"/>',
            svg,
        )[panel],
    )
    return x, x + width, y, y + height


def _grid_values(svg: str, panel: int) -> list[float]:
    frame_top = _axis(svg, panel)[2]
    labels = re.findall(r'<text x="[\d.]+" y="([\d.]+)" class="tick" text-anchor="end">([^<]+)</text>', svg)
    return [float(value) for y, value in labels if frame_top - 10 < float(y) < frame_top + PANEL_HEIGHT_PX]


@pytest.mark.parametrize("name, panel", [("loss", 0), ("eval_loss", 0), ("lr", 1)])
def test_each_curve_point_maps_back_to_its_logged_step_and_value(name, panel):
    svg = curves_svg(RECORDS)
    left, right, top, bottom = _axis(svg, panel)
    values = _grid_values(svg, panel)
    low, high = min(values), max(values)  # the frame spans the lowest to the highest grid line
    logged = series(RECORDS, name)
    drawn = _points(svg, name)
    assert len(drawn) == len(logged)
    for (x, y), (step, value) in zip(drawn, logged):
        assert 1 + (x - left) / (right - left) * (4 - 1) == pytest.approx(step, abs=0.01)
        assert low + (bottom - y) / (bottom - top) * (high - low) == pytest.approx(value, rel=1e-3, abs=1e-3 * high)
    assert low <= min(v for _, v in logged) and max(v for _, v in logged) <= high


def test_grid_lines_are_round_numbers_and_nothing_logged_draws_nothing():
    assert nice_step(0.634) == pytest.approx(0.2) and nice_step(0.8) == pytest.approx(0.2)
    assert nice_step(29, 8) == 5
    assert curves_svg([]) == "" and curves_svg([{"step": 1, "loss": float("nan")}]) == ""
    single = curves_svg([{"step": 3, "loss": 0.5, "lr": 0.001}])  # one step: a dot, not a division by zero
    assert "<circle" in single and len(_points(single, "loss")) == 1


def test_the_samples_page_carries_the_curves_above_the_grids(tmp_path):
    (tmp_path / "step-000004.png").write_bytes(b"")
    page = write_contact_sheet(tmp_path, ["a circle"], "trained", RECORDS).read_text()
    assert page.index("<svg") < page.index('id="step-4"')
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched from a network
    assert "<svg" not in write_contact_sheet(tmp_path, ["a circle"], "trained").read_text()


def test_speech_samples_go_to_tensorboard_as_one_audio_clip_per_wav(tmp_path):
    """Audio families save a folder of WAVs (dstune.families.speech.save_wavs); each becomes an audio summary, but
    an empty one (a model that said nothing: its end token first) is left out instead of failing the run."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("soundfile")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dstune.families.speech import Clip, save_wavs

    tone = np.sin(np.linspace(0, 200 * np.pi, 1600)).astype("float32") * 0.5
    folder = save_wavs(
        [Clip(tone, 16000), Clip(tone[:800], 16000), Clip(tone[:0], 16000)],
        ["one", "two", "none"],
        tmp_path / "samples" / "s.png",
    )
    trackers = open_trackers(tmp_path, tensorboard=True, wandb=False)
    trackers.samples(3, folder)
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"audio": 0})
    events.Reload()
    assert sorted(events.Tags()["audio"]) == ["samples/00", "samples/01"]
    [clip] = events.Audio("samples/00")
    assert (clip.step, clip.sample_rate, clip.length_frames) == (3, 16000, 1600)


def test_wandb_writes_an_offline_run_with_the_metrics_and_samples(tmp_path, monkeypatch):
    """Only where `wandb` is installed (dstune does not depend on it; validate refuses output.wandb without it)."""
    pytest.importorskip("wandb")
    from PIL import Image

    monkeypatch.setenv("WANDB_SILENT", "true")
    grid = tmp_path / "grid.png"
    Image.new("RGB", (6, 4), (255, 0, 0)).save(grid)
    trackers = open_trackers(tmp_path, tensorboard=False, wandb=True, config={"train": {"seed": 7}})
    for record in RECORDS:
        trackers.scalars(record)
    trackers.samples(4, grid)
    trackers.close()
    [run] = (tmp_path / "wandb").glob("offline-run-*")
    recorded = next(run.glob("run-*.wandb")).read_bytes()
    assert b"train/loss" in recorded and b"eval/loss" in recorded
    assert list((run / "files" / "media" / "images").glob("samples_4_*.png"))
    assert not (tmp_path / "tensorboard").exists()


def test_speech_samples_get_a_player_per_wav(tmp_path):
    """A speech run's steps are folders of WAVs (one per prompt): the page plays each of them."""
    for step in (0, 4):
        (tmp_path / f"step-{step:06d}").mkdir()
        for number in range(2):
            (tmp_path / f"step-{step:06d}" / f"{number:02d}.wav").write_bytes(b"RIFF")
    page = write_contact_sheet(tmp_path, ["123", "90"], "trained").read_text()
    assert page.count("<audio controls") == 4
    assert '<audio controls preload="none" src="step-000004/01.wav"></audio>' in page
