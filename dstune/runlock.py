"""One live run per run folder: the lock file `output.dir/.dstune-run.lock`.

Two runs writing one output.dir would overwrite each other's checkpoints, metrics and samples. Global rank 0 (the
only rank that takes it: output.dir may be shared storage that every node sees) creates the file atomically
(O_CREAT | O_EXCL) with its pid, host and process start time, and removes it when the rank ends, however it ends
short of SIGKILL. A lock whose process is gone (same host, pid dead or reused by another process) is stale and is
taken over with a note; a lock held on another host cannot be checked from here, so it is refused with the way out.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import psutil

LOCK_NAME = ".dstune-run.lock"


@dataclass(frozen=True)
class LockHolder:
    pid: int  # the process holding the lock (global rank 0)
    host: str
    started: str  # local time, for people
    process_start: float  # psutil's create_time of pid: tells a live holder from a later process with the same pid
    launcher_pid: Optional[int]  # `dstune train`'s pid when it started the run (the process to stop)
    command: str


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def this_process(command: str) -> LockHolder:
    launcher = os.environ.get("DSTUNE_TRAIN_PID")
    return LockHolder(
        os.getpid(),
        socket.gethostname(),
        time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        psutil.Process().create_time(),
        int(launcher) if launcher and launcher.isdigit() else None,
        command,
    )


def read_holder(run_dir: Path) -> Optional[LockHolder]:
    """The lock's holder, or None when there is no lock. A lock file that cannot be parsed counts as held by an
    unknown process on an unknown host (it is not taken over silently)."""
    try:
        data = json.loads(lock_path(run_dir).read_text())
        return LockHolder(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        return LockHolder(-1, "?", "?", 0.0, None, "?")


def holder_alive(holder: LockHolder) -> Optional[bool]:
    """True / False for a holder on this host; None when it is on another host (not checkable from here)."""
    if holder.host != socket.gethostname():
        return None
    try:
        return abs(psutil.Process(holder.pid).create_time() - holder.process_start) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def _who(holder: LockHolder) -> str:
    launcher = f", started by `dstune train` pid {holder.launcher_pid}" if holder.launcher_pid else ""
    return f"pid {holder.pid} on host {holder.host} (since {holder.started}{launcher})"


def in_use_problem(run_dir: Path) -> Optional[str]:
    """Why a new run cannot use `run_dir` now, or None (no lock, or a stale one that the new run takes over)."""
    holder = read_holder(run_dir)
    if holder is None:
        return None
    alive = holder_alive(holder)
    if alive is False:
        return None
    folder = Path(run_dir)
    if alive is None:
        return (
            f"output.dir {folder} is locked by a run on another host: {_who(holder)}; dstune cannot check a "
            f"process on another host. If that run is still going, stop it first or choose another output.dir "
            f"(--set output.dir=...). If it is over (its node went down), delete {lock_path(folder)} and start "
            "again."
        )
    stop_pid = holder.launcher_pid or holder.pid
    return (
        f"output.dir {folder} is in use by a run that is still going: {_who(holder)}. Two runs in one folder "
        f"would overwrite each other's checkpoints. Stop that run first (kill -INT {stop_pid}; it stops at "
        "its next step and says how to continue), or choose another output.dir (--set output.dir=...)."
    )


_held: list[tuple[Path, str]] = []  # (lock file, its text) taken by this process


def take(run_dir: Path, command: str) -> tuple[Optional[str], Optional[str]]:
    """(error, note). Creates the lock for this process; a stale lock is replaced (the note says so)."""
    path = lock_path(run_dir)
    note = None
    problem = in_use_problem(run_dir)
    if problem:
        return problem, None
    stale = read_holder(run_dir)
    if stale is not None:
        path.unlink(missing_ok=True)
        note = (
            f"output.dir {Path(run_dir)}: the earlier run that held it ({_who(stale)}) is gone without "
            "releasing it; took it over. Its complete checkpoints are kept (continue them with --resume latest)."
        )
    holder = this_process(command)
    text = json.dumps(asdict(holder), indent=2) + "\n"
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:  # another run took it between our check and now
        return in_use_problem(run_dir) or f"output.dir {Path(run_dir)}: another run has just locked it.", None
    except OSError as err:
        return f"output.dir {Path(run_dir)}: cannot create {path.name} ({err.strerror or err}).", None
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    _held.append((path, text))
    return None, note


def release_held() -> None:
    """Remove the locks this process took, if they are still ours. Safe to call more than once."""
    while _held:
        path, text = _held.pop()
        try:
            if path.read_text() == text:
                path.unlink()
        except OSError:
            pass
