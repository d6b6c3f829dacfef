"""SIGINT and SIGTERM on a training rank: Ctrl-C, `kill`, `dstune train` forwarding a stop, or DeepSpeed's launcher
stopping the ranks.

Inside the training loop (`at_step_boundaries`) a signal only sets a flag: the ranks exchange their flags with the
per-step loss exchange the loop already does, so all of them stop after the same step, and no rank leaves a
collective its peers are still in. Anywhere else (start-up, the final save and export) a signal raises
KeyboardInterrupt at once, which the entry point (dstune/train.py) turns into one line instead of a traceback per
rank. Only one signal raises: a later one (DeepSpeed's per-node launcher stopping the ranks that are left) must
not interrupt the rank's own handling of the first. Checkpoints are written atomically (dstune/checkpoints/store.py),
so a rank killed at any moment leaves the last complete checkpoint as it was.

`dstune train` and its ranks share a folder (DSTUNE_STOP_DIR): a rank marks itself ready there once its handlers are
in place, and `dstune train` writes the stop there before it signals the ready ranks. So a stop that comes while a
rank is still starting Python is neither lost nor a traceback (the rank finds it when it gets ready), and a rank that
stopped because `dstune train` asked it to exits 0: DeepSpeed's per-node launcher then neither stops the other ranks
nor prints its own error line, and `dstune train` reports the stop (exit 130) once they are all gone.
"""

from __future__ import annotations

import contextlib
import os
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the stop signals this process received, in order
_deferred = [False]  # True while the loop is between step boundaries and will look at the flag itself
STOP_DIR_ENV = "DSTUNE_STOP_DIR"  # set by `dstune train` for its ranks
STOP_FILE = "stop"  # written there by `dstune train` (the signal's number) before it signals the ranks


_raised = [False]  # a stop signal has raised KeyboardInterrupt already: the rank is on its way out


def _on_stop_signal(signum, frame) -> None:
    _received.append(signum)
    if not _deferred[0] and not _raised[0]:
        _raised[0] = True
        raise KeyboardInterrupt


def install_stop_handlers() -> None:
    """Call once, from the main thread, before anything slow (imports included). Under `dstune train`, the rank then
    marks itself ready, and a stop that came before is taken now."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_stop_signal)
    folder = os.environ.get(STOP_DIR_ENV)
    if not folder:
        return
    try:
        with open(os.path.join(folder, ready_name(os.getpid())), "w"):
            pass
    except OSError:
        return  # `dstune train` then signals this rank after its settling time
    forwarded = forwarded_stop()
    if forwarded is not None and not _received:
        _on_stop_signal(forwarded, None)


def ready_name(pid: int) -> str:
    return f"ready-{pid}"


def forwarded_stop() -> int | None:
    """The signal `dstune train` forwarded to its ranks (from DSTUNE_STOP_DIR), or None."""
    folder = os.environ.get(STOP_DIR_ENV)
    if not folder:
        return None
    try:
        with open(os.path.join(folder, STOP_FILE)) as handle:
            return int(handle.read().strip() or signal.SIGINT)
    except (OSError, ValueError):
        return None


def finishing_stop() -> None:
    """The stop is being handled now (the rank's last words): further signals are only noted."""
    _deferred[0] = True


def stop_requested() -> bool:
    return bool(_received)


def exit_code_for_stop() -> int:
    """128 + the first stop signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a signalled
    process: the run did not finish."""
    return 128 + (_received[0] if _received else signal.SIGINT)


def stop_signal_name() -> str:
    return signal.Signals(_received[0]).name if _received else "SIGINT"


@contextlib.contextmanager
def at_step_boundaries():
    """While inside, a stop signal is only recorded; the loop stops at its next step boundary."""
    _deferred[0] = True
    try:
        yield
    finally:
        _deferred[0] = False


def rank_exit_code_for_stop() -> int:
    """A rank's exit code after a stop: 0 when `dstune train` forwarded it (it reports the stop itself, with 130 or
    143, once every rank is gone; DeepSpeed's launcher would take any other code for a failed rank), else
    `exit_code_for_stop()`."""
    return 0 if forwarded_stop() is not None else exit_code_for_stop()


def launched_by_dstune_train() -> bool:
    """True when `dstune train` started this rank: it prints the resume command itself once every rank is gone."""
    return "DSTUNE_TRAIN_PID" in os.environ
