"""Checkpoints: DeepSpeed's shards plus dstune's own state, made "latest" only once complete on every rank.

Layout under RUN/checkpoints/:
    step-00000100/            DeepSpeed shards (mp_rank_*, zero_pp_rank_*), dstune_rank{R}.pt (RNG), dstune_state.json
    latest                    the tag of the newest COMPLETE checkpoint (same format DeepSpeed and zero_to_fp32 read)
A crash while saving leaves `latest` on the previous checkpoint; the half-written folder is removed at the next save
of the same tag and never loaded (no dstune_state.json, which is written last).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from dstune.distributed import Run, all_gather_object, barrier

STATE_FILE = "dstune_state.json"


@dataclass
class TrainState:
    global_step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch the next micro batch comes from
    step_in_epoch: int = 0  # optimizer steps already done in that epoch
    samples_seen: int = 0  # global samples consumed


class CheckpointError(RuntimeError):
    pass


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def read_latest(root: Path) -> Optional[str]:
    latest = root / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag if (root / tag / STATE_FILE).is_file() else None


def list_complete(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / STATE_FILE).is_file())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(engine, run: Run, run_dir: Path, state: TrainState, extra: dict, keep_last: int) -> str:
    """Collective. Returns the tag. `extra` (spec, ds_config, plan) is stored beside the state for export/resume."""
    root = checkpoint_root(run_dir)
    tag = tag_for(state.global_step)
    if run.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if (root / tag).exists() and read_latest(root) != tag:
            shutil.rmtree(root / tag)  # leftovers of a save that crashed: never mixed with new shards
    barrier()
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    torch.save(_rng_state(), root / tag / f"dstune_rank{run.rank}.pt")
    # Each rank checks its own files (ranks may not share a filesystem); all must succeed before "latest" moves.
    mine_ok = (root / tag / f"dstune_rank{run.rank}.pt").is_file()
    if not all(all_gather_object(mine_ok)):
        raise CheckpointError(f"checkpoint {tag} is incomplete on some rank; 'latest' still points to the previous one")
    if run.is_main:
        payload = {"state": asdict(state), "world_size": run.world_size, "tag": tag, **extra}
        _write_atomic(root / tag / STATE_FILE, json.dumps(payload, indent=2, default=str))
        _write_atomic(root / "latest", tag)
        _prune(root, keep_last, keep=tag)
    barrier()
    return tag


def _prune(root: Path, keep_last: int, keep: str) -> None:
    complete = list_complete(root)
    for old in complete[:-keep_last]:
        if old != keep:
            shutil.rmtree(root / old, ignore_errors=True)


def resolve_resume(run_dir: Path, resume: str) -> tuple[Path, str]:
    """`latest` or a checkpoint folder path -> (checkpoints root, tag); CheckpointError with the fix otherwise."""
    if resume == "latest":
        root = checkpoint_root(run_dir)
        tag = read_latest(root)
        if tag is None:
            raise CheckpointError(f"--resume latest: no complete checkpoint in {root} (nothing to resume; drop --resume "
                                  "to start fresh)")
        return root, tag
    path = Path(resume)
    if (path / STATE_FILE).is_file():
        return path.parent, path.name
    raise CheckpointError(f"--resume {resume}: not a complete dstune checkpoint folder (no {STATE_FILE}); "
                          f"give `latest` or a folder like {checkpoint_root(run_dir)}/{tag_for(100)}")


def read_state(root: Path, tag: str) -> dict:
    return json.loads((root / tag / STATE_FILE).read_text())


def load_checkpoint(engine, run: Run, root: Path, tag: str) -> TrainState:
    """Collective. Restores weights, optimizer, LR schedule, RNG and the data position."""
    saved = read_state(root, tag)
    if saved["world_size"] != run.world_size:
        raise CheckpointError(
            f"checkpoint {root / tag} was written by {saved['world_size']} ranks; this run has {run.world_size}. "
            "ZeRO partitions optimizer state per rank, so it cannot be loaded on a different number of ranks. "
            f"Relaunch with {saved['world_size']} ranks, or export the weights (`dstune export {root.parent}`) and "
            "start a new run from the exported folder (model.pretrained).")
    path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {root / tag}")
    rng_file = root / tag / f"dstune_rank{run.rank}.pt"
    if rng_file.is_file():
        _restore_rng(torch.load(rng_file, weights_only=True))
    return TrainState(**saved["state"])
