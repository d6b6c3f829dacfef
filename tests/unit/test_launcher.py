"""`dstune train` without ranks: what it forwards to DeepSpeed's runner and to every rank (read back with DeepSpeed's
and dstune.train's own parsers), the resume command it prints, the master-port check, and the run folder lock."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from dstune import cli, launcher, runlock
from dstune.cli_args import build_parser
from dstune.train import parse_args as parse_rank_args

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))


def train_args(*words: str):
    parser, _ = build_parser()
    return parser.parse_args(["train", *words])


def runner_args(cmd: list[str]):
    from deepspeed.launcher.runner import parse_args

    assert cmd[1:4] == ["-u", "-m", "deepspeed.launcher.runner"]
    return parse_args(cmd[4:])


def test_runner_command_is_what_deepspeed_and_the_ranks_read():
    args = train_args(
        "my spec.yaml",
        "--num-gpus",
        "2",
        "--set",
        "train.max_steps=5",
        "--set",
        "output.dir=runs/a b",
        "--resume",
        "latest",
        "--allow-batch-change",
        "--master-port",
        "29611",
    )
    cmd = launcher.runner_command(args, master_port=29611)
    ds = runner_args(cmd)
    assert (ds.num_gpus, ds.master_port, ds.module, ds.user_script) == (2, 29611, True, "dstune.train")
    assert ds.hostfile == "/job/hostfile" and ds.include == "" and ds.num_nodes == -1  # DeepSpeed's defaults
    rank = parse_rank_args(ds.user_args)
    assert rank.spec == "my spec.yaml"
    assert rank.overrides == ["train.max_steps=5", "output.dir=runs/a b"]
    assert (rank.resume, rank.allow_batch_change, rank.allow_spec_changes, rank.cache_only) == (
        "latest",
        True,
        False,
        False,
    )


def test_hostfile_filters_and_multi_node_flags_are_forwarded():
    args = train_args(
        "s.yaml",
        "--hostfile",
        "hosts",
        "--include",
        "w0:0,1@w1",
        "--master-addr",
        "10.0.0.1",
        "--launcher",
        "openmpi",
        "--cache-only",
    )
    ds = runner_args(launcher.runner_command(args, master_port=30000, num_gpus=None))
    assert (ds.hostfile, ds.include, ds.master_addr, ds.launcher, ds.num_gpus) == (
        "hosts",
        "w0:0,1@w1",
        "10.0.0.1",
        "openmpi",
        -1,
    )
    assert parse_rank_args(ds.user_args).cache_only


def test_without_world_flags_the_validated_rank_count_is_launched():
    ds = runner_args(launcher.runner_command(train_args("s.yaml"), master_port=30000, num_gpus=3))
    assert ds.num_gpus == 3
    # a given --num-gpus wins over the filled-in count
    ds = runner_args(launcher.runner_command(train_args("s.yaml", "--num-gpus", "2"), master_port=30000, num_gpus=3))
    assert ds.num_gpus == 2


def test_resume_command_repeats_the_launch_with_resume_latest():
    args = train_args(
        "spec.yaml",
        "--num-gpus",
        "2",
        "--set",
        "output.dir=runs/my run",
        "--resume",
        "runs/x/step-4",
        "--master-port",
        "29999",
        "--allow-spec-changes",
        "--grace",
        "5",
    )
    line = launcher.resume_command(args)
    words = shlex.split(line)
    assert words[:2] == ["dstune", "train"]
    again = build_parser()[0].parse_args(words[1:])
    assert (again.spec, again.num_gpus, again.master_port, again.overrides, again.allow_spec_changes) == (
        "spec.yaml",
        2,
        29999,
        ["output.dir=runs/my run"],
        True,
    )
    assert again.resume == "latest" and words.count("--resume") == 1


def test_the_closing_line_names_the_last_checkpoint_and_reads_it_without_torch(tmp_path):
    """`dstune train` itself never imports torch (the ranks do): its last line after a stop reads the newest complete
    checkpoint's step from its dstune_state.json, and a checkpoint still being written (no state file) is skipped."""
    root = tmp_path / "run" / "checkpoints"
    for step, complete in ((4, True), (6, False)):
        folder = root / f"step-{step:08d}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "dstune_state.json").write_text(json.dumps({"state": {"global_step": step}}))
    (root / "latest").write_text("step-00000004")
    script = (
        "import sys; from dstune import launcher; from dstune.cli_args import build_parser; "
        "args = build_parser()[0].parse_args(['train', 'spec.yaml', '--num-gpus', '2']); "
        f"print(launcher.final_line(launcher.RunEnd(130, stop_signal=2), launcher.Path({str(tmp_path / 'run')!r}),"
        " args)); assert 'torch' not in sys.modules, 'the closing line imported torch'"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"last complete checkpoint {root / 'step-00000004'} (step 4)" in done.stdout
    assert "interrupted (SIGINT, exit 130)" in done.stdout and done.stdout.strip().endswith("--resume latest")


def test_port_check_sees_a_listening_port_and_not_a_free_one():
    with socket.socket() as server:
        server.bind(("", 0))
        server.listen()
        port = server.getsockname()[1]
        assert launcher.port_in_use(port)
    assert not launcher.port_in_use(port)
    assert not launcher.port_in_use(launcher.free_port())


def _tiny_spec(folder: Path, run_dir: Path) -> Path:
    spec = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": {"path": "builtin:shapes", "resolution": 32, "num_workers": 0},
        "train": {
            "micro_batch_size": 2,
            "max_steps": 4,
            "optimizer": {"type": "adamw", "lr": 1e-3},
            "precision": "fp32",
        },
        "output": {"dir": str(run_dir), "cache_dir": str(CACHE_DIR), "export": "none"},
    }
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_busy_master_port_is_refused_before_anything_starts(tmp_path, capsys):
    spec = _tiny_spec(tmp_path, tmp_path / "run")
    with socket.socket() as server:
        server.bind(("", 0))
        server.listen()
        port = server.getsockname()[1]
        code = cli.main(["train", str(spec), "--num-gpus", "2", "--master-port", str(port)])
    err = capsys.readouterr().err
    assert code == 1
    assert f"--master-port {port}: that port is already in use" in err and "Pick another port" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_invalid_spec_lists_every_error_and_launches_nothing(tmp_path, capsys):
    spec = _tiny_spec(tmp_path, tmp_path / "run")
    code = cli.main(
        ["train", str(spec), "--num-gpus", "2", "--set", "train.micro_batch_size=0", "--set", "train.optimizer.lr=-1"]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "train.micro_batch_size" in err and "train.optimizer.lr" in err
    assert "not launched: 2 error(s)" in err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ the lock


@pytest.fixture
def other_process():
    """A live process that is not this one (the holder of a lock taken by 'another run')."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield psutil.Process(proc.pid)
    proc.kill()
    proc.wait()


def _write_lock(run_dir: Path, pid: int, host: str, start: float, launcher_pid=None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    runlock.lock_path(run_dir).write_text(
        json.dumps(
            {
                "pid": pid,
                "host": host,
                "started": "earlier",
                "process_start": start,
                "launcher_pid": launcher_pid,
                "command": "train.py spec.yaml",
            }
        )
    )


def test_a_live_run_keeps_its_folder(tmp_path, other_process):
    _write_lock(tmp_path, other_process.pid, socket.gethostname(), other_process.create_time(), launcher_pid=4242)
    error, note = runlock.take(tmp_path, "second run")
    assert note is None
    assert str(tmp_path) in error and f"pid {other_process.pid} on host {socket.gethostname()}" in error
    assert "kill -INT 4242" in error and "another output.dir" in error
    assert json.loads(runlock.lock_path(tmp_path).read_text())["pid"] == other_process.pid  # untouched


def test_dstune_train_refuses_a_folder_in_use_before_launching(tmp_path, other_process, capsys):
    run_dir = tmp_path / "run"
    _write_lock(run_dir, other_process.pid, socket.gethostname(), other_process.create_time())
    code = cli.main(["train", str(_tiny_spec(tmp_path, run_dir)), "--num-gpus", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "not launched" in err and f"pid {other_process.pid}" in err
    assert sorted(p.name for p in run_dir.iterdir()) == [runlock.LOCK_NAME]


def test_a_dead_holder_is_taken_over_with_a_note_and_released(tmp_path):
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    _write_lock(tmp_path, finished.pid, socket.gethostname(), time.time() - 5)
    assert runlock.in_use_problem(tmp_path) is None
    error, note = runlock.take(tmp_path, "new run")
    assert error is None and f"pid {finished.pid}" in note and "took it over" in note
    mine = json.loads(runlock.lock_path(tmp_path).read_text())
    assert (mine["pid"], mine["command"]) == (os.getpid(), "new run")
    assert runlock.take(tmp_path, "third")[0] is not None  # held by a live process now: this one
    runlock.release_held()
    assert not runlock.lock_path(tmp_path).exists()


def test_a_reused_pid_is_not_mistaken_for_the_holder(tmp_path):
    """The pid is alive (this process) but started after the lock was written: the holder is gone."""
    _write_lock(tmp_path, os.getpid(), socket.gethostname(), psutil.Process().create_time() - 1000)
    assert runlock.in_use_problem(tmp_path) is None


def test_a_lock_from_another_host_is_refused_with_the_way_out(tmp_path):
    _write_lock(tmp_path, 12345, "some-other-node", time.time())
    error, _ = runlock.take(tmp_path, "run")
    assert "another host" in error and "some-other-node" in error and f"delete {runlock.lock_path(tmp_path)}" in error


def test_release_leaves_a_lock_that_is_not_ours(tmp_path):
    assert runlock.take(tmp_path, "run") == (None, None)
    _write_lock(tmp_path, 999999, "elsewhere", 0.0)  # replaced behind our back (deleted by hand, then retaken)
    runlock.release_held()
    assert json.loads(runlock.lock_path(tmp_path).read_text())["host"] == "elsewhere"


# ------------------------------------------------------------------------------------------------ a rank's side

STOP_SCRIPT = """
import os, signal
from dstune.interrupts import at_step_boundaries, exit_code_for_stop, install_stop_handlers, stop_requested
install_stop_handlers()
with at_step_boundaries():
    os.kill(os.getpid(), signal.SIGTERM)  # inside the loop: only noted, the step goes on
    print("went on", stop_requested(), exit_code_for_stop())
try:
    os.kill(os.getpid(), signal.SIGINT)  # outside: stops at once
    print("not stopped")
except KeyboardInterrupt:
    print("stopped at once")
"""


def test_a_rank_notes_a_stop_inside_the_loop_and_stops_at_once_outside():
    result = subprocess.run(
        [sys.executable, "-c", STOP_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.stdout.split("\n")[:2] == ["went on True 143", "stopped at once"], result.stderr


FORWARDED_SCRIPT = """
import os
from dstune.interrupts import install_stop_handlers, rank_exit_code_for_stop, stop_signal_name
try:
    install_stop_handlers()
    print("not stopped")
except KeyboardInterrupt:
    print("stopped", stop_signal_name(), rank_exit_code_for_stop(), sorted(os.listdir(os.environ["DSTUNE_STOP_DIR"])))
"""


def test_a_rank_that_starts_after_dstune_train_forwarded_a_stop_takes_it_and_exits_0(tmp_path):
    """A stop that came while the rank was still starting Python: the rank marks itself ready, finds the stop that
    `dstune train` wrote, stops, and exits 0 (the launcher must not take it for a failed rank)."""
    (tmp_path / "stop").write_text(str(int(signal.SIGTERM)))
    result = subprocess.run(
        [sys.executable, "-c", FORWARDED_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO), "DSTUNE_STOP_DIR": str(tmp_path)},
    )
    lines = result.stdout.splitlines()
    assert lines and lines[0].startswith("stopped SIGTERM 0 ['ready-"), result.stdout + result.stderr


def test_a_rank_rebuilds_its_launch_command_with_resume_latest(monkeypatch):
    from dstune.checkpoints.stop_text import rank_resume_command

    monkeypatch.setattr(
        sys,
        "argv",
        [
            "/x/dstune/train.py",
            "--local_rank=1",
            "spec.yaml",
            "--set",
            "a=b c",
            "--resume",
            "runs/x/checkpoints/step-4",
        ],
    )
    monkeypatch.setenv("LOCAL_SIZE", "2")
    monkeypatch.delenv("CROSS_SIZE", raising=False)
    assert (
        rank_resume_command(resume=True)
        == "deepspeed --num_gpus 2 dstune/train.py spec.yaml --set 'a=b c' --resume latest"
    )
    assert rank_resume_command(resume=False) == "deepspeed --num_gpus 2 dstune/train.py spec.yaml --set 'a=b c'"
    monkeypatch.setenv("CROSS_SIZE", "2")
    assert rank_resume_command(resume=True).startswith("deepspeed --hostfile HOSTFILE --num_nodes 2 --num_gpus 2 ")


STUCK_RANK = """
import os, pathlib, signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)   # a rank that never reaches its next step
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path(os.environ["STUCK_MARKS"], str(os.getpid())).touch()
time.sleep(600)
"""


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ranks_that_do_not_stop_are_killed_after_the_grace_period(tmp_path):
    """DeepSpeed's real runner and per-node launcher over two ranks that ignore SIGINT and SIGTERM: after a stop
    signal to this process and --grace seconds, every process below it is gone (SIGKILL), and it says so; an output
    that can no longer be written does not end the supervision early."""
    script = tmp_path / "dstune" / "train.py"  # named like the ranks dstune train looks for
    script.parent.mkdir()
    script.write_text(STUCK_RANK)
    cmd = [
        sys.executable,
        "-u",
        "-m",
        "deepspeed.launcher.runner",
        "--log_level",
        "error",
        "--num_gpus",
        "2",
        "--master_port",
        str(launcher.free_port()),
        str(script),
    ]
    said = []

    def say_into_a_closed_pipe(text, **_):  # `dstune train | tee log`, and Ctrl-C ended tee as well
        said.append(text)
        raise BrokenPipeError(32, "Broken pipe")

    marks = tmp_path / "up"
    marks.mkdir()
    supervisor = launcher.Supervisor(
        cmd,
        {**os.environ, "DS_ACCELERATOR": "cpu", "STUCK_MARKS": str(marks)},
        grace_s=3,
        multi_node=False,
        say=say_into_a_closed_pipe,
    )
    seen_ranks = []

    def stop_when_ranks_run():
        deadline = time.monotonic() + 120
        # both ignore signals now, and the supervisor has seen them (it polls: a fast machine starts the ranks first)
        while (len(list(marks.iterdir())) < 2 or len(supervisor.seen) < 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        seen_ranks.extend(supervisor.seen.values())
        os.kill(os.getpid(), signal.SIGINT)

    stopper = threading.Thread(target=stop_when_ranks_run, daemon=True)
    stopper.start()
    started = time.monotonic()
    try:
        outcome = supervisor.run()
    finally:  # whatever happened, leave no process that ignores signals behind
        stopper.join()
        for process in seen_ranks:
            if _running(process):
                process.kill()
    assert len(seen_ranks) == 2
    assert outcome.stop_signal == signal.SIGINT and launcher.exit_code(outcome) == 130
    assert all(p.pid in outcome.killed for p in seen_ranks)
    assert not any(_running(p) for p in seen_ranks)
    assert time.monotonic() - started < 100
    assert any("still running after 3 s: killed the launcher and every rank (SIGKILL" in text for text in said), said


def test_a_stop_outside_the_loop_names_the_runs_last_checkpoint(tmp_path, monkeypatch):
    """A rank stopped before or after the loop (a resume interrupted during start-up) reads the run folder from the
    spec for its line: the checkpoint that is there, not "no checkpoint was written yet"."""
    from dstune import train
    from dstune.checkpoints.layout import STATE_FILE

    spec = _tiny_spec(tmp_path, tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    (root / "step-00000004").mkdir(parents=True)
    (root / "step-00000004" / STATE_FILE).write_text("{}")
    (root / "latest").write_text("step-00000004")
    monkeypatch.setenv("DSTUNE_TRAIN_PID", "1")  # under `dstune train`, which prints the command itself
    assert train._interrupted_text([str(spec), "--resume", "latest"]) == (
        f"interrupted (SIGINT); last complete checkpoint step 4 ({root / 'step-00000004'})"
    )
    monkeypatch.delenv("DSTUNE_TRAIN_PID")
    monkeypatch.setattr(sys, "argv", ["/x/dstune/train.py", str(spec)])
    text = train._interrupted_text([str(spec)])
    assert text.endswith(f"continue with: python dstune/train.py {spec} --resume latest"), text
