"""Faults with real processes (2 ranks on CPU, gloo): a rank killed mid-training, a crash while a checkpoint is being
written, an unwritable or full output folder, a rank whose data differs, a NaN loss on one rank.

Faults are injected by a small wrapper around dstune/train.py (written to the test's folder), chosen with the
environment variable DSTUNE_TEST_FAULT: the kill is a real SIGKILL of a real rank, the crash during a save is a real
SIGKILL after DeepSpeed wrote that rank's shards, the NaN is a real non-finite loss tensor going through backward.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from harness import LAUNCHED_PORTS, base_spec, explain, launch, metrics, shm_segments, write_spec

pytestmark = pytest.mark.dist

STEPS = 6
FAULT_SCRIPT = '''
import os, signal, sys, time
from pathlib import Path

sys.path.insert(0, {repo!r})
kind, _, arg = os.environ["DSTUNE_TEST_FAULT"].partition(":")
rank = int(os.environ.get("RANK", "0"))
marks = Path(os.environ["DSTUNE_TEST_MARKS"])
marks.mkdir(parents=True, exist_ok=True)
(marks / f"pid-rank{{rank}}").write_text(str(os.getpid()))


def die():
    (marks / "killed-at").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


if kind in ("kill-at-step", "nan-at-step") and rank == 1:
    from dstune.models.sd.model import Sd

    original_loss = Sd.loss

    def loss(self, forward, encoded, seed, step):
        value = original_loss(self, forward, encoded, seed, step)
        if step == int(arg):  # `step` optimizer steps are done: this is the loss of step `step` + 1
            if kind == "kill-at-step":
                die()
            return value * float("nan")
        return value

    Sd.loss = loss  # the class SD's card names: what the start-up loads
elif kind == "kill-in-save" and rank == 1:
    from deepspeed.runtime.engine import DeepSpeedEngine

    original_save = DeepSpeedEngine.save_checkpoint

    def save_checkpoint(self, save_dir, tag=None, **kwargs):
        result = original_save(self, save_dir, tag=tag, **kwargs)
        if tag == arg:  # this rank's shards are on disk, dstune's RNG file and state are not
            die()
        return result

    DeepSpeedEngine.save_checkpoint = save_checkpoint
elif kind == "data-differs" and rank == 1:  # this "node" sees another copy of the data folder
    sys.argv += ["--set", f"data.path={{arg}}"]

from dstune.distributed import exit_rank
from dstune.train import main

exit_rank(main())  # as dstune/train.py ends
'''


def _spec(run_dir: Path, **output) -> dict:
    return base_spec(run_dir,
                     train={"global_batch_size": 4, "micro_batch_size": 2, "max_steps": STEPS},
                     deepspeed={"zero_stage": 2, "timeout_minutes": 1},
                     output={"save_every_steps": 2, "keep_last": 5, **output})


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train_with_fault.py"
    path.write_text(FAULT_SCRIPT.format(repo=str(Path(__file__).resolve().parents[2])))
    return path


def _launch_with_fault(monkeypatch, tmp_path: Path, spec_path: Path, fault: str, args: tuple = (),
                       real_launcher: bool = False):
    monkeypatch.setenv("DSTUNE_TEST_FAULT", fault)
    monkeypatch.setenv("DSTUNE_TEST_MARKS", str(tmp_path / f"marks-{fault.replace(':', '-')}"))
    proc = launch(spec_path, num_ranks=2, args=args, script=_script(tmp_path), real_launcher=real_launcher)
    return proc, tmp_path / f"marks-{fault.replace(':', '-')}"


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir)}  # a resumed run appends: the last line of a step wins


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted run every crashed-and-resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    spec_path = write_spec(run_dir.parent / "spec.yaml", _spec(run_dir))
    proc = launch(spec_path, num_ranks=2)
    assert proc.returncode == 0, explain(proc)
    return run_dir, spec_path


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def _assert_same_trajectory(clean_dir: Path, run_dir: Path, steps: range) -> None:
    want, got = _losses(clean_dir), _losses(run_dir)
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), f"step {step}"


def test_sigkill_of_one_rank_stops_all_and_resume_continues_exactly(clean, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    spec_path = write_spec(tmp_path / "spec.yaml", _spec(run_dir))
    # how DeepSpeed's own launcher reacts to a dead rank is part of what this checks
    proc, marks = _launch_with_fault(monkeypatch, tmp_path, spec_path, "kill-at-step:4", real_launcher=True)
    ended = time.time()
    assert shm_segments(LAUNCHED_PORTS[-1:]) == set(), "a killed run left its shared-memory segments in /dev/shm"
    assert proc.returncode != 0, explain(proc)
    killed_at = float((marks / "killed-at").read_text())
    # DeepSpeed's launcher polls its children every second and kills the rest when one dies; across nodes the
    # survivors' next collective fails on the closed connection, or at the latest after deepspeed.timeout_minutes.
    print(f"the launcher stopped {ended - killed_at:.1f} s after rank 1 was killed")
    assert ended - killed_at < 90, f"the launcher took {ended - killed_at:.0f} s to stop after the kill"
    for rank in (0, 1):  # the launcher signals the survivors as it exits; give them a moment to be gone
        pid = int((marks / f"pid-rank{rank}").read_text())
        assert _gone_within(pid, seconds=15), f"rank {rank} still runs 15 s after the launcher exited"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert max(_losses(run_dir)) == 4

    again = launch(spec_path, num_ranks=2, args=("--resume", "latest"))
    assert again.returncode == 0, explain(again)
    assert "resumed from" in again.stdout and "step-00000004" in again.stdout
    _assert_same_trajectory(clean[0], run_dir, range(1, STEPS + 1))


def test_crash_while_saving_keeps_latest_on_the_previous_checkpoint(clean, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    spec_path = write_spec(tmp_path / "spec.yaml", _spec(run_dir))
    proc, _ = _launch_with_fault(monkeypatch, tmp_path, spec_path, "kill-in-save:step-00000004")
    assert proc.returncode != 0, explain(proc)
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000002"
    half = root / "step-00000004"
    assert half.is_dir() and any(half.iterdir()), "the save should have started"
    assert not (half / "dstune_state.json").exists()

    again = launch(spec_path, num_ranks=2, args=("--resume", "latest"))
    assert again.returncode == 0, explain(again)
    assert "step-00000002: step 2" in again.stdout
    _assert_same_trajectory(clean[0], run_dir, range(3, STEPS + 1))
    assert (root / "step-00000004" / "dstune_state.json").is_file()  # the half-written folder was replaced


def test_nan_loss_on_one_rank_stops_all_at_that_step(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    spec_path = write_spec(tmp_path / "spec.yaml", _spec(run_dir))
    proc, _ = _launch_with_fault(monkeypatch, tmp_path, spec_path, "nan-at-step:3")
    assert proc.returncode == 1, explain(proc)
    out = proc.stdout + proc.stderr
    assert "non-finite loss at optimizer step 4 on rank 1" in out
    assert "Traceback" not in out
    assert max(_losses(run_dir)) == 3
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000002"
    state = json.loads((root / "step-00000002" / "dstune_state.json").read_text())
    assert state["state"]["global_step"] == 2


def _image_folder(folder: Path, count: int) -> Path:
    from dstune.data.synthetic import render_shape

    folder.mkdir(parents=True)
    for i in range(count):
        image, caption = render_shape(i, 32)
        image.save(folder / f"img{i:02d}.png")
        (folder / f"img{i:02d}.txt").write_text(caption)
    return folder


def test_a_rank_whose_data_differs_stops_all_ranks_naming_it(tmp_path, monkeypatch):
    """Rank 1 reads another copy of the data folder with 4 images fewer (a node with a stale copy)."""
    run_dir = tmp_path / "run"
    full, stale = _image_folder(tmp_path / "data-a", 16), _image_folder(tmp_path / "data-b", 12)
    spec = _spec(run_dir)
    spec["data"]["path"] = str(full)
    spec_path = write_spec(tmp_path / "spec.yaml", spec)
    proc, _ = _launch_with_fault(monkeypatch, tmp_path, spec_path, f"data-differs:{stale}")
    assert proc.returncode == 1, explain(proc)
    out = proc.stdout + proc.stderr
    assert "batch check FAILED" in out
    assert "rank 1" in out and "dataset size is 12, the plan says 16" in out
    assert "Traceback" not in out
    assert not (run_dir / "checkpoints").exists()


def test_unwritable_output_folder_is_refused_before_training(tmp_path):
    # Tests run as root, where a read-only mode bit does not stop writes; a path under a regular file always fails.
    blocker = tmp_path / "a-file.txt"
    blocker.write_text("not a folder")
    run_dir = blocker / "run"
    spec_path = write_spec(tmp_path / "spec.yaml", _spec(run_dir))
    proc = launch(spec_path, num_ranks=2)
    assert proc.returncode == 1, explain(proc)
    out = proc.stdout + proc.stderr
    assert f"output.dir {run_dir}: cannot write there" in out
    assert "Traceback" not in out and "step 1/" not in out


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs: a real filesystem that fills up (needs root, as the CI container has)."""
    mount_point = tmp_path / "tiny-disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_full_disk_is_refused_before_training(tiny_disk, tmp_path):
    run_dir = tiny_disk / "run"
    spec_path = write_spec(tmp_path / "spec.yaml", _spec(run_dir))
    proc = launch(spec_path, num_ranks=2)
    assert proc.returncode == 1, explain(proc)
    out = proc.stdout + proc.stderr
    assert f"output.dir {run_dir}:" in out and "MiB free on its filesystem" in out
    assert "Traceback" not in out
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text() == ""
    shutil.rmtree(run_dir, ignore_errors=True)
