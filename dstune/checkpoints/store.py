"""Checkpoints: DeepSpeed's shards plus dstune's own state, made "latest" only once complete on every rank; loading
one into an engine, with only weights unpickled. The folder layout and reading it without torch:
dstune.checkpoints.layout.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import random
import re
import secrets
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from dstune.checkpoints.layout import (
    STATE_FILE,
    CheckpointError,
    TrainState,
    checkpoint_root,
    list_complete,
    read_latest,
    read_state,
    tag_for,
)
from dstune.distributed import Run, all_gather_object, barrier
from dstune.ema import Ema
from dstune.fsutil import write_text_atomic

# The only non-tensor objects DeepSpeed 0.19 pickles into its checkpoint files (found with
# torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO 0-3 checkpoints): plain data, no code on load.
DEEPSPEED_CHECKPOINT_TYPES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _allowed_checkpoint_types() -> list:
    allowed = []
    for dotted in DEEPSPEED_CHECKPOINT_TYPES:
        module, _, name = dotted.rpartition(".")
        with contextlib.suppress(ImportError, AttributeError):
            allowed.append(getattr(importlib.import_module(module), name))
    return allowed


@contextlib.contextmanager
def only_tensors_unpickled(what: str):
    """Every torch.load inside, DeepSpeed's own included (they pass weights_only=False), loads weights only: tensors,
    containers and DEEPSPEED_CHECKPOINT_TYPES. A file that would import anything else (a malicious pickle runs code
    that way) is refused with CheckpointError before any of it runs. `what` names the checkpoint in the message."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_allowed_checkpoint_types()):
            yield
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{what}: refused to load a file that is not plain weights ({_unpickling_reason(err)}). dstune "
            "unpickles only tensors and DeepSpeed's own checkpoint types; a checkpoint that wants more was not "
            "written by dstune or was tampered with. Use checkpoints from a source you trust."
        ) from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def _unpickling_reason(err: Exception) -> str:
    """torch's weights-only refusal is many lines; keep the one naming what the file wanted to import."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
    if found:
        return f"it would import {found.group(1)}"
    lines = [line.strip() for line in str(err).splitlines() if "WeightsUnpickler error" in line]
    return lines[0] if lines else type(err).__name__


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


def leaves_frozen_out(module: torch.nn.Module) -> bool:
    """True for a module with frozen parameters (the base weights under LoRA): they are left out of checkpoints.
    They are the pretrained folder's, rebuilt on resume and export, and would make a LoRA checkpoint model-sized.
    (A full fine-tune trains every parameter of the trainable module, so nothing is left out there.)"""
    return any(not param.requires_grad for param in module.parameters())


def save_checkpoint(
    engine, run: Run, run_dir: Path, state: TrainState, extra: dict, keep_last: int, ema: Optional[Ema] = None
) -> str:
    """Collective. Returns the tag. `extra` (spec, ds_config, plan: JSON) is stored beside the state for export and
    resume; the run's EMA, when there is one, saves its per-rank share as ema_rank{R}.pt."""
    root = checkpoint_root(run_dir)
    tag = tag_for(state.global_step)
    if run.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if (root / tag).exists() and read_latest(root) != tag:
            shutil.rmtree(root / tag)  # leftovers of a save that crashed: never mixed with new shards
    barrier()
    engine.save_checkpoint(
        str(root), tag=tag, save_latest=False, exclude_frozen_parameters=leaves_frozen_out(engine.module)
    )
    torch.save(_rng_state(), root / tag / f"dstune_rank{run.rank}.pt")
    if ema is not None:
        ema.save(root / tag)
    # Each rank checks its own files (ranks may not share a filesystem); all must succeed before "latest" moves.
    mine_ok = (root / tag / f"dstune_rank{run.rank}.pt").is_file() and (
        ema is None or (root / tag / f"ema_rank{run.rank}.pt").is_file()
    )
    if not all(all_gather_object(mine_ok)):
        raise CheckpointError(f"checkpoint {tag} is incomplete on some rank; 'latest' still points to the previous one")
    if run.is_main:
        payload = {"state": asdict(state), "world_size": run.world_size, "tag": tag, **extra}
        write_text_atomic(root / tag / STATE_FILE, json.dumps(payload, indent=2, default=str))
        write_text_atomic(root / "latest", tag)
        _prune(root, keep_last, keep=tag)
    barrier()
    return tag


# fp32 weights (4) + fp32 master copy (4) + two Adam moments (8): an upper bound for the optimizers dstune builds.
BYTES_PER_PARAM = 16


def checkpoint_bytes_estimate(engine) -> int:
    """About how many bytes one checkpoint of this engine takes, all ranks' shards together (ZeRO-3 aware)."""
    sizes = [(int(getattr(p, "ds_numel", p.numel())), p.requires_grad) for p in engine.module.parameters()]
    return sum(n for n, grad in sizes if grad) * BYTES_PER_PARAM  # frozen weights are never saved (leaves_frozen_out)


def space_problem(run_dir: Path, needed_bytes: int) -> Optional[str]:
    """An error naming the folder when its filesystem cannot hold one more checkpoint, else None.

    Checked before step 1 on every rank (nodes may write to different disks), so a full disk stops the run at start
    instead of at the first save, hours later, with a half-written checkpoint."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError as err:
        return f"output.dir {run_dir}: cannot read its free space ({err.strerror or err})."
    if free >= needed_bytes:
        return None
    mib = 1024 * 1024
    return (
        f"output.dir {run_dir}: {free / mib:.1f} MiB free on its filesystem, but one checkpoint of this model "
        f"needs about {needed_bytes / mib:.1f} MiB (weights + optimizer state, {BYTES_PER_PARAM} bytes per "
        "parameter). Free space there or choose another output.dir; nothing was trained."
    )


def shared_folder_problem(run: Run, run_dir: Path) -> Optional[str]:
    """Collective. An error (the same on every rank) when some rank does not see the output folder rank 0 sees.

    A checkpoint is complete only with every rank's shards in one folder (resume and export read them all), so a
    node-local output.dir must be found at start, not at the first save. Rank 0 writes a random token into its
    folder; every rank looks for that token in its own output.dir."""
    if run.world_size == 1:
        return None
    token = all_gather_object(secrets.token_hex(16) if run.is_main else None)[0]
    probe = Path(run_dir) / f".dstune-shared-{token}"
    if run.is_main:
        probe.write_text(token)
    barrier()
    try:
        sees = probe.read_text() == token
    except OSError:
        sees = False
    seen = all_gather_object((sees, str(Path(run_dir).resolve()), run.world.hosts[run.node_rank]))
    if run.is_main:
        probe.unlink(missing_ok=True)
    blind = [(rank, folder, host) for rank, (ok, folder, host) in enumerate(seen) if not ok]
    if not blind:
        return None
    listing = "\n".join(f"  rank {rank} on {host}: output.dir {folder}" for rank, folder, host in blind)
    return (
        f"output.dir is not shared by all ranks: rank 0 on {seen[0][2]} wrote a marker into {seen[0][1]}, and "
        f"these ranks do not see it in their output.dir:\n{listing}\nA checkpoint needs every rank's shards in "
        "one folder (resume and export read them all): put output.dir on storage every node mounts at the same "
        "path (NFS, Lustre, ...), and give every node the same output.dir. Nothing was trained."
    )


def _prune(root: Path, keep_last: int, keep: str) -> None:
    complete = list_complete(root)
    for old in complete[:-keep_last]:
        if old != keep:
            shutil.rmtree(root / old, ignore_errors=True)


def rng_file_for(folder: Path, rank: int, saved_world: int) -> Path:
    """The RNG state a rank restores: its own rank's. A rank the checkpoint did not have (more ranks than before)
    takes rank 0's. Nothing of the trajectory depends on these streams (every draw that decides a sample's
    contribution comes from families.randomness.sample_generator), and every rank of a fresh run starts from the same
    global state too; this keeps every restored state from the checkpoint, so resuming twice gives the same."""
    return folder / f"dstune_rank{rank if rank < saved_world else 0}.pt"


def load_checkpoint(
    engine, run: Run, root: Path, tag: str, ema=None, universal_root: Optional[Path] = None
) -> TrainState:
    """Collective. Restores weights, optimizer, LR schedule, RNG, the data position and (given `ema`) the EMA.

    A checkpoint of another number of ranks loads its ZeRO state from `universal_root` (dstune.checkpoints.reshard: the
    converted copy; the engine was started with checkpoint.load_universal), or, when its optimizer state is not
    partitioned (ZeRO 0, fp32), from the checkpoint itself. Its EMA shares are re-cut for this world."""
    saved = read_state(root, tag)
    other_world = saved["world_size"] != run.world_size
    if other_world and universal_root is None and any((root / tag).glob("*zero_pp_rank_*_optim_states.pt")):
        raise CheckpointError(
            f"checkpoint {root / tag} was written by {saved['world_size']} ranks; this run has "
            f"{run.world_size}, and its ZeRO partitions were not converted for it"
        )
    with only_tensors_unpickled(f"checkpoint {root / tag}"):
        # Frozen weights were left out (LoRA): they come from the pretrained folder, so the module load is not strict.
        path, _ = engine.load_checkpoint(
            str(universal_root or root),
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=not leaves_frozen_out(engine.module),
        )
        rng_file = rng_file_for(root / tag, run.rank, saved["world_size"])
        rng_state = torch.load(rng_file, weights_only=True) if rng_file.is_file() else None
        if ema is not None:
            _load_ema(ema, root / tag, other_world)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {root / tag}")
    if rng_state is not None:
        _restore_rng(rng_state)
    return TrainState(**saved["state"])


def _load_ema(ema: Ema, folder: Path, other_world: bool) -> None:
    try:
        ema.load_resharded(folder) if other_world else ema.load(folder)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{err}. Resume with the train.ema setting the checkpoint was written with.") from None
