"""The pre-step batch checker (FIELD_NOTES rows 3 and 7).

Before the first optimizer step, every rank reports what DeepSpeed really configured (micro batch, accumulation,
global batch, data-parallel size), what its loader will really yield this epoch (micro batches, and the leading
dimension of its first real batch), and which node it is on. All ranks gather all reports and reach the same verdict;
on any mismatch every rank stops together with one table, so no rank is left hanging in a collective.
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass

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


@dataclass(frozen=True)
class Expected:
    micro_batch: int
    accumulation: int
    global_batch: int
    data_parallel: int
    loader_micro_batches: int
    num_samples: int


def rank_report(run: Run, engine, loader_micro_batches: int, first_batch_size: int, num_samples: int) -> RankReport:
    return RankReport(
        rank=run.rank,
        host=socket.gethostname(),
        ds_micro_batch=int(engine.train_micro_batch_size_per_gpu()),
        ds_accumulation=int(engine.gradient_accumulation_steps()),
        ds_global_batch=int(engine.train_batch_size()),
        ds_data_parallel=int(engine.dp_world_size),
        loader_micro_batches=int(loader_micro_batches),
        first_batch_size=int(first_batch_size),
        num_samples=int(num_samples),
    )


def expected_from_plan(plan: Plan, start_step_in_epoch: int = 0) -> Expected:
    remaining_steps = plan.steps_per_epoch - start_step_in_epoch
    return Expected(
        micro_batch=plan.micro_batch_size,
        accumulation=plan.gradient_accumulation_steps,
        global_batch=plan.global_batch_size,
        data_parallel=plan.world_size,
        loader_micro_batches=remaining_steps * plan.gradient_accumulation_steps,
        num_samples=plan.num_samples,
    )


def find_mismatches(reports: list[RankReport], expected: Expected) -> list[str]:
    """Every disagreement, one line each, naming the rank, the quantity and both numbers."""
    problems = []
    checks = [
        ("DeepSpeed micro batch per rank", "ds_micro_batch", expected.micro_batch),
        ("DeepSpeed gradient accumulation", "ds_accumulation", expected.accumulation),
        ("DeepSpeed global batch", "ds_global_batch", expected.global_batch),
        ("DeepSpeed data-parallel size", "ds_data_parallel", expected.data_parallel),
        ("loader micro batches this epoch", "loader_micro_batches", expected.loader_micro_batches),
        ("first batch leading dimension", "first_batch_size", expected.micro_batch),
        ("dataset size", "num_samples", expected.num_samples),
    ]
    for report in reports:
        for label, attr, want in checks:
            got = getattr(report, attr)
            if got != want:
                problems.append(f"rank {report.rank} ({report.host}): {label} is {got}, the plan says {want}")
    if len(reports) != expected.data_parallel:
        problems.append(f"{len(reports)} ranks reported, the plan has {expected.data_parallel}")
    return problems


def render_table(reports: list[RankReport], expected: Expected) -> str:
    """Plain-text table (it goes to logs as well as terminals): one column per rank, plus the plan."""
    rows = [
        ("micro batch", "ds_micro_batch", expected.micro_batch),
        ("accumulation", "ds_accumulation", expected.accumulation),
        ("global batch", "ds_global_batch", expected.global_batch),
        ("data-parallel", "ds_data_parallel", expected.data_parallel),
        ("loader micro batches", "loader_micro_batches", expected.loader_micro_batches),
        ("first batch size", "first_batch_size", expected.micro_batch),
        ("dataset samples", "num_samples", expected.num_samples),
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
        table += ("\n\nThe loader or the DeepSpeed config does not do what the spec planned; training would silently "
                  "see a different number of samples per step. Nothing was trained.")
    return not problems, table, [asdict(r) for r in reports]
