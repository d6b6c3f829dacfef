"""The plan: batch, epoch, step and learning-rate arithmetic for one spec on one world. Pure; nothing else.

The batch triad follows DeepSpeed's own rules (any two numbers determine the third, by floor division; with only
micro or only global given, accumulation is 1) but never truncates: a triad DeepSpeed would reject at engine start
is an error here, offline, with numbers that would work.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Hashable, Sequence

from dstune.spec.load import SpecError, SpecIssue, SpecSource
from dstune.spec.models import TrainSpec


# --- group arithmetic (dstune.data.groups makes the grouped order; the counts and batches are the plan's)


@dataclass(frozen=True)
class GroupBatches:
    key: Hashable  # the group's key, e.g. (width, height)
    samples: int  # samples in the group, repeats included
    steps: int  # whole global batches per epoch (optimizer steps)
    dropped: int  # samples left out of every epoch (the group's remainder)


def key_label(key: Hashable) -> str:
    """How a key is shown and planned: a (width, height) pair as "WxH", a clip's (frames, width, height) as
    "Ff WxH", anything else as str(key)."""
    if isinstance(key, tuple) and len(key) in (2, 3) and all(isinstance(v, int) for v in key):
        return f"{key[0]}x{key[1]}" if len(key) == 2 else f"{key[0]}f {key[1]}x{key[2]}"
    return str(key)


def group_counts(keys: Sequence[Hashable]) -> dict:
    """{key: number of indices with that key}, in sorted key order."""
    counts: dict = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return {key: counts[key] for key in sorted(counts)}


def group_batches(counts: dict, global_batch_size: int) -> list[GroupBatches]:
    """Per group (in the order of `counts`): samples, whole global batches per epoch, remainder left out."""
    if global_batch_size < 1:
        raise ValueError(f"global batch size must be at least 1, got {global_batch_size}")
    return [
        GroupBatches(key, count, count // global_batch_size, count % global_batch_size) for key, count in counts.items()
    ]


# --- the plan


@dataclass(frozen=True)
class Plan:
    world_size: int  # all ranks (processes); data-parallel ranks = world_size / sequence_parallel_size
    num_nodes: int
    ranks_per_node: tuple[int, ...]
    micro_batch_size: int  # samples per forward, per rank
    gradient_accumulation_steps: int
    global_batch_size: int  # samples per optimizer step, all ranks
    num_samples: int  # dataset size (after repeats)
    steps_per_epoch: int  # optimizer steps
    samples_per_epoch: int  # samples an epoch really uses (drop_last)
    dropped_per_epoch: int  # remainder left out of each epoch
    micro_batches_per_epoch_per_rank: int
    total_steps: int
    epochs: float  # may be fractional when max_steps is given
    samples_seen: int
    times_each_sample_seen: float
    warmup_steps: int
    base_lr: float
    lr_scale: float
    effective_lr: float
    gradient_clipping: float
    warnings: tuple[SpecIssue, ...] = field(default=())
    # Grouped batching (data.buckets): every global batch comes from one group; per group, in display order.
    # Empty without groups. steps_per_epoch is then the sum of the groups' steps.
    groups: tuple[GroupBatches, ...] = field(default=())
    # deepspeed.sequence_parallel_size: ranks that share each sample (dstune.sequence_parallel); the batch numbers
    # above count data-parallel ranks (world_size / sequence_parallel_size)
    sequence_parallel_size: int = 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.sequence_parallel_size

    def as_dict(self) -> dict:
        out = asdict(self)
        if self.sequence_parallel_size == 1:  # data-parallel only: the JSON other tools read stays as it was
            del out["sequence_parallel_size"]
        else:
            out["data_parallel_size"] = self.data_parallel_size
        out["ranks_per_node"] = list(self.ranks_per_node)
        out["warnings"] = [str(w) for w in self.warnings]
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearby_multiples(value: int, step: int) -> str:
    below = (value // step) * step
    above = below + step
    return " or ".join(str(v) for v in (below, above) if v > 0)


def resolve_batch(train: TrainSpec, world_size: int, source: SpecSource) -> tuple[int, int, int]:
    """Return (micro, accumulation, global) or raise SpecError saying which numbers would work."""
    g, m, a, ws = train.global_batch_size, train.micro_batch_size, train.gradient_accumulation_steps, world_size
    on = f"on {ws} rank{'s' if ws != 1 else ''}"
    if g is None:  # micro given (the spec guarantees one of micro/global)
        a = a or 1
        return m, a, m * a * ws
    if m is not None and a is not None:
        if g != m * a * ws:
            raise SpecError(
                [
                    source.issue(
                        "train.global_batch_size",
                        f"{g} != micro_batch_size {m} x gradient_accumulation_steps {a} x {ws} ranks = {m * a * ws}. "
                        f"Give only two of the three numbers, or set global_batch_size to {m * a * ws}.",
                    )
                ]
            )
        return m, a, g
    if g % ws:
        raise SpecError(
            [
                source.issue(
                    "train.global_batch_size",
                    f"{g} is not divisible by the {ws} data-parallel ranks: each rank must get whole samples. "
                    f"Use a multiple of {ws}, e.g. {_nearby_multiples(g, ws)}.",
                )
            ]
        )
    per_rank = g // ws  # = micro x accumulation
    if m is not None:
        if per_rank % m:
            pairs = ", ".join(f"micro {d} x accum {per_rank // d}" for d in _divisors(per_rank))
            raise SpecError(
                [
                    source.issue(
                        "train.micro_batch_size",
                        f"{m} does not divide global_batch_size {g} {on} ({g} = micro x accum x {ws} needs micro x accum = "
                        f"{per_rank}). Options: {pairs}; or global_batch_size {_nearby_multiples(g, m * ws)}.",
                    )
                ]
            )
        return m, per_rank // m, g
    a = a or 1
    if per_rank % a:
        options = ", ".join(str(d) for d in _divisors(per_rank))
        raise SpecError(
            [
                source.issue(
                    "train.gradient_accumulation_steps",
                    f"{a} does not divide global_batch_size {g} {on} (micro x accum must be {per_rank}). "
                    f"Accumulation steps that work: {options}.",
                )
            ]
        )
    return per_rank // a, a, g


def fitting_batch_advice(limit: int, world_size: int, micro: int, what: str) -> str:
    """What to do when a global batch does not fit in `limit` samples (`what`: the dataset, the largest bucket): a
    global batch this world can run (a multiple of ranks x micro, at most `limit`), or why there is none."""
    unit = world_size * micro
    if unit <= limit:
        return (
            f"Use a global batch of at most {limit} that is a multiple of {world_size} rank(s) x micro_batch_size "
            f"{micro} = {unit}, e.g. global_batch_size: {limit // unit * unit}"
        )
    if world_size <= limit:
        fitting = limit // world_size
        return (
            f"Even one micro batch per rank ({world_size} rank(s) x micro_batch_size {micro} = {unit}) is more "
            f"than {what} holds: use micro_batch_size {fitting} with global_batch_size {fitting * world_size}"
        )
    return (
        f"{what[0].upper()}{what[1:]} holds {limit} samples, fewer than the {world_size} ranks, and every rank "
        f"needs at least one sample per step: it is too small for this world. Train on at most {limit} GPU(s)"
    )


def _group_issues(
    rows: list[GroupBatches], global_batch: int, num_samples: int, source: SpecSource, world_size: int, micro: int
) -> list[SpecIssue]:
    """Errors (no group fills a global batch) and warnings (groups that never train, remainders) of grouped plans."""
    steps = sum(row.steps for row in rows)
    if steps == 0:
        largest = max(rows, key=lambda row: row.samples)
        advice = fitting_batch_advice(largest.samples, world_size, micro, f"the largest bucket ({largest.key})")
        raise SpecError(
            [
                source.issue(
                    "train.global_batch_size",
                    f"{global_batch} is larger than every bucket (data.buckets; the largest, {largest.key}, holds "
                    f"{largest.samples} samples): every global batch comes from one bucket, so not one optimizer step fits "
                    f"in an epoch. {advice}; or use fewer buckets, or more data.",
                )
            ]
        )
    issues = []
    idle = [row for row in rows if row.steps == 0]
    if idle:
        listing = ", ".join(f"{row.key} ({row.samples})" for row in idle)
        issues.append(
            source.issue(
                "data.buckets",
                f"{len(idle)} bucket(s) hold fewer samples than one global batch of {global_batch} and never train: "
                f"{listing}. Use a smaller global batch, fewer buckets (min_aspect / max_aspect / sizes), or more data.",
                severity="warning",
            )
        )
    dropped = num_samples - steps * global_batch
    if dropped:
        listing = ", ".join(f"{row.key}: {row.dropped}" for row in rows if row.dropped)
        issues.append(
            source.issue(
                "train.global_batch_size",
                f"each epoch leaves out {dropped} of {num_samples} samples (each bucket's remainder after its full "
                f"global batches of {global_batch}: {listing}); a different set each epoch since the order is reshuffled",
                severity="warning",
            )
        )
    return issues


def _steps_per_epoch(
    global_batch: int,
    num_samples: int,
    groups: dict | None,
    source: SpecSource,
    warnings: list[SpecIssue],
    world_size: int,
    micro: int,
) -> tuple[list[GroupBatches], int]:
    """(group rows, optimizer steps per epoch); appends the warnings about samples an epoch leaves out."""
    rows: list[GroupBatches] = []
    if groups:
        if sum(groups.values()) != num_samples:
            raise ValueError(f"the groups hold {sum(groups.values())} samples, the dataset {num_samples}")
        rows = group_batches(groups, global_batch)
        warnings += _group_issues(rows, global_batch, num_samples, source, world_size, micro)
        steps_per_epoch = sum(row.steps for row in rows)
    else:
        steps_per_epoch = num_samples // global_batch
    if steps_per_epoch == 0:
        raise SpecError(
            [
                source.issue(
                    "train.global_batch_size",
                    f"{global_batch} is larger than the dataset ({num_samples} samples): not one full optimizer step fits in "
                    f"an epoch. {fitting_batch_advice(num_samples, world_size, micro, 'the dataset')}; or add data.",
                )
            ]
        )
    dropped = num_samples - steps_per_epoch * global_batch
    if dropped and not groups:
        warnings.append(
            source.issue(
                "train.global_batch_size",
                f"each epoch leaves out {dropped} of {num_samples} samples (the remainder after {steps_per_epoch} full "
                f"global batches of {global_batch}); a different set each epoch since the order is reshuffled",
                severity="warning",
            )
        )
    return rows, steps_per_epoch


def data_parallel_ranks(world_size: int, sequence_parallel_size: int, source: SpecSource) -> int:
    """world_size / sequence_parallel_size, or SpecError naming deepspeed.sequence_parallel_size and sizes that work."""
    if world_size % sequence_parallel_size:
        options = ", ".join(str(d) for d in _divisors(world_size))
        raise SpecError(
            [
                source.issue(
                    "deepspeed.sequence_parallel_size",
                    f"{sequence_parallel_size} does not divide the {world_size} ranks: the ranks form groups of "
                    f"{sequence_parallel_size} that share each sample. Use one of {options}, or launch a multiple of "
                    f"{sequence_parallel_size} ranks.",
                )
            ]
        )
    return world_size // sequence_parallel_size


def make_plan(
    train: TrainSpec,
    world,
    num_samples: int,
    source: SpecSource,
    groups: dict | None = None,
    sequence_parallel_size: int = 1,
) -> Plan:
    """Everything `validate` prints and training obeys. `world` is a dstune.world.World (or anything with
    world_size, num_nodes and ranks_per_node). `groups`: {key: samples} when every global batch must come from one
    group (data.buckets), in display order; the samples add up to num_samples. `sequence_parallel_size`
    (deepspeed.sequence_parallel_size): the batch numbers count world_size / sequence_parallel_size
    data-parallel ranks."""
    data_parallel = data_parallel_ranks(world.world_size, sequence_parallel_size, source)
    micro, accum, global_batch = resolve_batch(train, data_parallel, source)
    if num_samples <= 0:
        raise SpecError([source.issue("data.path", "the dataset is empty: no samples to train on")])
    warnings: list[SpecIssue] = []
    rows, steps_per_epoch = _steps_per_epoch(global_batch, num_samples, groups, source, warnings, data_parallel, micro)
    if train.max_steps is not None:
        total_steps = train.max_steps
    else:
        total_steps = train.epochs * steps_per_epoch
    samples_per_epoch = steps_per_epoch * global_batch
    dropped = num_samples - samples_per_epoch
    warmup = train.scheduler.warmup_steps
    if warmup >= total_steps and warmup:
        warnings.append(
            source.issue(
                "train.scheduler.warmup_steps",
                f"{warmup} warmup steps >= {total_steps} total optimizer steps: the LR never reaches its peak",
                severity="warning",
            )
        )
    scale = 1.0
    if train.lr_scaling != "none":
        ratio = global_batch / train.reference_batch_size
        scale = ratio if train.lr_scaling == "linear" else math.sqrt(ratio)
    samples_seen = total_steps * global_batch
    return Plan(
        world_size=world.world_size,
        num_nodes=world.num_nodes,
        ranks_per_node=tuple(world.ranks_per_node),
        micro_batch_size=micro,
        gradient_accumulation_steps=accum,
        global_batch_size=global_batch,
        num_samples=num_samples,
        steps_per_epoch=steps_per_epoch,
        samples_per_epoch=samples_per_epoch,
        dropped_per_epoch=dropped,
        micro_batches_per_epoch_per_rank=steps_per_epoch * accum,
        total_steps=total_steps,
        epochs=total_steps / steps_per_epoch,
        samples_seen=samples_seen,
        times_each_sample_seen=samples_seen / num_samples,
        warmup_steps=warmup,
        base_lr=train.optimizer.lr,
        lr_scale=scale,
        effective_lr=train.optimizer.lr * scale,
        gradient_clipping=train.resolved_gradient_clipping,
        warnings=tuple(warnings),
        groups=tuple(rows),
        sequence_parallel_size=sequence_parallel_size,
    )
