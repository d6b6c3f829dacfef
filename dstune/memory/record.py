"""Measured memory of one rank, per phase, for the memory plan's "predicted next to measured".

    recorder = MemoryRecorder(predicted)      before the model is built: the process's baseline
    recorder.mark("load")                     the model loaded and placed (dstune.startup.load_trained_model)
    recorder.mark("cache")                    the caches built or verified (before the engine)
    recorder.mark("engine")                   deepspeed.initialize, the EMA, a resume
    recorder.mark("first_step")               the first optimizer step (a step phase of its own)
    recorder.mark("step")                     training steps since the last mark (before samples, at the end)
    recorder.mark("sample")                   samples rendered

Each mark closes a phase: it records the peak since the previous mark and resets the peak counters, so every
record is that phase's own peak: on a GPU torch.cuda.max_memory_allocated() (what the memory plan's per-GPU
phase predicts, less the runtime reserve), always the process's peak resident set size (VmHWM in
/proc/self/status, reset through /proc/self/clear_refs; where that cannot be reset the peak is the run's so far,
and `rss_peak_reset` says so). On the CPU accelerator the model lives in host memory, so the RSS growth over the
baseline is what compares with the prediction; the baseline already holds torch, DeepSpeed, the process group and
the model's classes (dstune.memory.counts.import_model_classes).

`phase_peaks` maps the plan's phases (load, cache, step, sample) to the largest measured peak of each: the engine's
set-up counts as the step's (DeepSpeed's states without activations). The folders are resolved before the baseline
(dstune.startup.resolve_model_folders): making a built-in model or converting a single checkpoint file is not the
training's memory.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Optional


def _status_bytes(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """This process's resident set size now."""
    return _status_bytes("VmRSS") or peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_kinds() -> dict:
    """The resident set now by kind (Linux): anonymous memory (tensors, the allocator's heap), file pages mapped
    (libraries, memory-mapped weights) and shared memory (DeepSpeed's shm all-reduce workspaces); what explains a
    phase's RSS beside the plan."""
    return {f"rss_{kind.lower()}_bytes": _status_bytes(f"Rss{kind}") for kind in ("Anon", "File", "Shmem")}


def cuda_peak_bytes() -> Optional[int]:
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


def reset_peaks() -> bool:
    """Start a new peak: CUDA's peak statistics, and the process's peak RSS (Linux: writing 5 to clear_refs).
    Returns whether the RSS peak was reset."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


PLAN_PHASE = {
    "load": "load",
    "cache": "cache",
    "engine": "step",
    "first_step": "step",
    "step": "step",
    "sample": "sample",
}


@dataclass
class MemoryRecorder:
    predicted: Optional[dict] = None  # dstune.memory.plan.memory_json of this run (None: no config files)
    baseline_rss_bytes: int = field(default_factory=rss_bytes)
    phases: list = field(default_factory=list)
    rss_peak_reset: bool = True
    baseline_kinds: dict = field(default_factory=rss_kinds)

    def mark(self, phase: str) -> dict:
        """Close the phase `phase` (one of PLAN_PHASE): its peak since the previous mark, then a new peak."""
        record = {
            "phase": phase,
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_bytes": rss_bytes(),
            "cuda_peak_allocated_bytes": cuda_peak_bytes(),
            **rss_kinds(),
        }
        record["rss_growth_bytes"] = record["peak_rss_bytes"] - self.baseline_rss_bytes
        self.phases.append(record)
        self.rss_peak_reset = reset_peaks() and self.rss_peak_reset
        return record

    def phase_peaks(self) -> dict:
        """The plan's phase -> the largest peak measured in it (CUDA allocated on a GPU, else RSS growth)."""
        peaks: dict = {}
        for record in self.phases:
            name = PLAN_PHASE.get(record["phase"])
            cuda = record["cuda_peak_allocated_bytes"]
            value = cuda if cuda is not None else record["rss_growth_bytes"]
            if name is not None:
                peaks[name] = max(peaks.get(name, value), value)
        return peaks

    def peak_bytes(self) -> int:
        """The figure to put beside the prediction, now: the largest phase peak so far and the current one."""
        cuda = cuda_peak_bytes()
        now = cuda if cuda is not None else peak_rss_bytes() - self.baseline_rss_bytes
        return max([now, *self.phase_peaks().values()])

    def _reserve_outside(self) -> int:
        """The runtime reserve where the measurement cannot see it: on a GPU the CUDA context and NCCL lie outside
        max_memory_allocated, so the prediction it is held to leaves the reserve out; on the CPU accelerator the
        reserve is the host memory a rank's RSS gains beyond the tensors (dstune.memory.plan), which RSS sees."""
        return self.predicted["per_gpu"].get("runtime_reserve_bytes", 0) if cuda_peak_bytes() is not None else 0

    def predicted_bytes(self) -> Optional[int]:
        """The predicted per-GPU peak as the measurement sees it (on a GPU without the runtime reserve)."""
        if not self.predicted or not self.predicted.get("per_gpu"):
            return None
        peak = self.predicted.get("peak_per_gpu_bytes", self.predicted["per_gpu"]["total_bytes"])
        return peak - self._reserve_outside()

    def predicted_phases(self) -> dict:
        """The plan's phase -> its predicted per-GPU bytes as the measurement sees them (predicted_bytes)."""
        if not self.predicted or not self.predicted.get("phases"):
            return {}
        reserve = self._reserve_outside()
        return {name: phase["per_gpu_bytes"] - reserve for name, phase in self.predicted["phases"].items()}

    def as_dict(self, rank: int) -> dict:
        return {
            "rank": rank,
            "baseline_rss_bytes": self.baseline_rss_bytes,
            "baseline": self.baseline_kinds,
            "phases": self.phases,
            "phase_peaks": self.phase_peaks(),
            "rss_peak_reset": self.rss_peak_reset,
        }


def phase_table(predicted: dict, records: list[dict]) -> dict:
    """memory.json's `phases`: per plan phase, the prediction and the largest measured peak over the ranks."""
    names = [
        name
        for name in ("load", "cache", "step", "sample")
        if name in predicted or any(name in r["phase_peaks"] for r in records)
    ]
    return {
        name: {
            "predicted_bytes": predicted.get(name),
            "measured_max_bytes": max(
                (r["phase_peaks"][name] for r in records if name in r["phase_peaks"]), default=None
            ),
        }
        for name in names
    }


def summary_text(predicted: Optional[int], records: list[dict], phases: Optional[dict] = None) -> str:
    """One line for the end of a run: the predicted peak per rank, then per phase predicted / measured (the largest
    over the ranks: CUDA peak allocated on a GPU, else the RSS growth over each rank's baseline)."""

    def mb(value) -> str:
        return "?" if value is None else f"{value / 1e6:.0f} MB"

    cuda = any(r["phases"] and r["phases"][-1]["cuda_peak_allocated_bytes"] is not None for r in records)
    what = "CUDA peak allocated" if cuda else "peak RSS growth"
    per_phase = "; ".join(
        f"{name} {mb(row['predicted_bytes'])} / {mb(row['measured_max_bytes'])}" for name, row in (phases or {}).items()
    )
    return (
        f"memory: predicted {mb(predicted)} per rank at the peak; per phase predicted / measured ({what}, "
        f"largest rank): {per_phase or 'none recorded'} (memory.json)"
    )
