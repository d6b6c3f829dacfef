"""Stopping a run with real processes: `dstune train` started from a folder outside the checkout, 2 ranks on CPU, then
`kill -INT` to the process the user started (what Ctrl-C, a wrapper or a supervisor sends); every rank must be gone
soon after, and the last line says how to continue from a checkpoint that a resume can use. Also a rank refusing an
output.dir that a live run holds, and a busy master port, each in one process without a launcher."""

from __future__ import annotations

import json
import os
import re
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

from harness import REPO, base_spec, env, metrics, write_spec

pytestmark = pytest.mark.dist

START_TIMEOUT_S = 400  # first launch on a machine compiles DeepSpeed's CPU ops (~2 min)


class Output:
    """The merged stdout/stderr of a process, collected by a thread (the pipe must never fill up)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def _dstune(*words: str, cwd: Path) -> tuple[subprocess.Popen, Output]:
    proc = subprocess.Popen([sys.executable, "-m", "dstune", *words], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, Output(proc)


def _logged_steps(run_dir: Path) -> list[int]:
    try:
        return [row["step"] for row in metrics(run_dir) if "step" in row and "loss" in row]
    except (OSError, ValueError):
        return []


def _ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "dstune.train" in p.cmdline() and any(w.startswith("--local_rank") for w in p.cmdline())]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """`dstune train` of 400 steps from a user's folder, stopped with SIGINT once a checkpoint is written:
    (user folder, run folder, the ranks seen, exit code, output)."""
    user_folder = tmp_path_factory.mktemp("stop") / "project"  # not the checkout: the ranks run from here
    user_folder.mkdir()
    run_dir = user_folder / "runs" / "stop"
    spec = base_spec(run_dir, train={"max_steps": 400},
                     output={"save_every_steps": 1, "log_every_steps": 1, "keep_last": 2})
    write_spec(user_folder / "spec.yaml", spec)
    proc, out = _dstune("train", "spec.yaml", "--num-gpus", "2", "--grace", "25", cwd=user_folder)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (_logged_steps(run_dir) and (run_dir / "checkpoints" / "latest").is_file()):
        assert proc.poll() is None, out.text
        assert time.monotonic() < deadline, out.text
        time.sleep(0.5)
    ranks = _ranks(proc)
    assert len(ranks) == 2, out.text
    assert json.loads((run_dir / ".dstune-run.lock").read_text())["launcher_pid"] == proc.pid

    os.kill(proc.pid, signal.SIGINT)
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"ranks {[p.pid for p in alive]} still running 30 s after SIGINT\n{out.text}"
    code = proc.wait(timeout=30)
    out.thread.join(timeout=10)
    return user_folder, run_dir, code, out.text


def test_kill_int_stops_every_rank_and_the_printed_command_continues(stopped_run):
    user_folder, run_dir, code, text = stopped_run
    assert code == 130
    assert "Traceback" not in text, text
    assert "sigkill_handler" not in text, text  # DeepSpeed's launcher does not take a stopped rank for a failure
    stopped = int(re.search(r"interrupted at step (\d+) \(SIGINT\)", text).group(1))
    last = re.search(r"dstune train: interrupted \(SIGINT, exit 130\); last complete checkpoint (\S+) \(step (\d+)\); "
                     r"continue with: (.+)$", text.strip().splitlines()[-1])
    assert last, text
    checkpoint_step = int(last.group(2))
    assert 1 <= checkpoint_step <= stopped
    assert shlex.split(last.group(3)) == ["dstune", "train", "spec.yaml", "--num-gpus", "2", "--resume", "latest"]
    assert not (run_dir / ".dstune-run.lock").exists()  # released by rank 0 on its way out

    # The printed command names a checkpoint a resume can continue from: the run's "latest" points at it, and
    # `dstune validate` of the same spec plans the resume on the same world. (Resuming from "latest" after a crash is
    # trained in tests/dist/test_faults.py; here a second launch would only repeat it.)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{checkpoint_step:08d}"
    plan = subprocess.run([sys.executable, "-m", "dstune", "validate", "spec.yaml", "--num-gpus", "2",
                           "--resume-from", str(run_dir)], cwd=user_folder, env=env(), capture_output=True, text=True)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert f"step {checkpoint_step} of 400" in plan.stdout, plan.stdout


@pytest.mark.parametrize("after_s", [1, 3, 6])
def test_a_stop_at_any_moment_of_start_up_is_one_line_and_leaves_no_rank(stopped_run, after_s):
    """SIGINT 1, 3 and 6 s after `dstune train --resume latest` starts (checking the spec, the ranks starting Python,
    the ranks importing torch and meeting): exit 130, no traceback and no DeepSpeed error line, no process left, and
    whatever speaks names the run's last complete checkpoint."""
    user_folder, run_dir, _, _ = stopped_run
    step = int((run_dir / "checkpoints" / "latest").read_text().strip().rpartition("-")[2])
    proc, out = _dstune("train", "spec.yaml", "--num-gpus", "2", "--resume", "latest", cwd=user_folder)
    time.sleep(after_s)
    below = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130, out.text
    out.thread.join(timeout=10)
    _, alive = psutil.wait_procs(below + _ranks_by_name(run_dir), timeout=10)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}\n{out.text}"
    text = out.text
    assert "Traceback" not in text and "sigkill_handler" not in text and "Interrupted system call" not in text, text
    last = text.strip().splitlines()[-1]
    assert last == "dstune train: interrupted (SIGINT) before the launch; nothing was started" or (
        last.startswith("dstune train: interrupted (SIGINT, exit 130); last complete checkpoint")
        and f"(step {step})" in last
    ), text
    for line in text.splitlines():  # rank 0's own line, when it got that far
        if line.startswith("interrupted ("):
            assert f"last complete checkpoint step {step} " in line, text


def _ranks_by_name(run_dir: Path) -> list[psutil.Process]:
    """Any process still running `dstune.train` on this run's spec folder (a rank that lost its parents)."""
    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if "dstune.train" in (process.info["cmdline"] or []) and process.info["cwd"] == str(run_dir.parents[1]):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _one_process(spec_path: Path, **extra_env) -> subprocess.CompletedProcess:
    """`python -m dstune.train spec` as rank 0 of a launched world of one (the launcher's variables set by hand)."""
    variables = {**env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", **extra_env}
    return subprocess.run([sys.executable, "-m", "dstune.train", str(spec_path)], cwd=REPO, env=variables,
                          capture_output=True, text=True, timeout=START_TIMEOUT_S)


def test_a_rank_refuses_an_output_dir_held_by_a_live_run_and_a_busy_port(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        run_dir = tmp_path / "held"
        run_dir.mkdir()
        lock = {"pid": holder.pid, "host": socket.gethostname(), "started": "earlier",
                "process_start": psutil.Process(holder.pid).create_time(), "launcher_pid": None, "command": "x"}
        (run_dir / ".dstune-run.lock").write_text(json.dumps(lock))
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        refused = _one_process(write_spec(tmp_path / "held.yaml", base_spec(run_dir)), MASTER_PORT=str(port))
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 1, refused.stderr
    assert f"output.dir {run_dir} is in use by a run that is still going: pid {holder.pid}" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".dstune-run.lock"]  # nothing written over the live run

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        busy = server.getsockname()[1]
        result = _one_process(write_spec(tmp_path / "port.yaml", base_spec(tmp_path / "port-run")),
                              MASTER_PORT=str(busy))
    assert result.returncode == 1, result.stderr
    assert f"master port {busy} on 127.0.0.1 is already in use" in result.stderr
    assert "Traceback" not in result.stderr and "EADDRINUSE" not in result.stderr
