"""Measured memory of one rank, per phase, for the memory plan's "predicted next to measured".

    recorder = MemoryRecorder(predicted)      before the model is built: the process's baseline
    recorder.mark("engine_start")             after deepspeed.initialize
    recorder.mark("caches_ready")             after the caches are built or verified
    recorder.mark("first_step")               after the first optimizer step
    recorder.mark("end")                      after training

Each mark keeps the peak so far: on a GPU torch.cuda.max_memory_allocated() (what the memory plan's per-GPU
total predicts, less the runtime reserve), always the process's peak resident set size (VmHWM in /proc/self/status,
else getrusage's ru_maxrss). On the CPU accelerator the model lives in host memory, so the RSS growth over the
baseline is what compares with the prediction; the baseline already holds torch, DeepSpeed, the process group and the model's classes
(dstune.memory.counts.import_model_classes).

The folders are resolved before the baseline (dstune.startup.resolve_model_folders): making a built-in model or
converting a single checkpoint file is not the training's memory.
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


def cuda_peak_bytes() -> Optional[int]:
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


@dataclass
class MemoryRecorder:
    predicted: Optional[dict] = None  # dstune.memory.plan.memory_json of this run (None: no config files)
    baseline_rss_bytes: int = field(default_factory=rss_bytes)
    phases: list = field(default_factory=list)

    def mark(self, phase: str) -> dict:
        record = {"phase": phase, "peak_rss_bytes": peak_rss_bytes(), "rss_bytes": rss_bytes(),
                  "cuda_peak_allocated_bytes": cuda_peak_bytes()}
        record["rss_growth_bytes"] = record["peak_rss_bytes"] - self.baseline_rss_bytes
        self.phases.append(record)
        return record

    def peak_bytes(self) -> int:
        """The figure to put beside the prediction, now: CUDA peak allocated on a GPU, else the peak RSS growth."""
        cuda = cuda_peak_bytes()
        return cuda if cuda is not None else peak_rss_bytes() - self.baseline_rss_bytes

    def predicted_bytes(self) -> Optional[int]:
        """The predicted per-GPU total without the runtime reserve (what an allocator's peak can be held to)."""
        if not self.predicted or not self.predicted.get("per_gpu"):
            return None
        gpu = self.predicted["per_gpu"]
        return gpu["total_bytes"] - gpu.get("runtime_reserve_bytes", 0)

    def as_dict(self, rank: int) -> dict:
        return {"rank": rank, "baseline_rss_bytes": self.baseline_rss_bytes, "phases": self.phases}


def summary_text(predicted: Optional[int], records: list[dict]) -> str:
    """One line for the end of a run: predicted per GPU beside every rank's measured peak."""
    def mb(value) -> str:
        return "?" if value is None else f"{value / 1e6:.0f} MB"

    measured = []
    for record in records:
        last = record["phases"][-1]
        cuda = last["cuda_peak_allocated_bytes"]
        measured.append(f"rank {record['rank']} " + (f"CUDA peak {mb(cuda)}" if cuda is not None else
                                                     f"peak RSS +{mb(last['rss_growth_bytes'])} over its baseline"))
    return f"memory: predicted {mb(predicted)} per rank; measured {', '.join(measured)} (memory.json)"
