"""What `dstune validate` prints (and training prints on rank 0 before step 1): the plan as a rich table, then the
warnings, the errors and a one-line verdict.

Issue lines are printed without wrapping, `where: key: message`, so they can be grepped and clicked in an editor.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from dataclasses import dataclass
from typing import Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dstune.ds_json.merge import flatten
from dstune.memory.plan import state_bytes_per_param
from dstune.spec.load import SpecIssue
from dstune.sequence_parallel import report_rows as sequence_rows
from dstune.memory_report import memory_rows
from dstune.sets_plan import set_table_rows
from dstune.video_plan import summary_rows

ZERO_STAGES = {
    0: "off (plain data parallel)",
    1: "optimizer states partitioned",
    2: "optimizer states + gradients partitioned",
    3: "optimizer states + gradients + parameters partitioned",
}


@dataclass(frozen=True)
class Outcome:
    """Everything `validate` can show: a full resolution, or the parts that were worked out before the errors."""

    spec: object = None  # dstune.spec.models.Spec
    world: object = None  # dstune.world.World
    plan: object = None  # dstune.plan.Plan
    ds_config: Optional[dict] = None
    num_samples_origin: str = ""
    warnings: tuple[SpecIssue, ...] = ()
    errors: tuple[SpecIssue, ...] = ()
    ds_sources: Optional[dict] = None  # DeepSpeed key -> where its value came from (dstune.ds_json.fill_spec)
    memory: Optional[dict] = None  # dstune.validate.plan_memory (validate only)
    clips: Optional[dict] = None  # video families: dstune.video_plan's clip summary
    resolution_origin: str = ""  # images and video: where data.resolution came from ("" for speech)
    guidance_origin: str = ""  # images and video: where sample.guidance came from ("" for speech)
    voices: object = None  # speech: dstune.families.speakers.Voices, how the model hears the data's speakers
    sets: Optional[tuple] = None  # data.sets: dstune.sets_plan.SetRow per set

    @classmethod
    def of(cls, resolved) -> "Outcome":
        return cls(
            resolved.spec,
            resolved.world,
            resolved.plan,
            resolved.ds_config,
            resolved.num_samples_origin,
            tuple(resolved.warnings),
            ds_sources=resolved.ds_sources,
            clips=resolved.clips,
            resolution_origin=resolved.resolution_origin,
            guidance_origin=resolved.guidance_origin,
            voices=resolved.voices,
            sets=resolved.sets,
        )

    def as_json(self) -> dict:
        plan = self.plan.as_dict() if self.plan is not None else None
        if plan is not None:
            plan.pop("warnings", None)  # listed once, at the top level
        return {
            "plan": plan,
            "ds_config": self.ds_config if not self.errors else None,
            "ds_config_sources": self.ds_sources if not self.errors else None,
            "warnings": [str(w) for w in self.warnings],
            "errors": [str(e) for e in self.errors],
            "memory": self.memory,
            "clips": self.clips,
            **({"speakers": self.voices.as_json()} if self.voices is not None else {}),
            **({"sets": [dataclasses.asdict(row) for row in self.sets]} if self.sets else {}),  # data.sets only
        }


def _fmt(value: float) -> str:
    """3 significant digits, no exponent for ordinary numbers: 2.5, 0.0001, 1.33e-05."""
    return f"{value:.3g}"


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"


def _world_rows(world, sequence_parallel_size: int = 1) -> list[tuple[str, str]]:
    per_node = ", ".join(f"{host}: {count}" for host, count in list(zip(world.hosts, world.ranks_per_node))[:4])
    if world.num_nodes > 4:
        per_node += f", ... ({world.num_nodes - 4} more)"
    source = world.source
    if world.assumed:
        source += " (ASSUMED: plan for the real run with --num-gpus N, --world-size N or --hostfile FILE)"
    size = sequence_parallel_size
    ranks = (
        f"{world.world_size} data-parallel"
        if size == 1 or world.world_size % size
        else f"{world.world_size} = {world.world_size // size} data-parallel x {size} sequence-parallel"
    )
    return [("ranks", ranks), ("nodes", str(world.num_nodes)), ("ranks per node", per_node), ("from", source)]


def _batch_rows(plan, ds_config: Optional[dict], cross_checked: bool) -> list[tuple[str, str]]:
    rows = [
        ("micro batch", f"{plan.micro_batch_size} samples per rank per forward pass"),
        (
            "accumulation",
            f"{_count(plan.gradient_accumulation_steps, 'micro-batch', 'micro-batches')} per optimizer step",
        ),
        (
            "global batch",
            f"{plan.global_batch_size} samples per optimizer step = {plan.micro_batch_size} x "
            f"{plan.gradient_accumulation_steps} x {_count(plan.data_parallel_size, 'rank', 'ranks')}"
            + (" (data-parallel)" if plan.sequence_parallel_size > 1 else ""),
        ),
    ]
    if ds_config is not None:
        numbers = ", ".join(
            f"{key} {ds_config.get(key)}"
            for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        )
        rows.append(("DeepSpeed JSON", numbers + (f" (agreed by {_deepspeed_name()})" if cross_checked else "")))
    return rows


def _deepspeed_name() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"DeepSpeed {version('deepspeed')}"
    except PackageNotFoundError:
        return "DeepSpeed"


def _data_rows(plan, origin: str) -> list[tuple[str, str]]:
    summed = f", the sum over {_count(len(plan.groups), 'bucket', 'buckets')}" if plan.groups else ""
    return [
        ("samples", f"{plan.num_samples} ({origin})" if origin else str(plan.num_samples)),
        (
            "steps per epoch",
            f"{plan.steps_per_epoch} optimizer steps ({plan.micro_batches_per_epoch_per_rank} "
            f"micro-batches per rank{summed})",
        ),
        (
            "each epoch",
            f"uses {plan.samples_per_epoch} samples, leaves out {plan.dropped_per_epoch} (drop_last"
            f"{', per bucket' if plan.groups else ''})",
        ),
    ]


def _bucket_rows(plan) -> list[tuple[str, str]]:
    """One row per bucket (group): its samples, the global batches it makes per epoch, its remainder."""
    rows = []
    for group in plan.groups:
        never = "  (never trains: fewer samples than one global batch)" if group.steps == 0 else ""
        rows.append(
            (
                str(group.key),
                f"{group.samples} samples, {_count(group.steps, 'global batch', 'global batches')}"
                f" per epoch, leaves out {group.dropped}{never}",
            )
        )
    rows.append(
        (
            "total",
            f"{_count(len(plan.groups), 'bucket', 'buckets')}: {plan.num_samples} samples, "
            f"{plan.steps_per_epoch} optimizer steps per epoch, leaves out {plan.dropped_per_epoch}",
        )
    )
    return rows


def _length_rows(plan, train) -> list[tuple[str, str]]:
    how = "train.max_steps" if train is not None and train.max_steps is not None else "epochs x steps per epoch"
    return [
        ("total", f"{plan.total_steps} optimizer steps ({how})"),
        ("epochs", f"{_fmt(plan.epochs)} (passes over the whole dataset, all ranks together)"),
        ("samples seen", f"{plan.samples_seen} (each sample {_fmt(plan.times_each_sample_seen)} times on average)"),
    ]


# What each optimizer does with the LR and the schedule, where it is not plain Adam's (validate's optimizer row)
OPTIMIZER_RULES = {
    "prodigy": "lr multiplies its own step-size estimate (1.0: the estimate as is; x d_coef); no batch scaling",
    "adamw_schedulefree": "no decay schedule (its averaging is one); samples, checkpoints and the export hold its "
    "averaged weights",
    "adamw8bit": "AdamW with 8-bit block-wise moments (bitsandbytes)",
    "muon": "DeepSpeed's Muon on the matrices at muon_lr {muon_lr}, momentum {muon_momentum}; Adam on the rest at lr",
}


def _optimizer_text(train, deepspeed) -> str:
    opt = train.optimizer
    bf16_states = bool(deepspeed is not None and deepspeed.bf16_optimizer_states)
    zero_stage = deepspeed.zero_stage if deepspeed is not None else 0
    state = state_bytes_per_param(opt.type, train.precision, zero_stage, opt.momentum, bf16_states)
    rule = OPTIMIZER_RULES.get(opt.type, "").format(muon_lr=_fmt(opt.muon_lr), muon_momentum=_fmt(opt.muon_momentum))
    where = " (bf16 master weights and moments, DeepSpeed's CPU Adam)" if bf16_states else ""
    return (
        f"{opt.type}, weight decay {_fmt(opt.weight_decay)}{'; ' + rule if rule else ''}; "
        f"{_fmt(state)} bytes of state per trained parameter{where}"
    )


def _lr_rows(plan, train, deepspeed=None) -> list[tuple[str, str]]:
    rows = [("base lr", _fmt(plan.base_lr))]
    if train is not None and train.lr_scaling != "none":
        rows.append(
            (
                "scaling",
                f"{train.lr_scaling}: global {plan.global_batch_size} / reference "
                f"{train.reference_batch_size} -> x {_fmt(plan.lr_scale)}",
            )
        )
    else:
        rows.append(("scaling", "none"))
    rows.append(("effective lr", _fmt(plan.effective_lr)))
    rows.append(("warmup", f"{plan.warmup_steps} optimizer steps"))
    if train is not None:
        sched = train.scheduler
        decay = (
            f", decays to {_fmt(sched.min_lr_ratio)} x lr at step {plan.total_steps}"
            if sched.type in ("linear", "cosine")
            else ""
        )
        rows.append(("schedule", f"{sched.type}{decay}"))
        rows.append(("optimizer", _optimizer_text(train, deepspeed)))
    return rows


def _engine_rows(spec, plan) -> list[tuple[str, str]]:
    ds, train = spec.deepspeed, spec.train
    clipping = str(plan.gradient_clipping if plan is not None else train.resolved_gradient_clipping)
    if train.gradient_clipping is None:
        clipping += " (automatic: 1.0 for Adam-family, 0.0 for Adafactor)"
    rows = [
        ("precision", train.precision),
        ("ZeRO", f"stage {ds.zero_stage}: {ZERO_STAGES[ds.zero_stage]}"),
        ("offload", f"optimizer: {ds.offload_optimizer.device}, parameters: {ds.offload_param.device}"),
        ("gradient clipping", clipping),
    ]
    if ds.config:
        rows.append(
            (
                "merged JSON",
                f'{ds.config}: its values fill what the spec leaves unset; "auto" takes the '
                "spec's value or dstune's default (where each value came from: below)",
            )
        )
        rows.append(
            (
                "optimizer, schedule",
                f"dstune's own: {train.optimizer.type} from train.optimizer and the "
                f"{train.scheduler.type} schedule from train.scheduler; a scheduler block "
                "in the file is never run by DeepSpeed",
            )
        )
    return rows


def _source_rows(ds_config: dict, sources: dict) -> list[tuple[str, str]]:
    """One row per DeepSpeed value: `key = value  <- where it came from` (file:line, spec:line, default, plan)."""
    values = flatten(ds_config)
    return [(key, f"{json.dumps(values.get(key))}  <- {where}") for key, where in sources.items()]


def _weights_rows(spec) -> list[tuple[str, str]]:
    """What trains on which weights when a training adapter is fused into the frozen base."""
    return [
        (
            "trains on",
            f"{spec.model.pretrained} with model.training_adapter {spec.model.training_adapter} "
            "fused into the frozen transformer",
        ),
        ("exported LoRA", "the run's adapters only (the training adapter is left out)"),
    ]


def _denoiser_rows(spec) -> list[tuple[str, str]]:
    """Which transformer the samples render with, when it is not the trained one."""
    if spec.sample.pretrained:
        return [("denoiser", f"{spec.sample.pretrained}'s transformer with the trained LoRA (sample.pretrained)")]
    if getattr(spec.model, "training_adapter", None):
        return [
            ("denoiser", f"{spec.model.pretrained}'s transformer with the trained LoRA, without the training adapter")
        ]
    return []


def plan_table(outcome: Outcome) -> Optional[Table]:
    """The plan as one three-column table (group, item, value); None when nothing was worked out."""
    groups: list[tuple[str, list[tuple[str, str]]]] = []
    spec, plan = outcome.spec, outcome.plan
    train = spec.train if spec is not None else None
    if outcome.world is not None:
        groups.append(("World", _world_rows(outcome.world, spec.deepspeed.sequence_parallel_size if spec else 1)))
    if plan is not None:
        cross_checked = outcome.ds_config is not None and not outcome.errors
        groups += [
            (
                "Batch",
                _batch_rows(plan, outcome.ds_config if not outcome.errors else None, cross_checked)
                + sequence_rows(spec, plan, outcome.clips),
            ),
            (
                "Data",
                _data_rows(plan, outcome.num_samples_origin)
                + (
                    [("resolution", f"{spec.data.resolution} px ({outcome.resolution_origin})")]
                    if outcome.resolution_origin
                    else []
                )
                + (outcome.voices.rows() if outcome.voices is not None else []),
            ),
            *([("Sets", set_table_rows(plan, outcome.sets))] if outcome.sets else []),
            *([("Buckets", _bucket_rows(plan))] if plan.groups else []),
            *([("Clips", summary_rows(outcome.clips))] if outcome.clips else []),
            ("Length", _length_rows(plan, train)),
            ("LR", _lr_rows(plan, train, spec.deepspeed)),
            *(
                [
                    (
                        "Samples",
                        [("guidance", f"{spec.sample.guidance:g} ({outcome.guidance_origin})")] + _denoiser_rows(spec),
                    )
                ]
                if outcome.guidance_origin and spec.sample.prompts
                else []
            ),
        ]
        groups[-1:-1] = [("Weights", _weights_rows(spec))] if getattr(spec.model, "training_adapter", None) else []
    if spec is not None and (plan is not None or outcome.world is not None):
        groups.append(("DeepSpeed", _engine_rows(spec, plan)))
    if outcome.ds_sources and outcome.ds_config is not None and not outcome.errors and spec.deepspeed.config:
        groups.append(("DeepSpeed JSON values", _source_rows(outcome.ds_config, outcome.ds_sources)))
    if outcome.memory is not None and not outcome.errors:
        groups.append(("Memory", memory_rows(outcome.memory, spec)))
    if not groups:
        return None
    table = Table(show_header=False, box=None, pad_edge=False, padding=(0, 2, 0, 0))
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    for group, rows in groups:
        table.add_row(Text(group, style="bold"), "")
        for label, value in rows:
            table.add_row(f"  {label}", Text(value))
    return table


def verdict(outcome: Outcome) -> Text:
    warned = f", {len(outcome.warnings)} warning{'s' if len(outcome.warnings) != 1 else ''}" if outcome.warnings else ""
    if outcome.errors:
        count = len(outcome.errors)
        return Text(f"invalid: {count} error{'s' if count != 1 else ''}{warned}", style="bold red")
    plan = outcome.plan
    ranks = _count(plan.data_parallel_size, "rank", "ranks") + (
        f" (data-parallel; x {plan.sequence_parallel_size} sequence-parallel)"
        if plan.sequence_parallel_size > 1
        else ""
    )
    return Text(
        f"valid: {ranks} x micro {plan.micro_batch_size} x accumulation "
        f"{plan.gradient_accumulation_steps} = global batch {plan.global_batch_size}; "
        f"{plan.total_steps} optimizer steps = {_fmt(plan.epochs)} epochs{warned}",
        style="bold green",
    )


# Wide enough that no row of the plan is ever broken when the output is not a terminal (a pipe, a file, a log):
# rich assumes 80 columns there, and a long value (a deepspeed.config path) then squeezes every value column.
UNWRAPPED_WIDTH = 4096


def report_console(stderr: bool = False) -> Console:
    """The console the plan and the issues are printed on: a terminal's own width, or, when the stream is piped
    or redirected (and COLUMNS does not say otherwise), unwrapped lines that scripts and grep can read whole."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, highlight=False, width=UNWRAPPED_WIDTH)
    return console


def print_report(outcome: Outcome, console: Console, title: str = "") -> None:
    if title:
        console.print(Text(title, style="bold"), soft_wrap=True)
    table = plan_table(outcome)
    if table is not None and console.is_terminal:
        console.print(table)
    elif table is not None:  # piped: the same rows without the padding that fills each line to the table's width
        with console.capture() as captured:
            console.print(table)
        console.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    print_issues(outcome, console)
    console.print(verdict(outcome), soft_wrap=True)


def print_issues(outcome: Outcome, console: Console) -> None:
    for kind, issues, style in (("warning", outcome.warnings, "yellow"), ("error", outcome.errors, "red")):
        if issues:
            console.print()
        for issue in issues:
            line = Text(f"{kind}: ", style=f"bold {style}")
            line.append(str(issue))
            console.print(line, soft_wrap=True)


def plan_text(resolved, width: int = UNWRAPPED_WIDTH) -> str:
    """The plan of a successful resolution as plain text, one line per row (training prints this on rank 0)."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, no_color=True, highlight=False, force_terminal=False)
    outcome = Outcome.of(resolved)
    console.print(plan_table(outcome))
    print_issues(outcome, console)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip("\n").splitlines())
