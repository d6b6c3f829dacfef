"""`dstune train`: start DeepSpeed's launcher on a validated spec, stop every rank when asked, say how to continue.

    dstune train (this process: the one a user, a wrapper or a supervisor starts and signals)
      └─ python -m deepspeed.launcher.runner ... --module dstune.train SPEC ...   (own session: no terminal signals)
           └─ python -m deepspeed.launcher.launch ...                           (one per node)
                └─ python -m dstune.train --local_rank=N SPEC ...               (the ranks)

DeepSpeed's runner does not pass SIGINT/SIGTERM on for a one-node launch (it dies and leaves the ranks running), and
its per-node launcher answers one with SIGTERM to one rank after another. So the runner runs in its own session,
which keeps a terminal's Ctrl-C away from every process below this one, and this process sends the stop signal to
each rank itself: they stop together at the next step boundary (dstune/interrupts.py). A rank is signalled once it
has marked itself ready in the stop folder the ranks share with this process (DSTUNE_STOP_DIR), where the stop is
written first: a rank still starting finds it there. A rank that stops because this process asked exits 0, so that
DeepSpeed's per-node launcher does not take it for a failed rank (stopping the others, printing its argv); this
process then reports the stop and exits 130 (143 for SIGTERM). When they are not all gone
after the grace period (or at a second Ctrl-C), everything below this process gets SIGKILL; checkpoints are atomic,
so the last complete one stays usable. Multi-node launches (pdsh) have their ranks on other hosts: there the signal
goes to the runner's process group, and DeepSpeed's pdsh runner kills the ranks on every node.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from dstune.interrupts import STOP_DIR_ENV, STOP_FILE, ready_name

EXIT_OK, EXIT_FAILED = 0, 1
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DEFAULT_GRACE_S = 60
RANK_SETTLE_S = 30.0  # a rank not marked ready by then (a rank without dstune's handlers) is signalled anyway

# dstune train's flags -> DeepSpeed runner flags (same meaning; DeepSpeed's spelling).
RUNNER_FLAGS = (
    ("hostfile", "--hostfile"),
    ("include", "--include"),
    ("exclude", "--exclude"),
    ("num_nodes", "--num_nodes"),
    ("num_gpus", "--num_gpus"),
    ("master_addr", "--master_addr"),
    ("launcher", "--launcher"),
)


def train_arguments(args) -> list[str]:
    """What every rank gets after `--module dstune.train` (dstune/train.py's own flags)."""
    out = [args.spec]
    for override in args.overrides:
        out += ["--set", override]
    if args.resume:
        out += ["--resume", args.resume]
    out += [
        flag
        for flag, on in (
            ("--allow-batch-change", args.allow_batch_change),
            ("--allow-spec-changes", args.allow_spec_changes),
            ("--cache-only", args.cache_only),
            ("--verbose", getattr(args, "verbose", False)),
        )
        if on
    ]
    return out


def runner_command(args, master_port: int, num_gpus: Optional[int] = None, python: str = sys.executable) -> list[str]:
    """The `python -m deepspeed.launcher.runner` command line. `num_gpus` fills --num_gpus when no world flag was
    given (the world dstune validated, so the launch starts exactly those ranks)."""
    # The launcher's own INFO lines (world info, each spawned command) only repeat what dstune prints; errors stay.
    cmd = [python, "-u", "-m", "deepspeed.launcher.runner", "--log_level", "error"]
    for name, flag in RUNNER_FLAGS:
        value = getattr(args, name, None)
        if name == "num_gpus" and value is None:
            value = num_gpus
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + ["--master_port", str(master_port), "--module", "dstune.train", *train_arguments(args)]


def resume_command(args) -> str:
    """The exact `dstune train` line that continues this run from its newest complete checkpoint."""
    words = ["dstune", "train", args.spec]
    for name, flag in (
        ("num_gpus", "--num-gpus"),
        ("num_nodes", "--num-nodes"),
        ("hostfile", "--hostfile"),
        ("include", "--include"),
        ("exclude", "--exclude"),
        ("master_addr", "--master-addr"),
        ("master_port", "--master-port"),
        ("launcher", "--launcher"),
    ):
        if getattr(args, name, None) is not None:
            words += [flag, str(getattr(args, name))]
    for override in args.overrides:
        words += ["--set", override]
    words += [
        flag
        for flag, on in (
            ("--allow-batch-change", args.allow_batch_change),
            ("--allow-spec-changes", args.allow_spec_changes),
        )
        if on
    ]
    return shlex.join(words + ["--resume", "latest"])


# ------------------------------------------------------------------------------------------------ the master port


def port_in_use(port: int) -> bool:
    """Whether a process listens on `port` here. SO_REUSEADDR as torch's TCPStore sets it, so a port that a finished
    run left in TIME_WAIT counts as free, exactly when the store could bind it."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice). Another program could take it before the ranks start;
    then rank 0 says so (dstune.distributed.busy_port_text)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def busy_port_message(port: int) -> str:
    return (
        f"--master-port {port}: that port is already in use on this machine (another run, or another program), "
        "so the ranks could not meet there; nothing was launched. Pick another port, or leave --master-port out "
        "and dstune train picks a free one."
    )


# ------------------------------------------------------------------------------------------------ supervising


@dataclass
class RunEnd:
    returncode: int
    stop_signal: Optional[int] = None  # the first SIGINT/SIGTERM/SIGHUP this process received
    killed: list = field(default_factory=list)  # pids that got SIGKILL after the grace period


def _rank_processes(runner: psutil.Process) -> list[psutil.Process]:
    """The training ranks started below the runner on this machine (`python -m dstune.train --local_rank=N`)."""
    ranks = []
    try:
        descendants = runner.children(recursive=True)
    except psutil.Error:
        return ranks
    for process in descendants:
        try:
            line = process.cmdline()
        except psutil.Error:
            continue
        if any(
            word in ("dstune.train", "dstune/train.py") or word.endswith("/dstune/train.py") for word in line
        ) and any(word.startswith("--local_rank") for word in line):
            ranks.append(process)
    return ranks


class Supervisor:
    """Runs the launcher command and forwards stop signals (see the module docstring)."""

    def __init__(self, cmd: list[str], env: dict, grace_s: float, multi_node: bool, say=print):
        self.cmd, self.env, self.grace_s, self.multi_node = cmd, env, grace_s, multi_node
        self.say = _never_raising(say)
        self.received: list[int] = []
        self.seen: dict[int, psutil.Process] = {}  # every rank process seen, by pid
        self.signalled: set[int] = set()
        self.stop_dir: Optional[Path] = None

    def _on_signal(self, signum, frame) -> None:
        self.received.append(signum)

    def run(self) -> RunEnd:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in FORWARDED_SIGNALS}
        try:
            with tempfile.TemporaryDirectory(prefix="dstune-stop-") as folder:
                self.stop_dir = Path(folder)
                self.env = {**self.env, STOP_DIR_ENV: folder}
                return self._run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _run(self) -> RunEnd:
        runner_proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True)
        runner = psutil.Process(runner_proc.pid)
        outcome = RunEnd(returncode=0)
        deadline = None
        while runner_proc.poll() is None:
            for process in _rank_processes(runner):
                self.seen.setdefault(process.pid, process)
            if self.received:
                if deadline is None:
                    outcome.stop_signal = self.received[0]
                    deadline = time.monotonic() + self.grace_s
                    self.say(
                        f"dstune train: {signal.Signals(self.received[0]).name}: stopping every rank at its next "
                        f"step (at most {self.grace_s:g} s; Ctrl-C again to stop them at once)",
                        flush=True,
                    )
                self._forward(runner_proc, self.received[0])
                if len(self.received) > 1 or time.monotonic() > deadline:
                    outcome.killed = self._kill_all(runner)
                    break
            time.sleep(0.2)
        outcome.returncode = runner_proc.wait()
        left = [p for p in self.seen.values() if _alive(p)]
        if left:  # a rank outlived the launcher (its per-node launcher was killed): it must not train on headless
            outcome.killed += self._stop_leftovers(left)
        return outcome

    def _forward(self, runner_proc: subprocess.Popen, signum: int) -> None:
        if self.multi_node:
            if runner_proc.pid not in self.signalled:
                self.signalled.add(runner_proc.pid)
                _send(lambda: os.killpg(runner_proc.pid, signal.SIGINT))
            return
        # SIGINT also for SIGHUP: the ranks stop the same way. The stop is written first; then each rank that has
        # marked itself ready (its handlers are set: dstune/train.py does that first thing) is signalled. A rank
        # not ready yet finds the stop when it gets ready (dstune.interrupts.install_stop_handlers).
        forwarded = signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT
        stop_file = self.stop_dir / STOP_FILE
        if not stop_file.exists():
            stop_file.write_text(str(int(forwarded)))
        settled_before = time.time() - RANK_SETTLE_S
        for pid, process in self.seen.items():
            ready = (self.stop_dir / ready_name(pid)).exists() or _started_before(process, settled_before)
            if pid not in self.signalled and ready:
                self.signalled.add(pid)
                _send(lambda: process.send_signal(forwarded))

    def _kill_all(self, runner: psutil.Process) -> list[int]:
        why = "a second stop signal" if len(self.received) > 1 else f"still running after {self.grace_s:g} s"
        try:
            targets = runner.children(recursive=True) + [runner]
        except psutil.Error:
            targets = [runner]
        targets += [p for p in self.seen.values() if p not in targets]
        killed = [p.pid for p in targets if _alive(p)]
        for process in targets:
            _send(process.kill)
        psutil.wait_procs(targets, timeout=10)
        self.say(
            f"dstune train: {why}: killed the launcher and every rank (SIGKILL, pids "
            f"{', '.join(map(str, killed))}). Checkpoints are written atomically: the last complete one is "
            "intact.",
            flush=True,
        )
        return killed

    def _stop_leftovers(self, left: list[psutil.Process]) -> list[int]:
        for process in left:
            _send(lambda: process.send_signal(signal.SIGINT))
        _, alive = psutil.wait_procs(left, timeout=self.grace_s)
        for process in alive:
            _send(process.kill)
        if alive:
            self.say(
                f"dstune train: ranks {', '.join(str(p.pid) for p in alive)} outlived their launcher: killed "
                "(SIGKILL).",
                flush=True,
            )
        return [p.pid for p in alive]


def _started_before(process: psutil.Process, moment: float) -> bool:
    try:
        return process.create_time() < moment
    except psutil.Error:
        return True  # gone: sending it a signal does nothing


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _send(action) -> None:
    try:
        action()
    except (psutil.Error, ProcessLookupError, PermissionError):
        pass  # already gone


# ------------------------------------------------------------------------------------------------ the whole command


def rank_environment() -> dict:
    """The ranks' environment: ours, plus this process's pid (rank 0 records it in the run folder's lock, so a
    refused second run names the process to stop), and, for a checkout that is not installed, the folder dstune is
    imported from (the ranks run `python -m dstune.train` from the user's folder)."""
    env = dict(os.environ)
    env["DSTUNE_TRAIN_PID"] = str(os.getpid())
    env.setdefault("PYTHONUNBUFFERED", "1")
    package_parent = str(Path(__file__).resolve().parent.parent)
    if not _importable_without_path(package_parent):
        env["PYTHONPATH"] = os.pathsep.join([package_parent, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _importable_without_path(folder: str) -> bool:
    """True when `folder` is one of the interpreter's own site folders (an installed dstune)."""
    import site

    sites = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return folder in sites


def final_line(outcome: RunEnd, run_dir: Path, args) -> str:
    """The last line: how the run ended, its newest complete checkpoint, and the command that continues it."""
    from dstune.checkpoints.layout import checkpoint_root, read_latest, read_state

    root = checkpoint_root(run_dir)
    try:
        tag = read_latest(root)
        step = read_state(root, tag)["state"]["global_step"] if tag else None
    except (OSError, ValueError, KeyError):
        tag = step = None
    if outcome.stop_signal is not None:
        how = f"interrupted ({signal.Signals(outcome.stop_signal).name}, exit {exit_code(outcome)})"
    elif outcome.returncode == 0:
        return (
            f"dstune train: finished; last checkpoint {root / tag} (step {step})" if tag else "dstune train: finished"
        )
    else:
        how = f"failed (exit {outcome.returncode}; the ranks' messages above say why)"
    if tag is None:
        again = "start again with" if outcome.stop_signal is not None else "once that is fixed, start again with"
        return (
            f"dstune train: {how}; no checkpoint was written yet; {again}: "
            f"{resume_command(args).removesuffix(' --resume latest')}"
        )
    again = "continue with" if outcome.stop_signal is not None else "once that is fixed, continue with"
    return f"dstune train: {how}; last complete checkpoint {root / tag} (step {step}); {again}: {resume_command(args)}"


def exit_code(outcome: RunEnd) -> int:
    """0 finished; 128 + the signal (130 SIGINT, 143 SIGTERM, 129 SIGHUP) when stopped by one; else the ranks'."""
    if outcome.stop_signal is not None:
        return 128 + outcome.stop_signal
    return outcome.returncode if outcome.returncode >= 0 else 128 - outcome.returncode


def _never_raising(say):
    """A closed output (`dstune train ... | tee log`, and Ctrl-C ended tee too) must not end the supervision while
    the ranks run: what cannot be printed is dropped."""

    def say_or_drop(*args, **kwargs) -> None:
        try:
            say(*args, **kwargs)
        except (OSError, ValueError):  # BrokenPipeError; ValueError: a closed file
            pass

    return say_or_drop


def launch(args, run_dir: Path, world, say=print) -> int:
    """Start the ranks (args: the parsed `dstune train` flags; world: the validated World) and wait for them."""
    say = _never_raising(say)
    if args.master_port is not None:
        if world.num_nodes == 1 and port_in_use(args.master_port):
            say(f"dstune train: {busy_port_message(args.master_port)}", file=sys.stderr)
            return EXIT_FAILED
        port = args.master_port
    else:
        port = free_port()
        where = "this machine" if world.num_nodes == 1 else "this machine (the master is the first host)"
        say(f"dstune train: master port {port} (free on {where}; choose one with --master-port)", flush=True)
    no_world_flag = all(getattr(args, n) is None for n in ("num_gpus", "hostfile", "include", "exclude", "num_nodes"))
    cmd = runner_command(args, port, num_gpus=world.world_size if no_world_flag else None)
    supervisor = Supervisor(cmd, rank_environment(), args.grace, world.num_nodes > 1, say)
    outcome = supervisor.run()
    say(final_line(outcome, run_dir, args), flush=True)
    return exit_code(outcome)
