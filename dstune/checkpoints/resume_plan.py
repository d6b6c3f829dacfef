"""Resuming a checkpoint on this launch's world: what can be kept, what the options are, what changes. Pure.

A checkpoint continues the same trajectory on any number of ranks as long as the global batch is the same: the
sample order (global-epoch sampler) and every random draw of a sample (seed, step, index) do not depend on how the
global batch is split over ranks and accumulation. So the decision compares global batches, not world sizes:

    same world, same global batch      -> "same": DeepSpeed loads its own shards
    other world, same global batch     -> "reshard": the ZeRO state is re-partitioned for this world
    other global batch                 -> refused with the options that keep it (`batch_refusal`), or with
                                          --allow-batch-change, continued on the new plan (`rebatched`)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dstune.plan import Plan, resolve_batch
from dstune.spec.diff import NEW_RUN, describe_changes, refused_changes_text, spec_changes
from dstune.spec.load import SpecError, SpecSource
from dstune.spec.models import TrainSpec

ALLOW_FLAG = "--allow-batch-change"
MAX_OPTIONS = 4  # micro x accumulation splits listed in a refusal


@dataclass(frozen=True)
class SavedRun:
    """What a checkpoint's dstune_state.json says about the run that wrote it."""

    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    steps_per_epoch: int
    total_steps: int
    global_step: int
    epoch: int
    step_in_epoch: int
    samples_seen: int

    @classmethod
    def from_state(cls, saved: dict) -> "SavedRun":
        plan, state = saved["plan"], saved["state"]
        return cls(
            saved["world_size"],
            plan["micro_batch_size"],
            plan["gradient_accumulation_steps"],
            plan["global_batch_size"],
            plan["steps_per_epoch"],
            plan["total_steps"],
            state["global_step"],
            state["epoch"],
            state["step_in_epoch"],
            state["samples_seen"],
        )


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _split(micro: int, accumulation: int, world_size: int) -> str:
    return f"micro {micro} x accumulation {accumulation} x {_ranks(world_size)}"


def resume_kind(saved: SavedRun, world_size: int, global_batch: int) -> str:
    """ "same", "reshard" (another world, the same global batch) or "rebatch" (another global batch)."""
    if global_batch != saved.global_batch_size:
        return "rebatch"
    return "same" if world_size == saved.world_size else "reshard"


def _planned(train: TrainSpec, world_size: int, source: SpecSource) -> Optional[tuple[int, int, int]]:
    try:
        return resolve_batch(train, world_size, source)
    except SpecError:
        return None


def _candidate_overrides(train: TrainSpec, global_batch: int, micro: int, accumulation: int) -> list[dict]:
    """Override sets, smallest first, that might make the spec plan (micro, accumulation, global_batch)."""
    keys_g, keys_m, keys_a = "global_batch_size", "micro_batch_size", "gradient_accumulation_steps"
    sets = [
        {keys_g: global_batch},
        {keys_a: accumulation},
        {keys_m: micro},
        {keys_m: micro, keys_a: accumulation},
        {keys_g: global_batch, keys_m: micro},
        {keys_g: global_batch, keys_m: micro, keys_a: accumulation},
    ]
    return [values for values in sets if any(getattr(train, k) != v for k, v in values.items())]


def keep_batch_options(train: TrainSpec, world_size: int, global_batch: int, source: SpecSource) -> list[str]:
    """`--set` lines that make this spec plan `global_batch` on `world_size` ranks, one per micro x accumulation
    split (the spec's own micro batch first, then larger micro batches), each checked with resolve_batch."""
    if global_batch % world_size:
        return []
    per_rank = global_batch // world_size
    micros = sorted(
        (m for m in range(1, per_rank + 1) if per_rank % m == 0), key=lambda m: (m != train.micro_batch_size, -m)
    )
    options = []
    for micro in micros:
        for values in _candidate_overrides(train, global_batch, micro, per_rank // micro):
            if _planned(train.model_copy(update=values), world_size, source) == (
                micro,
                per_rank // micro,
                global_batch,
            ):
                flags = " ".join(f"--set train.{k}={v}" for k, v in values.items() if getattr(train, k) != v)
                options.append(f"{flags}   ({_split(micro, per_rank // micro, world_size)})")
                break
        if len(options) == MAX_OPTIONS:
            break
    return options


def batch_refusal(
    train: TrainSpec, world_size: int, saved: SavedRun, source: SpecSource, checkpoint: str, allow_change: bool
) -> Optional[str]:
    """The message refusing to resume `saved` with this spec on `world_size` ranks, or None when the global batch
    is kept, when --allow-batch-change was given, or when the spec does not fit this world at all (validation
    reports that, with its own fix)."""
    planned = _planned(train, world_size, source)
    if planned is None or planned[2] == saved.global_batch_size or allow_change:
        return None
    g = saved.global_batch_size
    lines = [
        f"{checkpoint} was trained with a global batch of {g} "
        f"({_split(saved.micro_batch_size, saved.gradient_accumulation_steps, saved.world_size)}); this launch "
        f"would train with a global batch of {planned[2]} ({_split(planned[0], planned[1], world_size)}). A run continues the same "
        "trajectory on another number of ranks only with the same global batch. Options:"
    ]
    options = keep_batch_options(train, world_size, g, source)
    if options:
        lines.append(f"  - keep the global batch of {g} on {_ranks(world_size)}:")
        lines += [f"      {option}" for option in options]
    else:
        fits = [n for n in range(1, g + 1) if g % n == 0]
        lines.append(
            f"  - {g} samples cannot be split evenly over {_ranks(world_size)}; launch a number of ranks "
            f"that divides {g} ({', '.join(map(str, fits))})"
        )
    if _planned(train, saved.world_size, source) == (saved.micro_batch_size, saved.gradient_accumulation_steps, g):
        lines.append(f"  - launch {_ranks(saved.world_size)}, as the checkpoint was written")
    lines.append(
        f"  - {ALLOW_FLAG}: continue with a global batch of {planned[2]}; the steps per epoch, the total "
        "steps and the LR schedule follow the new batch from this step on (printed at start)"
    )
    lines.append("Nothing was trained.")
    return "\n".join(lines)


@dataclass(frozen=True)
class Rebatched:
    plan: Plan  # the new plan, its total steps (and epochs, samples) counted from the checkpoint on
    epoch: int
    step_in_epoch: int
    text: str  # what changes, for the log


def rebatched(saved: SavedRun, plan: Plan, train: TrainSpec) -> Rebatched:
    """--allow-batch-change: continue `saved` under `plan` (another global batch). The data continues at the same
    sample of the current epoch, rounded down to a whole new global batch (at most one new batch of samples is seen
    again; with buckets the batches are drawn anew for the new batch size, so the position is approximate). With
    train.max_steps the run still ends after max_steps optimizer steps (of mixed sizes); with train.epochs it ends
    where the epochs end, counted in new steps. The LR schedule is the new plan's, continued at the current step."""
    done_in_epoch = saved.step_in_epoch * saved.global_batch_size
    epoch, step = saved.epoch, min(done_in_epoch // plan.global_batch_size, plan.steps_per_epoch)
    if step == plan.steps_per_epoch:
        epoch, step = epoch + 1, 0
    if train.max_steps is not None:
        total = plan.total_steps
    else:
        total = saved.global_step + (train.epochs - epoch) * plan.steps_per_epoch - step
    total = max(total, saved.global_step)
    samples = saved.samples_seen + (total - saved.global_step) * plan.global_batch_size
    new_plan = dataclasses.replace(
        plan,
        total_steps=total,
        samples_seen=samples,
        epochs=samples / plan.samples_per_epoch,
        times_each_sample_seen=samples / plan.num_samples,
    )
    text = (
        f"{ALLOW_FLAG}: global batch {saved.global_batch_size} -> {plan.global_batch_size} "
        f"({_split(plan.micro_batch_size, plan.gradient_accumulation_steps, plan.world_size)}); steps per epoch "
        f"{saved.steps_per_epoch} -> {plan.steps_per_epoch}; total optimizer steps {saved.total_steps} -> {total} "
        f"({'train.max_steps' if train.max_steps is not None else 'train.epochs'}; {total - saved.global_step} "
        f"more from step {saved.global_step}); data: epoch {saved.epoch + 1} step {saved.step_in_epoch} -> epoch "
        f"{epoch + 1} step {step}; the LR schedule is the new plan's ({total} steps, peak lr "
        f"{plan.effective_lr:g}) from step {saved.global_step} on"
    )
    return Rebatched(new_plan, epoch, step, text)


ADAM_STATE_OPTIMIZERS = ("adam", "adamw")  # the state DeepSpeed's converter reads: exp_avg, exp_avg_sq, step


def is_partitioned(folder: Path) -> bool:
    """True when the checkpoint's optimizer state is split per rank (ZeRO 1-3, bf16_zero_* files)."""
    return any(Path(folder).glob("*zero_pp_rank_*_optim_states.pt"))


def reshard_refusal(folder: Path, optimizer_type: str, saved_world: int, world_size: int) -> Optional[str]:
    """Why a checkpoint written by `saved_world` ranks cannot be re-partitioned for `world_size`, or None."""
    if saved_world == world_size or not is_partitioned(folder) or optimizer_type in ADAM_STATE_OPTIMIZERS:
        return None
    return (
        f"{folder} was written by {saved_world} ranks; this run has {world_size}. Resuming on another number of "
        "ranks re-partitions the optimizer state through DeepSpeed's universal checkpoint, which carries Adam's "
        f"state only (exp_avg, exp_avg_sq), not {optimizer_type}'s. Relaunch with {saved_world} ranks, or export "
        "the weights (`dstune export RUN`) and start a new run from the exported folder (model.pretrained)."
    )


def resume_preview(
    spec_dump: dict,
    train: TrainSpec,
    plan: Plan,
    saved_state: dict,
    source: SpecSource,
    checkpoint: str,
    reshard_problem: Optional[str],
    allow_batch_change: bool = False,
    allow_spec_changes: bool = False,
) -> tuple[str, bool]:
    """What a resume of `checkpoint` on this plan's world would do, offline, and whether it would start (False:
    refused, for the batch, the optimizer state, the data's place or a spec change; the text then says what to
    change). `dstune validate --resume-from RUN` prints it, and `dstune train --resume` before it launches anything.
    The ranks check the same again (dstune.checkpoints.resume)."""
    saved = SavedRun.from_state(saved_state)
    written = _split(saved.micro_batch_size, saved.gradient_accumulation_steps, saved.world_size)
    lines = [
        f"resume from {checkpoint}: step {saved.global_step} of {saved.total_steps}, epoch {saved.epoch + 1} "
        f"(step {saved.step_in_epoch} of it), written by {written}"
    ]
    world_size, global_batch = plan.world_size, plan.global_batch_size
    refusal = (
        batch_refusal(train, world_size, saved, source, checkpoint, allow_batch_change)
        or reshard_problem
        or position_refusal(saved, plan, checkpoint)
    )
    if refusal:
        return "\n".join(lines + [f"refused: {refusal}"]), False
    kind = resume_kind(saved, world_size, global_batch)
    if kind == "same":
        lines.append("same world and global batch: DeepSpeed loads its own shards")
    elif kind == "reshard":
        lines.append(
            f"continues on {_ranks(world_size)} with the same global batch of {global_batch}: the ZeRO state "
            "is re-partitioned through DeepSpeed's universal checkpoint (docs/training.md, Resume)"
        )
    else:
        lines.append(rebatched(saved, plan, train).text)
    changes = spec_changes(saved_state.get("spec", {}), spec_dump)
    refused = refused_changes_text(changes, saved_state.get("spec", {}), spec_dump)
    safe, breaking = describe_changes(changes, train.scheduler.type)
    if refused:
        return "\n".join(lines + [f"refused: {refused}"]), False
    if breaking and not allow_spec_changes:
        return "\n".join(lines + ([safe] if safe else []) + [f"refused: {breaking}"]), False
    if breaking:
        breaking = "--allow-spec-changes: continuing with " + breaking
    lines += [text for text in (safe, breaking) if text]
    return "\n".join(lines), True


def position_refusal(saved: SavedRun, plan: Plan, checkpoint: str) -> Optional[str]:
    """Why `saved`'s place in its epoch does not exist under `plan` (the data changed, the global batch did not:
    another number of steps per epoch), or None. A new global batch moves the position itself (`rebatched`)."""
    if saved.global_batch_size != plan.global_batch_size or saved.steps_per_epoch == plan.steps_per_epoch:
        return None
    return (
        f"{checkpoint} stopped at epoch {saved.epoch + 1}, step {saved.step_in_epoch} of its "
        f"{saved.steps_per_epoch} steps per epoch; with this spec's data an epoch has {plan.steps_per_epoch} "
        "steps (the data changed), so the run's place in its data order does not exist any more. "
        "Revert the data changes to continue this run. " + NEW_RUN
    )
