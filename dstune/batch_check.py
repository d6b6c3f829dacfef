"""The pre-step batch checker: DeepSpeed's batch numbers, the plan's and every rank's loader agree before step 1.

Before the first optimizer step, every rank reports what DeepSpeed really configured (micro batch, accumulation,
global batch, data-parallel size), what its loader will really yield this epoch (micro batches, and the leading
dimension of its first real batch), and which node it is on. All ranks gather all reports and reach the same verdict;
on any mismatch every rank stops together with one table, so no rank is left hanging in a collective.

With groups (data.buckets) each rank also walks its sampler's epoch (indices only, nothing loaded) and reports:
steps where one of its micro batches holds a sample of another bucket than the step's (must be 0), the steps per
bucket (must be the plan's), a digest of the step -> bucket sequence (must be the same on every rank, or ranks
would train one step on different sizes), and whether its first real batch has the first step's bucket size.

Under sequence parallelism (deepspeed.sequence_parallel_size N) the N ranks of a sequence group share their
samples: each rank reports its data-parallel rank, DeepSpeed's sequence-parallel size and a digest of every sample
id its loader yields this epoch; the ranks of one group must agree on the digest, and the first step's samples of
different groups must not overlap.
"""

from __future__ import annotations

import hashlib
import socket
from collections import Counter
from dataclasses import asdict, dataclass

from dstune.data.groups import key_label
from dstune.card import CAUSAL_4X, ClipRule
from dstune.data.loader import size_matches_bucket
from dstune.distributed import Run, all_gather_object
from dstune.plan import Plan


@dataclass(frozen=True)
class RankReport:
    rank: int
    host: str
    ds_micro_batch: int
    ds_accumulation: int
    ds_global_batch: int
    ds_data_parallel: int
    loader_micro_batches: int  # micro batches this rank's loader yields in the epoch it starts in
    first_batch_size: int  # leading dimension of the first real batch
    num_samples: int  # the dataset size this rank sees
    # Groups (data.buckets); defaults when ungrouped.
    mixed_bucket_steps: int = 0  # steps of this epoch where a micro batch of this rank leaves the step's bucket
    bucket_steps: str = ""  # "24x40: 2, 32x32: 1": steps per bucket in this epoch
    bucket_sequence: str = ""  # digest of the bucket of every step from the start step
    first_batch_in_bucket: bool = True  # the first real batch has the first step's bucket size
    # Sequence parallelism; defaults without it.
    data_parallel_rank: int = 0  # the rank's sequence group
    ds_sequence_parallel: int = 1  # DeepSpeed's sequence-parallel size
    sample_digest: str = ""  # digest of every sample id the loader yields this epoch, in order
    first_step_ids: tuple = ()  # the sample ids of this rank's micro batches of the first step


@dataclass(frozen=True)
class Expected:
    micro_batch: int
    accumulation: int
    global_batch: int
    data_parallel: int
    loader_micro_batches: int
    num_samples: int
    bucket_steps: str = ""  # from the plan; "" without groups
    sequence_parallel: int = 1  # the ranks that report are data_parallel x sequence_parallel


def _steps_text(steps_by_key: dict) -> str:
    return ", ".join(f"{key}: {steps_by_key[key]}" for key in sorted(steps_by_key) if steps_by_key[key])


def bucket_report(sampler, first_batch: dict, clip_rule: ClipRule = CAUSAL_4X) -> dict:
    """This rank's group facts for RankReport (empty without groups). Walks indices only: no sample is loaded.
    `clip_rule`: the model's (its loader's), which a clip's latent frames follow."""
    grouped = getattr(sampler, "grouped", None)  # any sampler without groups reports nothing here
    if grouped is None:
        return {}
    epoch, mixed, sequence = sampler.epoch, 0, hashlib.sha256()
    for step in range(sampler.start_step, sampler.steps_per_epoch):
        key = sampler.step_group(epoch, step)
        micro_batches = [sampler.micro_batch(epoch, step, k) for k in range(sampler.accumulation)]
        mixed += any(grouped.keys[i] != key for batch in micro_batches for i in batch)
        sequence.update(f"{key_label(key)}\n".encode())
    steps = Counter(key_label(key) for key in grouped.step_keys(epoch))
    return {
        "mixed_bucket_steps": mixed,
        "bucket_steps": _steps_text(steps),
        "bucket_sequence": sequence.hexdigest()[:16],
        "first_batch_in_bucket": size_matches_bucket(
            first_batch, sampler.step_group(epoch, sampler.start_step), clip_rule
        ),
    }


def sample_report(run: Run, sampler) -> dict:
    """This rank's sequence-parallel facts for RankReport (empty without sequence parallelism). Walks indices only."""
    if run.sequence_parallel_size == 1:
        return {}
    epoch, digest = sampler.epoch, hashlib.sha256()
    for step in range(sampler.start_step, sampler.steps_per_epoch):
        for k in range(sampler.accumulation):
            digest.update((",".join(map(str, sampler.micro_batch(epoch, step, k))) + "\n").encode())
    first = [i for k in range(sampler.accumulation) for i in sampler.micro_batch(epoch, sampler.start_step, k)]
    return {
        "data_parallel_rank": run.data_parallel_rank,
        "sample_digest": digest.hexdigest()[:16],
        "first_step_ids": tuple(first),
    }


def _data_parallel_size(engine) -> int:
    """DeepSpeed's data-parallel size: with sequence-parallel groups as its mpu its dp_world_size is None, and ZeRO's
    group (all ranks) divided by the sequence-parallel size is what its batch numbers count."""
    sequence = int(getattr(engine, "sequence_parallel_size", 1) or 1)
    if sequence == 1:
        return int(engine.dp_world_size)
    return int(engine.seq_dp_world_size) // sequence


def rank_report(
    run: Run,
    engine,
    loader_micro_batches: int,
    first_batch_size: int,
    num_samples: int,
    buckets: dict | None = None,
    samples: dict | None = None,
) -> RankReport:
    """`buckets`: bucket_report(sampler, first_batch) with data.buckets; `samples`: sample_report(run, sampler)."""
    return RankReport(
        rank=run.rank,
        host=socket.gethostname(),
        ds_micro_batch=int(engine.train_micro_batch_size_per_gpu()),
        ds_accumulation=int(engine.gradient_accumulation_steps()),
        ds_global_batch=int(engine.train_batch_size()),
        ds_data_parallel=_data_parallel_size(engine),
        ds_sequence_parallel=int(getattr(engine, "sequence_parallel_size", 1) or 1),
        loader_micro_batches=int(loader_micro_batches),
        first_batch_size=int(first_batch_size),
        num_samples=int(num_samples),
        **(buckets or {}),
        **(samples or {}),
    )


def expected_from_plan(plan: Plan, start_step_in_epoch: int = 0) -> Expected:
    remaining_steps = plan.steps_per_epoch - start_step_in_epoch
    return Expected(
        micro_batch=plan.micro_batch_size,
        accumulation=plan.gradient_accumulation_steps,
        global_batch=plan.global_batch_size,
        data_parallel=plan.data_parallel_size,
        sequence_parallel=plan.sequence_parallel_size,
        loader_micro_batches=remaining_steps * plan.gradient_accumulation_steps,
        num_samples=plan.num_samples,
        bucket_steps=_steps_text({group.key: group.steps for group in plan.groups}),
    )


# What every rank reports and the plan fixes: (table row, message label, RankReport field, Expected field).
QUANTITIES = (
    ("micro batch", "DeepSpeed micro batch per rank", "ds_micro_batch", "micro_batch"),
    ("accumulation", "DeepSpeed gradient accumulation", "ds_accumulation", "accumulation"),
    ("global batch", "DeepSpeed global batch", "ds_global_batch", "global_batch"),
    ("data-parallel", "DeepSpeed data-parallel size", "ds_data_parallel", "data_parallel"),
    ("sequence-parallel", "DeepSpeed sequence-parallel size", "ds_sequence_parallel", "sequence_parallel"),
    ("loader micro batches", "loader micro batches this epoch", "loader_micro_batches", "loader_micro_batches"),
    ("first batch size", "first batch leading dimension", "first_batch_size", "micro_batch"),
    ("dataset samples", "dataset size", "num_samples", "num_samples"),
)


def find_mismatches(reports: list[RankReport], expected: Expected) -> list[str]:
    """Every disagreement, one line each, naming the rank, the quantity and both numbers."""
    problems = []
    for report in reports:
        for _, label, attr, planned in QUANTITIES:
            got, want = getattr(report, attr), getattr(expected, planned)
            if got != want:
                problems.append(f"rank {report.rank} ({report.host}): {label} is {got}, the plan says {want}")
    ranks = expected.data_parallel * expected.sequence_parallel
    if len(reports) != ranks:
        problems.append(f"{len(reports)} ranks reported, the plan has {ranks}")
    return problems + _bucket_mismatches(reports, expected) + _sequence_group_mismatches(reports, expected)


def _sequence_group_mismatches(reports: list[RankReport], expected: Expected) -> list[str]:
    """The ranks of a sequence group see the same samples; different groups see different ones."""
    if expected.sequence_parallel == 1:
        return []
    problems, groups = [], {}
    for r in reports:
        groups.setdefault(r.data_parallel_rank, []).append(r)
    for dp_rank, members in sorted(groups.items()):
        if len({m.sample_digest for m in members}) > 1:
            problems.append(
                f"sequence group {dp_rank} (ranks {', '.join(str(m.rank) for m in members)}): its ranks "
                "receive different samples (" + ", ".join(f"rank {m.rank}: {m.sample_digest}" for m in members) + ")"
            )
    firsts = {dp_rank: set(members[0].first_step_ids) for dp_rank, members in groups.items()}
    for a in sorted(firsts):
        for b in sorted(firsts):
            if a < b and firsts[a] & firsts[b]:
                problems.append(
                    f"sequence groups {a} and {b} both receive samples {sorted(firsts[a] & firsts[b])} "
                    "in the first step: the groups must see different samples"
                )
    return problems


def _bucket_mismatches(reports: list[RankReport], expected: Expected) -> list[str]:
    if not expected.bucket_steps and not any(r.bucket_steps for r in reports):
        return []
    problems = []
    for r in reports:
        where = f"rank {r.rank} ({r.host})"
        if r.bucket_steps != expected.bucket_steps:
            problems.append(
                f"{where}: steps per bucket are {r.bucket_steps or 'none'}, the plan says "
                f"{expected.bucket_steps or 'none'}"
            )
        if r.mixed_bucket_steps:
            problems.append(f"{where}: {r.mixed_bucket_steps} step(s) have a micro batch mixing buckets")
        if not r.first_batch_in_bucket:
            problems.append(f"{where}: the first batch does not have the first step's bucket size")
    if len({r.bucket_sequence for r in reports}) > 1:
        problems.append(
            "the ranks disagree on which bucket each step trains ("
            + ", ".join(f"rank {r.rank}: {r.bucket_sequence}" for r in reports)
            + ")"
        )
    return problems


def render_table(reports: list[RankReport], expected: Expected) -> str:
    """Plain-text table (it goes to logs as well as terminals): one column per rank, plus the plan."""
    rows = [(label, attr, getattr(expected, planned)) for label, _, attr, planned in QUANTITIES]
    if expected.bucket_steps:
        rows += [
            ("bucket steps", "bucket_steps", expected.bucket_steps),
            ("steps mixing buckets", "mixed_bucket_steps", 0),
            ("first batch in bucket", "first_batch_in_bucket", True),
            ("bucket order", "bucket_sequence", reports[0].bucket_sequence if reports else ""),
        ]
    header = ["", "plan"] + [f"rank {r.rank}" for r in reports]
    body = []
    for label, attr, want in rows:
        cells = [label, str(want)]
        for r in reports:
            got = getattr(r, attr)
            cells.append(str(got) if got == want else f"{got} !!")
        body.append(cells)
    hosts = {}
    for r in reports:
        hosts.setdefault(r.host, []).append(r.rank)
    node_line = "nodes: " + "; ".join(f"{h}: ranks {', '.join(map(str, rs))}" for h, rs in hosts.items())
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header] + body]
    return "\n".join(lines + [node_line])


def check_batches(run: Run, report: RankReport, expected: Expected) -> tuple[bool, str, list[dict]]:
    """Collective: every rank calls it. Returns (ok, table text, all reports as dicts), identical on every rank."""
    reports = [RankReport(**r) for r in all_gather_object(asdict(report))]
    problems = find_mismatches(reports, expected)
    table = render_table(reports, expected)
    if problems:
        table += "\n\nbatch check FAILED before step 1:\n" + "\n".join(f"  - {p}" for p in problems)
        table += (
            "\n\nThe loader or the DeepSpeed config does not do what the spec planned; training would silently "
            "see a different number of samples per step. Nothing was trained."
        )
    return not problems, table, [asdict(r) for r in reports]
