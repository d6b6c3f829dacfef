"""SIGINT and SIGTERM on a training rank: Ctrl-C, `kill`, `dstune train` forwarding a stop, or DeepSpeed's launcher
stopping the ranks.

Inside the training loop (`at_step_boundaries`) a signal only sets a flag: the ranks exchange their flags with the
per-step loss exchange the loop already does, so all of them stop after the same step, and no rank leaves a
collective its peers are still in. Anywhere else (start-up, the final save and export) a signal raises
KeyboardInterrupt at once, which the entry point (dstune/train.py) turns into one line instead of a traceback per
rank. Checkpoints are written atomically (dstune/checkpoints/store.py), so a rank killed at any moment leaves the last
complete checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import os
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the stop signals this process received, in order
_deferred = [False]  # True while the loop is between step boundaries and will look at the flag itself


def _on_stop_signal(signum, frame) -> None:
    _received.append(signum)
    if not _deferred[0]:
        raise KeyboardInterrupt


def install_stop_handlers() -> None:
    """Call once, from the main thread, before anything slow (imports included)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_stop_signal)


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


def launched_by_dstune_train() -> bool:
    """True when `dstune train` started this rank: it prints the resume command itself once every rank is gone."""
    return "DSTUNE_TRAIN_PID" in os.environ
