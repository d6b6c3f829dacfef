"""Resuming a run (`--resume`): the one place training.py asks, in the order the stages run (docs/training.md,
"Resume").

    resume_refusal         before any process group, from the files alone: why this launch cannot continue the
                           checkpoint (another global batch, an optimizer state that cannot be re-partitioned)
    overwrite_refusal      without --resume: the run folder's earlier checkpoints are never overwritten
    find_resume            collective: the checkpoint, checked for this world; the spec changes since it listed or
                           refused; its ZeRO state converted when another number of ranks wrote it
    resumed_plan,          what the engine is built with: the new plan of --allow-batch-change, and the universal
    engine_config          loading of a converted checkpoint
    continue_from          collective, once the engine (and EMA) exist: load the checkpoint, apply the spec's LR,
                           optimizer and schedule, and return the position to continue from

The decisions themselves are torch-free (dstune.checkpoints.resume_plan, dstune.spec.diff); loading is
dstune.checkpoints.store, re-partitioning dstune.checkpoints.reshard. Every error stops all ranks together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dstune.checkpoints.reshard import remove_universal_copy, universal_copy
from dstune.checkpoints.resume_plan import (
    Rebatched,
    SavedRun,
    batch_refusal,
    is_partitioned,
    position_refusal,
    rebatched,
    reshard_refusal,
    resume_kind,
)
from dstune.checkpoints.layout import (
    CheckpointError,
    TrainState,
    checkpoint_root,
    list_complete,
    read_state,
    resolve_resume,
)
from dstune.checkpoints.store import load_checkpoint
from dstune.distributed import Run, agree_or_stop, stop
from dstune.ds_json.blocks import with_universal_loading
from dstune.engine import follow_plan_schedule, saved_schedule_steps
from dstune.optimizers import train_mode
from dstune.plan import Plan
from dstune.spec.diff import describe_changes, refused_changes_text, spec_changes
from dstune.spec.models import Spec
from dstune.validate import Resolved


@dataclass(frozen=True)
class ResumeOptions:
    """What a resume may change (train.py flags): the global batch, and spec keys that break exact continuation."""

    allow_batch_change: bool = False
    allow_spec_changes: bool = False


@dataclass(frozen=True)
class Resuming:
    """The checkpoint a run continues from, and how (docs/training.md, "Resume")."""

    root: Path
    tag: str
    saved: SavedRun
    universal_root: Optional[Path]  # the converted copy of a checkpoint of another number of ranks (ZeRO 1-3)
    rebatched: Optional[Rebatched]  # --allow-batch-change with another global batch


def _refusals(spec, source, root: Path, tag: str, saved: dict, world_size: int, allow_batch_change: bool):
    return batch_refusal(
        spec.train, world_size, SavedRun.from_state(saved), source, f"checkpoint {root / tag}", allow_batch_change
    ) or reshard_refusal(root / tag, saved["spec"]["train"]["optimizer"]["type"], saved["world_size"], world_size)


def resume_refusal(spec, source, resume: str | None, world_size: int, allow_batch_change: bool) -> str | None:
    """Before any process group: why this launch cannot continue the checkpoint, or None. A checkpoint that cannot
    be read here is left to find_resume, where the ranks agree on the error."""
    if not resume:
        return None
    try:
        root, tag = resolve_resume(Path(spec.output.dir), resume)
        saved = read_state(root, tag)
        return _refusals(spec, source, root, tag, saved, world_size, allow_batch_change)
    except (CheckpointError, OSError, ValueError, KeyError):
        return None


def overwrite_refusal(run_dir: Path, resume: str | None) -> str | None:
    """Nothing already in the folder is overwritten without --resume."""
    if resume is None and list_complete(checkpoint_root(run_dir)):
        return (
            f"output.dir {run_dir} already holds checkpoints of an earlier run. Continue it with "
            "`--resume latest`, or choose another output.dir (nothing was overwritten)."
        )
    return None


def _check_spec_changes(run: Run, spec: Spec, saved_spec: dict, allow: bool) -> None:
    """Rank 0 lists what changed since the checkpoint; changes that break exact continuation stop every rank unless
    --allow-spec-changes (then they are listed as a warning), and those no checkpoint can take stop them always."""
    current = spec.model_dump(mode="json")
    changes = spec_changes(saved_spec, current)
    refused = refused_changes_text(changes, saved_spec, current)
    if refused:
        stop(run, refused, 1)
    safe_text, breaking_text = describe_changes(changes, spec.train.scheduler.type)
    if breaking_text and not allow:
        stop(run, breaking_text, 1)
    if run.is_main:
        for text in (safe_text, breaking_text and "--allow-spec-changes: continuing with " + breaking_text):
            if text:
                print(text, flush=True)


def find_resume(
    run: Run, resolved: Resolved, run_dir: Path, resume: str | None, options: ResumeOptions
) -> Optional[Resuming]:
    """Collective. The checkpoint to continue, checked for this world; its ZeRO state converted when it was written
    by another number of ranks. All ranks stop together on an error."""
    if not resume:
        return None
    root = tag = saved = None
    error = None
    try:
        root, tag = resolve_resume(run_dir, resume)
        saved = read_state(root, tag)
        error = _refusals(resolved.spec, resolved.source, root, tag, saved, run.world_size, options.allow_batch_change)
    except (CheckpointError, OSError, ValueError) as err:
        error = str(err)
    except KeyError as err:
        error = f"checkpoint {root / tag}: its dstune_state.json has no {err} (not written by this dstune?)"
    agree_or_stop(run, error)
    _check_spec_changes(run, resolved.spec, saved.get("spec", {}), options.allow_spec_changes)
    past = SavedRun.from_state(saved)
    agree_or_stop(run, position_refusal(past, resolved.plan, f"checkpoint {root / tag}"))
    kind = resume_kind(past, run.world_size, resolved.plan.global_batch_size)
    changed = rebatched(past, resolved.plan, resolved.spec.train) if kind == "rebatch" else None
    universal_root = None
    if past.world_size != run.world_size and is_partitioned(root / tag):
        universal_root = universal_copy(run, run_dir, root, tag)
    return Resuming(root, tag, past, universal_root, changed)


def resumed_plan(resuming: Optional[Resuming], plan: Plan) -> Plan:
    """The plan the run trains on: the validated one, or the new one of a resume with another global batch."""
    if resuming is not None and resuming.rebatched is not None:
        return resuming.rebatched.plan
    return plan


def engine_config(resuming: Optional[Resuming], ds_config: dict) -> dict:
    """The DeepSpeed JSON the engine starts with: universal loading only for a converted checkpoint."""
    if resuming is not None and resuming.universal_root is not None:
        return with_universal_loading(ds_config)
    return ds_config


def continue_from(run: Run, resuming: Optional[Resuming], engine, ema, resolved: Resolved, plan: Plan) -> TrainState:
    """The position to continue from (a fresh TrainState without --resume); all ranks stop together on an error."""
    if resuming is None:
        return TrainState()
    state, error = None, None
    try:
        state = load_checkpoint(
            engine, run, resuming.root, resuming.tag, ema=ema, universal_root=resuming.universal_root
        )
    except CheckpointError as err:
        error = str(err)
    agree_or_stop(run, error)
    train_mode(engine)  # schedule-free: the checkpoint held its averaged weights; back to the ones it steps
    if resuming.universal_root is not None:
        remove_universal_copy(run, resuming.universal_root)
    how = ""
    if resuming.saved.world_size != run.world_size:
        was = resuming.saved.world_size
        how = f" (written by {was} rank{'s' if was != 1 else ''}, continued on {run.world_size})"
    if resuming.rebatched is not None:
        state = TrainState(
            state.global_step, resuming.rebatched.epoch, resuming.rebatched.step_in_epoch, state.samples_seen
        )
        follow_plan_schedule(engine, resolved.spec.train, plan)
        if run.is_main:
            print(resuming.rebatched.text, flush=True)
    else:  # the spec's LR, schedule and optimizer settings, not the checkpoint's (the same values without changes)
        follow_plan_schedule(engine, resolved.spec.train, plan, saved_schedule_steps(engine))
    if run.is_main:
        print(
            f"resumed from {resuming.root / resuming.tag}{how}: step {state.global_step}, epoch {state.epoch + 1}, "
            f"step {state.step_in_epoch} of that epoch",
            flush=True,
        )
    return state
