"""What the user sees and what gets recorded: rank 0's progress display and the metrics JSONL file.

Other ranks stay quiet (N ranks printing N progress bars interleave into an unreadable log). On a terminal rank 0 shows a rich progress bar; in a log file
(CI, slurm) it prints one plain line every few steps instead of redrawing a bar nobody sees.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Optional


class MetricsFile:
    """Appends one JSON object per logged optimizer step; flushed each time so a crash loses nothing logged. The
    same numbers (and the sample outputs) go to `trackers` (dstune.trackers: TensorBoard, W&B) when given."""

    def __init__(self, path: Path, enabled: bool, trackers=None):
        self.enabled = enabled
        self.handle = open(path, "a", encoding="utf-8") if enabled else None
        self.trackers = trackers if enabled else None

    def write(self, record: dict) -> None:
        if self.handle is not None:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()
        if self.trackers is not None:
            self.trackers.scalars(record)

    def samples(self, step: int, path: Path) -> None:
        if self.trackers is not None:
            self.trackers.samples(step, path)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (a resumed run's earlier steps included); a torn last line is skipped."""
    records = []
    if not Path(path).is_file():
        return records
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class ProgressDisplay:
    def __init__(self, enabled: bool, total_steps: int, total_epochs: float, start_step: int):
        self.enabled = enabled
        self.total_steps = total_steps
        self.total_epochs = total_epochs
        self.interactive = enabled and sys.stdout.isatty()
        self.print_every = max(1, total_steps // 20)
        self.started = time.perf_counter()
        self.start_step = start_step
        self._progress = None
        self._task = None
        if self.interactive:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")

    def update(
        self, step: int, epoch: int, samples_seen: int, loss: float, lr: float, samples_per_s: float, parts=None
    ) -> None:
        """One step's line; `parts`: the loss's named parts ({"video": ..., "audio": ...}), shown after it."""
        if not self.enabled:
            return
        epochs_total = max(1, math.ceil(self.total_epochs - 1e-9))  # max_steps may end inside an epoch
        shares = ", ".join(f"{name} {value:.4f}" for name, value in (parts or {}).items())
        info = (
            f"epoch {min(epoch + 1, epochs_total)}/{epochs_total}  "
            f"samples {samples_seen}  loss {loss:.4f}{f' ({shares})' if shares else ''}  lr {lr:.3g}  "
            f"{samples_per_s:.1f} samples/s"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        elif step % self.print_every == 0 or step == self.total_steps or step == self.start_step + 1:
            print(f"step {step}/{self.total_steps}  {info}  {self.timing_text(step)}", flush=True)

    def timing_text(self, step: int) -> str:
        """Elapsed and ETA; the speed is measured over this process's own steps, so after a resume it is the speed
        since the resume (the ETA never counts the steps the checkpoint already held as fast ones)."""
        elapsed = time.perf_counter() - self.started
        done = step - self.start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 else None
        return f"elapsed {fmt_seconds(elapsed)}  eta {fmt_seconds(eta)}"

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def fmt_seconds(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def time_split_text(timings: dict, cached: bool = False) -> str:
    """The end-of-run line on where step time went: `timings` holds the loop's data_s and compute_s totals;
    `cached`: the run trained from data.cache (its entries, not the files, were read), which changes what helps."""
    data_s, compute_s = timings["data_s"], timings["compute_s"]
    fraction = data_s / max(data_s + compute_s, 1e-9)
    advice = ""
    if fraction > 0.05 and cached:  # the loader, not the model, set the pace: say what helps
        advice = (
            " - the loader is a bottleneck even reading the cache: raise data.num_workers, or put "
            "data.cache.dir on faster local storage"
        )
    elif fraction > 0.05:
        advice = (
            " - the loader is a bottleneck: raise data.num_workers, store the images pre-resized near "
            "data.resolution, or turn on data.cache"
        )
    return (
        f"waiting for data {fmt_seconds(data_s)} ({100 * fraction:.1f}% of step time), "
        f"compute {fmt_seconds(compute_s)}{advice}"
    )


class CountProgress:
    """Progress of a long count on stderr (stdout may be --json): silent while it takes less than `after_s`
    seconds, then one line every `every_s` seconds and one when it is done, e.g. "data.path: checked 1200 of 5000
    images (4 s)"."""

    def __init__(self, doing: str, what: str, total: int, after_s: float = 2.0, every_s: float = 5.0):
        self.doing, self.what, self.total = doing, what, total
        self.after_s, self.every_s = after_s, every_s
        self.started = time.monotonic()
        self.shown: Optional[float] = None  # when the last line was printed

    def update(self, done: int) -> None:
        now = time.monotonic()
        due = now - self.started >= self.after_s if self.shown is None else now - self.shown >= self.every_s
        if due or (done == self.total and self.shown is not None):
            self.shown = now
            print(
                f"{self.doing} {done} of {self.total} {self.what} ({now - self.started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
