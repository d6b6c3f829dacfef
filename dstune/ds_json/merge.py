"""A user's own DeepSpeed JSON (`deepspeed.config`), merged into the config compiled from the spec.

By then the file's concrete values fill the spec keys the spec leaves unset (dstune.ds_json.fill_spec), so what is
left: the file keeps every setting the spec does not cover; "auto" takes the spec's value or dstune's default; a
value dstune needs otherwise is an error naming the key and the fix. DeepSpeed's `scheduler` is always replaced by
dstune's schedule. Pure (no torch or deepspeed); what DeepSpeed rejects is found by `dstune.ds_json.cross_check`.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dstune.plan import Plan
from dstune.spec.load import SpecIssue, SpecSource, json_key_line, line_of
from dstune.spec.models import DeepSpeedSpec, TrainSpec

DEEPSPEED_CHECKED = "0.19.8"
AUTO = "auto"
_MISSING = object()

# Every top-level key DeepSpeedConfig 0.19.8 reads (recorded from DeepSpeedConfig.__init__, kept in sync by
# tests/unit/test_ds_config_user.py), plus two that deepspeed.initialize reads. DeepSpeed ignores any other top-level
# key without a word, so a typo such as `gradient_clip` would be lost: dstune warns with a "did you mean".
KNOWN_TOP_LEVEL_KEYS = frozenset(
    """
    activation_checkpointing aio amp autotuning bf16 bfloat16 checkpoint comet comms_logger communication_data_type
    compile compression_training csv_monitor curriculum_learning data_efficiency data_types dataloader_drop_last
    datastates_ckpt disable_allgather disable_python_gc dump_state eigenvalue elasticity expert_parallel flops_profiler
    fp16 gradient_accumulation_steps gradient_allreduce_op gradient_clipping gradient_predivide_factor graph_harvesting
    hybrid_engine log_level managed_gradient_accumulation memory_breakdown nebula optimizer pipeline prescale_gradients
    progressive_layer_drop quantize_training scheduler seq_parallel_communication_data_type sparse_attention
    sparse_gradients steps_per_print tensor_parallel tensorboard timers torch_autocast train_batch_size
    train_micro_batch_size_per_gpu use_data_before_expert_parallelism vocabulary_size wall_clock_breakdown wandb
    weight_quantization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer zero_optimization
    sequence_parallel_size data_parallel_size
""".split()
)  # the last two: read by deepspeed.initialize (mesh setup)


@dataclass(frozen=True)
class _Rule:
    spec_key: str
    always: bool  # True: the spec decides even when it only has its default; False: only when the spec wrote it


# JSON keys the spec decides. A concrete value in the file that differs is an error; "auto" takes the spec's value.
OWNED = {
    "train_batch_size": _Rule("train.global_batch_size", True),
    "train_micro_batch_size_per_gpu": _Rule("train.micro_batch_size", True),
    "gradient_accumulation_steps": _Rule("train.gradient_accumulation_steps", True),
    "gradient_clipping": _Rule("train.gradient_clipping", True),
    "fp16.enabled": _Rule("train.precision", True),
    "bf16.enabled": _Rule("train.precision", True),
    "zero_optimization.stage": _Rule("deepspeed.zero_stage", True),
    **{
        f"zero_optimization.{block}.{name}": _Rule(f"deepspeed.{block}.{name}", name == "device")
        for block in ("offload_optimizer", "offload_param")
        for name in ("device", "nvme_path", "pin_memory")
    },
    **{
        f"zero_optimization.{name}": _Rule(f"deepspeed.{name}", False)
        for name in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm")
    },
    **{
        f"activation_checkpointing.{name}": _Rule(f"deepspeed.activation_checkpointing.{name}", False)
        for name in (
            "partition_activations",
            "cpu_checkpointing",
            "contiguous_memory_optimization",
            "number_checkpoints",
        )
    },
}

# Keys dstune needs at a given value whenever the compiled config writes them (why, for the message).
REQUIRED = {
    "zero_allow_untested_optimizer": "DeepSpeed refuses a client optimizer it has not tested under ZeRO without it "
    "(engine.py _do_optimizer_sanity_check)",
    "zero_force_ds_cpu_optimizer": "with offload_optimizer DeepSpeed refuses a client optimizer unless it is false "
    "(engine.py _configure_optimizer)",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "dstune's export needs the gathered 16-bit weights "
    "under ZeRO-3",
}

_BATCH_SPEC_KEYS = ("train.global_batch_size", "train.micro_batch_size", "train.gradient_accumulation_steps")

# DeepSpeed scheduler types and the dstune schedules that behave like them.
SCHEDULER_EQUIVALENTS = {
    "WarmupLR": ("constant", "constant_with_warmup"),
    "WarmupDecayLR": ("linear",),
    "WarmupCosineLR": ("cosine",),
}

# Field names DeepSpeed's ZeRO model also accepts (populate_by_name) for keys dstune writes under their stage3_ alias.
_ZERO_FIELD_ALIASES = {
    name: f"stage3_{name}"
    for name in ("prefetch_bucket_size", "param_persistence_threshold", "gather_16bit_weights_on_model_save")
}


# --------------------------------------------------------------------------------------------------- merging


@dataclass
class MergeContext:
    """What every check needs: where issues point, the spec's values, and the issues found so far."""

    train: TrainSpec
    plan: Plan
    source: SpecSource
    path: Path
    text: str
    reference: dict  # dotted DeepSpeed key -> the value the spec and plan give it
    compiled_flat: dict
    issues: list[SpecIssue] = field(default_factory=list)

    def where(self, dotted: str) -> str:
        line = json_key_line(self.text, dotted) if self.text else None
        return f"{self.path}:{line}" if line else str(self.path)

    def add(self, dotted: str, message: str, severity: str = "error") -> None:
        self.issues.append(SpecIssue(dotted, " ".join(message.split()), self.where(dotted), severity))

    def spec_wrote(self, spec_key: str) -> bool:
        return any(k == spec_key or k.startswith(spec_key + ".") for k in (*self.source.lines, *self.source.overridden))

    def origin(self, spec_key: str) -> str:
        """How the spec arrives at its value, for conflict messages."""
        p = self.plan
        if spec_key in _BATCH_SPEC_KEYS:
            return (
                f"the plan: global batch {p.global_batch_size} = micro {p.micro_batch_size} x accumulation "
                f"{p.gradient_accumulation_steps} x {p.world_size} ranks; {spec_key} at "
                f"{self.source.where(spec_key)}"
            )
        if spec_key == "train.optimizer.lr" and p.lr_scale != 1.0:
            return f"{spec_key} {p.base_lr:g} x lr_scaling {p.lr_scale:g} at {self.source.where(spec_key)}"
        value = f" is {self.train.precision!r}" if spec_key == "train.precision" else ""
        if spec_key in self.source.filled:
            return f"{spec_key}{value}, from {self.source.filled[spec_key]}"
        if not self.spec_wrote(spec_key):
            return f"{spec_key}{value}, not in {self.source.path}: its default"
        return f"{spec_key}{value} at {self.source.where(spec_key)}"


def flatten(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, v in value.items():
        out.update(flatten(v, f"{prefix}{key}.") if isinstance(v, dict) else {f"{prefix}{key}": v})
    return out


def stage3_bucket_sizes(reduce_bucket_size: int) -> tuple[int, int]:
    """ZeRO-3 prefetch bucket and parameter persistence threshold, in elements, scaled from the reduce bucket.

    HF Trainer's "auto" uses hidden_size**2 for the reduce bucket, 0.9 x that for prefetch and 10 x hidden_size for
    persistence; dstune does not know a hidden size here, so it keeps those ratios to the spec's reduce bucket
    (the default 5e7 gives 45,000,000 and 70,710; DeepSpeed's own defaults are 5e7 and 1e5).
    """
    return int(0.9 * reduce_bucket_size), 10 * math.isqrt(reduce_bucket_size)


def spec_values(compiled: dict, deepspeed: DeepSpeedSpec) -> dict:
    """Dotted DeepSpeed key -> the spec's value, for every key "auto" may stand for (a superset of `compiled`)."""
    prefetch, persistence = stage3_bucket_sizes(deepspeed.reduce_bucket_size)
    zero = "zero_optimization."
    out = {
        f"{zero}contiguous_gradients": True,
        f"{zero}overlap_comm": deepspeed.overlap_comm,
        f"{zero}reduce_bucket_size": deepspeed.reduce_bucket_size,
        f"{zero}allgather_bucket_size": deepspeed.allgather_bucket_size,
        f"{zero}stage3_prefetch_bucket_size": prefetch,
        f"{zero}stage3_param_persistence_threshold": persistence,
        f"{zero}stage3_gather_16bit_weights_on_model_save": True,
        "zero_allow_untested_optimizer": False,
        "zero_force_ds_cpu_optimizer": True,  # DeepSpeed's defaults
    }
    for name in ("offload_optimizer", "offload_param"):
        offload = getattr(deepspeed, name)
        out[f"{zero}{name}.device"] = offload.device
        out[f"{zero}{name}.pin_memory"] = offload.pin_memory
        if offload.nvme_path:
            out[f"{zero}{name}.nvme_path"] = offload.nvme_path
    checkpointing = deepspeed.activation_checkpointing.model_dump(exclude_none=True)
    out.update({f"activation_checkpointing.{name}": value for name, value in checkpointing.items()})
    out.update(flatten(compiled))
    return out


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return isinstance(a, bool) == isinstance(b, bool) and math.isclose(float(a), float(b), rel_tol=1e-9)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def _conflict(ctx: MergeContext, dotted: str, value: Any, expected: Any, spec_key: str) -> None:
    ctx.add(
        dotted,
        f"{json.dumps(value)} in the file, but dstune uses {json.dumps(expected)} ({ctx.origin(spec_key)}). "
        f'Make them agree: change {spec_key} in the spec, or write {json.dumps(expected)} or "auto" in the file.',
    )


def _check_concrete(ctx: MergeContext, dotted: str, value: Any) -> Any:
    rule = OWNED.get(dotted)
    if rule is not None and dotted in ctx.reference and (rule.always or ctx.spec_wrote(rule.spec_key)):
        expected = ctx.reference[dotted]
        if not same_value(value, expected):
            _conflict(ctx, dotted, value, expected, rule.spec_key)
            return value
        return expected  # the spec's type (int, not 2e8)
    if dotted in REQUIRED and dotted in ctx.compiled_flat and not same_value(value, ctx.compiled_flat[dotted]):
        needed = ctx.compiled_flat[dotted]
        ctx.add(
            dotted,
            f"{json.dumps(value)} in the file, but dstune needs {json.dumps(needed)}: {REQUIRED[dotted]}. "
            f'Write {json.dumps(needed)} or "auto", or remove the key.',
        )
    return value


def _merge_dicts(ctx: MergeContext, ours: dict, theirs: dict, prefix: str = "") -> dict:
    out = dict(ours)
    for key, value in theirs.items():
        dotted = f"{prefix}{key}"
        mine = ours.get(key, _MISSING)
        if isinstance(value, dict):
            if dotted in OWNED:
                _conflict(ctx, dotted, value, ctx.reference.get(dotted), OWNED[dotted].spec_key)
            out[key] = _merge_dicts(ctx, mine if isinstance(mine, dict) else {}, value, dotted + ".")
        elif isinstance(mine, dict):
            ctx.add(dotted, f"must be a JSON object like {json.dumps(mine)}, not {json.dumps(value)}")
        elif value == AUTO:
            if dotted in ctx.reference:
                out[key] = ctx.reference[dotted]
            else:
                out.pop(key, None)
                ctx.add(
                    dotted,
                    '"auto" has no value in dstune (the spec does not set this key). Write a value, or '
                    "remove the key to get DeepSpeed's default.",
                )
        else:
            out[key] = _check_concrete(ctx, dotted, value)
    return out


# --------------------------------------------------------------------------------- file-level rules and blocks


def _normalize_names(ctx: MergeContext, user: dict) -> dict:
    """Old and alternative spellings DeepSpeed accepts, rewritten to the keys dstune writes (so they cannot clash)."""
    user = dict(user)
    if "bfloat16" in user:
        old = user.pop("bfloat16")
        if "bf16" in user:
            ctx.add("bfloat16", "DeepSpeed ignores this old name because `bf16` is also given; dropped", "warning")
        else:
            user["bf16"] = old
            ctx.add("bfloat16", "old DeepSpeed name, read as `bf16`", "warning")
    zero = user.get("zero_optimization")
    if zero is None:
        return user
    if not isinstance(zero, dict):
        ctx.add(
            "zero_optimization",
            f'must be a JSON object such as {{"stage": 2}}, not {json.dumps(zero)} (the old '
            "boolean form is not supported); set the stage with deepspeed.zero_stage in the spec",
        )
        user.pop("zero_optimization")
        return user
    zero = dict(zero)
    for name in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
        if name in zero:
            zero.pop(name)
            ctx.add(
                f"zero_optimization.{name}",
                "deprecated DeepSpeed key; remove it and set "
                "deepspeed.offload_optimizer / deepspeed.offload_param in the spec",
            )
    old, new = "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
    if old in zero and new in zero:
        ctx.add(f"zero_optimization.{old}", f"DeepSpeed refuses the deprecated {old} together with {new}; remove it")
        zero.pop(old)
    elif old in zero:
        zero[new] = zero.pop(old)
        ctx.add(f"zero_optimization.{old}", f"deprecated DeepSpeed name, read as {new}", "warning")
    for name, alias in _ZERO_FIELD_ALIASES.items():
        if name in zero and alias not in zero:
            zero[alias] = zero.pop(name)
    user["zero_optimization"] = zero
    return user


def _check_data_parallel_only(ctx: MergeContext, user: dict) -> None:
    """dstune's plan assumes every rank is a data-parallel rank (a full replica under ZeRO); these keys change that."""
    sizes = {
        f"{block}.{name}": user[block].get(name)
        for block, name in (("tensor_parallel", "autotp_size"), ("expert_parallel", "autoep_size"))
        if isinstance(user.get(block), dict)
    }
    for key, size in sizes.items():
        if isinstance(size, (int, float)) and size > 1:
            ctx.add(
                key,
                f"{json.dumps(size)}: dstune trains data-parallel only; model parallelism would change the "
                "data-parallel size the batch plan uses. Remove the key.",
            )
    size = user.get("sequence_parallel_size")
    if size is not None and not same_value(size, ctx.plan.sequence_parallel_size):
        ctx.add(
            "sequence_parallel_size",
            f"{json.dumps(size)} in the file, but the spec plans "
            f"deepspeed.sequence_parallel_size {ctx.plan.sequence_parallel_size}: set it in the spec "
            "(deepspeed.sequence_parallel_size), which lays out the ranks and the batch plan, and remove the key",
        )
    size = user.get("data_parallel_size")
    if size is not None and not same_value(size, ctx.plan.data_parallel_size):
        ctx.add(
            "data_parallel_size",
            f"{json.dumps(size)} in the file, but dstune plans for "
            f"{ctx.plan.data_parallel_size} data-parallel ranks (ranks / deepspeed.sequence_parallel_size); "
            "remove the key",
        )


def _warn_unknown_top_level(ctx: MergeContext, user: dict) -> None:
    for key in user:
        if key in KNOWN_TOP_LEVEL_KEYS or key.startswith("_"):  # "_comment" style keys are notes by convention
            continue
        close = difflib.get_close_matches(key, sorted(KNOWN_TOP_LEVEL_KEYS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        ctx.add(
            key,
            f"DeepSpeed {DEEPSPEED_CHECKED} does not know this top-level key and ignores it silently{hint}",
            "warning",
        )


def _check_optimizer_type(ctx: MergeContext, block: dict) -> None:
    """DeepSpeed's type names vs train.optimizer.type."""
    wanted = ctx.train.optimizer.type
    written = block.get("type", AUTO)
    name = str(written).lower()
    params = block.get("params") if isinstance(block.get("params"), dict) else {}
    # engine.py _configure_basic_optimizer: type Adam runs AdamW unless params.adam_w_mode is false (default true).
    decoupled = name == "adamw" or (name == "adam" and params.get("adam_w_mode", True) is True)
    if written == AUTO or ("adamw" if decoupled else name) == wanted:
        return
    where = ctx.source.where("train.optimizer.type")
    if wanted == "adam" and name == "adam":
        ctx.add(
            "optimizer.type",
            f'"Adam" with adam_w_mode true (DeepSpeed\'s default) runs AdamW, but '
            f"train.optimizer.type is 'adam' ({where}). Add \"adam_w_mode\": false to optimizer.params, or set "
            "train.optimizer.type: adamw.",
        )
    elif name not in ("adam", "adamw", "lion"):
        ctx.add(
            "optimizer.type",
            f"{json.dumps(written)}: dstune builds the optimizer itself and has no {written} (it "
            "has adamw, adam, adafactor, lion, sgd: train.optimizer.type). Remove the optimizer block and set "
            "train.optimizer.",
        )
    else:
        ctx.add(
            "optimizer.type",
            f"{json.dumps(written)} in the file, but train.optimizer.type is {wanted!r} ({where}). "
            "Make them agree, or remove the optimizer block (dstune builds the optimizer from train.optimizer).",
        )


def _merge_optimizer(ctx: MergeContext, block: Any, ours: dict | None) -> dict | None:
    if not isinstance(block, dict):
        ctx.add("optimizer", f"must be a JSON object with type and params, not {json.dumps(block)}")
        return ours
    _check_optimizer_type(ctx, block)
    params = block.get("params", {})
    if not isinstance(params, dict):
        ctx.add("optimizer.params", f"must be a JSON object, not {json.dumps(params)}")
        params = {}
    opt = ctx.train.optimizer
    expected = {"lr": ctx.plan.effective_lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}
    extra = {}
    for name, value in params.items():
        dotted = f"optimizer.params.{name}"
        if name == "max_grad_norm":
            ctx.add(
                dotted,
                "DeepSpeed refuses max_grad_norm as an optimizer parameter (engine.py "
                "_configure_basic_optimizer); remove it and use train.gradient_clipping",
            )
        elif name in expected:
            if value != AUTO and not same_value(value, expected[name]):
                _conflict(ctx, dotted, value, expected[name], f"train.optimizer.{name}")
        elif value == AUTO:
            ctx.add(dotted, '"auto" has no value in dstune; write a value or remove the key')
        else:
            extra[name] = value
    if ours is None:
        ignored = f" Params not applied: {', '.join(sorted(extra))}." if extra else ""
        ctx.add(
            "optimizer",
            f"not used: dstune builds the {opt.type} optimizer itself from train.optimizer and passes "
            "it to DeepSpeed; DeepSpeed's own optimizer is used only for adam/adamw with offload_optimizer "
            f"cpu/nvme (its fast CPU Adam).{ignored}",
            "warning",
        )
        return None
    others = {k: v for k, v in block.items() if k not in ("type", "params")}
    return {**others, "type": ours["type"], "params": {**extra, **ours["params"]}}


def _check_scheduler(ctx: MergeContext, block: Any) -> None:
    """DeepSpeed's scheduler is run by dstune as train.scheduler (the file's values fill the keys the spec leaves
    unset: dstune.ds_json.fill_spec); disagreeing concrete values are errors."""
    ours = ctx.train.scheduler
    if not isinstance(block, dict):
        ctx.add("scheduler", f"must be a JSON object with type and params, not {json.dumps(block)}")
        return
    errors = len(ctx.issues)
    kind = block.get("type", AUTO)
    if kind != AUTO and ours.type not in SCHEDULER_EQUIVALENTS.get(kind, ()):
        ctx.add(
            "scheduler.type",
            f"{json.dumps(kind)} in the file, but train.scheduler.type is {ours.type!r} "
            f"({ctx.source.where('train.scheduler.type')}); dstune's own schedule replaces DeepSpeed's. Set "
            "train.scheduler to the schedule you want and remove the scheduler block (or make it agree).",
        )
    p = ctx.plan
    warmup = "train.scheduler.warmup_steps"
    expected = {  # DeepSpeed scheduler param -> (dstune's value, the spec key that sets it)
        "warmup_min_lr": (0.0, warmup),
        "warmup_min_ratio": (0.0, warmup),
        "warmup_num_steps": (p.warmup_steps, warmup),
        "warmup_max_lr": (p.effective_lr, "train.optimizer.lr"),
        "warmup_type": ("linear", "train.scheduler.type"),
        "total_num_steps": (p.total_steps, "train.max_steps" if ctx.train.max_steps else "train.epochs"),
        "cos_min_ratio": (ours.min_lr_ratio, "train.scheduler.min_lr_ratio"),
    }
    params = block.get("params", {}) if isinstance(block.get("params", {}), dict) else {}
    for name, value in params.items():
        if value == AUTO or name not in expected:
            continue
        want, spec_key = expected[name]
        # HF writes warmup_num_steps max(1, warmup) because DeepSpeed >= 0.19.6 refuses 0: same schedule.
        if not same_value(value, want) and not (name == "warmup_num_steps" and want == 0 and same_value(value, 1)):
            _conflict(ctx, f"scheduler.params.{name}", value, want, spec_key)
    if len(ctx.issues) == errors and ctx.spec_wrote("train.scheduler"):  # from the file alone: it is the schedule
        ctx.add(
            "scheduler",
            f"repeats train.scheduler ({ctx.source.where('train.scheduler')}): the run's schedule is {ours.type} "
            f"({p.warmup_steps} linear warmup steps from 0, {p.total_steps} optimizer steps), which dstune steps "
            f"itself in place of DeepSpeed's {kind}; keep it in one place (the spec's train.scheduler)",
            "warning",
        )


def merge_user_ds_config(
    user: dict,
    compiled: dict,
    train: TrainSpec,
    deepspeed: DeepSpeedSpec,
    plan: Plan,
    source: SpecSource,
    path: Path,
    text: str = "",
) -> tuple[dict, list[SpecIssue]]:
    """The user's DeepSpeed JSON with "auto" filled from the spec, over the compiled config.

    Returns (merged config, issues); issues include errors (conflicts, "auto" without a value) for the caller to
    raise together with its own. `text` (the file's text) lets issues point at lines.
    """
    ctx = MergeContext(train, plan, source, Path(path), text, spec_values(compiled, deepspeed), flatten(compiled))
    user = _normalize_names(ctx, user)
    _check_data_parallel_only(ctx, user)
    _warn_unknown_top_level(ctx, user)
    optimizer = compiled.get("optimizer")
    if "optimizer" in user:
        optimizer = _merge_optimizer(ctx, user["optimizer"], optimizer)
    if "scheduler" in user:
        _check_scheduler(ctx, user["scheduler"])
    rest = {k: v for k, v in user.items() if k not in ("optimizer", "scheduler")}
    merged = _merge_dicts(ctx, {k: v for k, v in compiled.items() if k != "optimizer"}, rest)
    if optimizer is not None:
        merged["optimizer"] = optimizer
    ctx.issues.sort(key=lambda issue: line_of(issue.where))
    return merged, ctx.issues
