"""A run's checkpoint folder as files: where each checkpoint is, which one is "latest", and dstune's state file.
Torch-free, so `dstune validate --resume-from` and `dstune train`'s closing line read a checkpoint without torch.

Layout under RUN/checkpoints/:
    step-00000100/            DeepSpeed shards (mp_rank_*, zero_pp_rank_*), dstune_rank{R}.pt (RNG), dstune_state.json
    latest                    the tag of the newest COMPLETE checkpoint (same format DeepSpeed and zero_to_fp32 read)
A crash while saving leaves `latest` on the previous checkpoint; the half-written folder is removed at the next save
of the same tag and never loaded (no dstune_state.json, which is written last). Writing and loading one:
dstune.checkpoints.store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

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


def resolve_resume(run_dir: Path, resume: str) -> tuple[Path, str]:
    """`latest` or a checkpoint folder path -> (checkpoints root, tag); CheckpointError with the fix otherwise."""
    if resume == "latest":
        root = checkpoint_root(run_dir)
        tag = read_latest(root)
        if tag is None:
            raise CheckpointError(
                f"--resume latest: no complete checkpoint in {root} (nothing to resume; drop --resume to start fresh)"
            )
        return root, tag
    path = Path(resume)
    if (path / STATE_FILE).is_file():
        return path.parent, path.name
    raise CheckpointError(
        f"--resume {resume}: not a complete dstune checkpoint folder (no {STATE_FILE}); "
        f"give `latest` or a folder like {checkpoint_root(run_dir)}/{tag_for(100)}"
    )


def read_state(root: Path, tag: str) -> dict:
    return json.loads((root / tag / STATE_FILE).read_text())
