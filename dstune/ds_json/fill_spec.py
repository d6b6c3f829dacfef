"""The user's DeepSpeed JSON (`deepspeed.config`) fills every spec key the spec leaves unset, before the plan is made.

    apply_ds_file(spec, source) -> (spec, source, conflicts)   the spec as the run uses it
    ds_value_sources(ds_config, spec, source) -> {key: where}   where each DeepSpeed value came from, for the plan

The rule: a concrete value in the file is used for a spec key the spec does not write (ZeRO stage and its options,
offload, precision, batch numbers, clipping, activation checkpointing, optimizer values, the schedule's type and
warmup); "auto" in the file takes the spec's value or dstune's default (dstune.ds_json.merge fills it); a key
written in both places to different values is an error at the file's line naming the spec's line. "Written" is
pydantic's `model_fields_set`: the keys of the YAML and of --set. The filled keys are recorded in
`SpecSource.filled`, so every later message about them (a batch that does not divide, a stage the family refuses)
points at the file's line. dstune still builds the optimizer and steps its own schedule (dstune.ds_json.merge).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from dstune.ds_json.user_file import load_user_ds_config, user_config_path
from dstune.ds_json.merge import AUTO, OWNED, flatten, same_value
from dstune.spec.load import SpecError, SpecIssue, SpecSource, json_key_line, validate_data
from dstune.spec.models import Spec

# File key -> the spec key its concrete value fills. Precision, the optimizer type and the schedule's type are
# read by their own functions below (one spec key from several file keys).
SPEC_KEY_OF = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "gradient_clipping": "train.gradient_clipping",
    "zero_optimization.stage": "deepspeed.zero_stage",
    **{
        f"zero_optimization.{name}": f"deepspeed.{name}"
        for name in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm")
    },
    **{
        f"zero_optimization.{block}.{name}": f"deepspeed.{block}.{name}"
        for block in ("offload_optimizer", "offload_param")
        for name in ("device", "nvme_path", "pin_memory")
    },
    **{
        f"activation_checkpointing.{name}": f"deepspeed.activation_checkpointing.{name}"
        for name in (
            "partition_activations",
            "cpu_checkpointing",
            "contiguous_memory_optimization",
            "number_checkpoints",
        )
    },
    **{f"optimizer.params.{name}": f"train.optimizer.{name}" for name in ("lr", "betas", "eps", "weight_decay")},
    "scheduler.params.warmup_num_steps": "train.scheduler.warmup_steps",
    "scheduler.params.cos_min_ratio": "train.scheduler.min_lr_ratio",
}
_INTEGER_KEYS = {
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.gradient_accumulation_steps",
    "deepspeed.zero_stage",
    "deepspeed.reduce_bucket_size",
    "deepspeed.allgather_bucket_size",
    "deepspeed.activation_checkpointing.number_checkpoints",
    "train.scheduler.warmup_steps",
}
# DeepSpeed's optimizer and scheduler type names (it lowercases them) -> dstune's; others have no dstune equivalent.
OPTIMIZER_TYPES = {"adamw": "adamw", "lion": "lion"}  # "adam": adamw unless params.adam_w_mode is false
SCHEDULER_TYPES = {"warmupdecaylr": "linear", "warmupcosinelr": "cosine"}  # warmuplr: constant(_with_warmup)


@dataclasses.dataclass
class _Reading:
    """The file, and what it fills so far: spec key -> (value, file key)."""

    user: dict
    text: str
    path: Path
    fills: dict = dataclasses.field(default_factory=dict)

    def line(self, file_key: str) -> str:
        line = json_key_line(self.text, file_key)
        return f"{self.path}:{line}" if line else str(self.path)


def _get(user: dict, dotted: str) -> Any:
    node: Any = user
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _concrete(value: Any) -> bool:
    return value is not None and value != AUTO and not isinstance(value, dict)


def _as_spec_value(spec_key: str, value: Any) -> Any:
    """5e8 (JSON writers' float) -> 500000000 for integer keys; anything else as written, for pydantic to judge."""
    if spec_key in _INTEGER_KEYS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _precision(user: dict) -> tuple[str, str] | None:
    """(precision, file key) the fp16/bf16 blocks ask for, or None when they leave it to the spec."""
    bf16 = user.get("bf16", user.get("bfloat16"))
    bf16_key = "bf16" if "bf16" in user else "bfloat16"
    enabled = {
        name: block.get("enabled")
        for name, block in (("fp16", user.get("fp16")), (bf16_key, bf16))
        if isinstance(block, dict)
    }
    on = [name for name, value in enabled.items() if value is True]
    if on:
        return ("fp16" if on[0] == "fp16" else "bf16"), f"{on[0]}.enabled"
    off = [name for name, value in enabled.items() if value is False]
    if off and len(off) == len(enabled) and len(off) == 2:
        return "fp32", f"{off[0]}.enabled"  # both written false: the file asks for fp32
    return None


def _optimizer_type(user: dict) -> tuple[str, str] | None:
    block = user.get("optimizer")
    if not isinstance(block, dict) or not _concrete(block.get("type")):
        return None
    name = str(block["type"]).lower()
    params = block.get("params") if isinstance(block.get("params"), dict) else {}
    if name == "adam":  # DeepSpeed runs AdamW for "Adam" unless adam_w_mode is false (engine.py)
        return ("adam" if params.get("adam_w_mode", True) is False else "adamw"), "optimizer.type"
    return (OPTIMIZER_TYPES[name], "optimizer.type") if name in OPTIMIZER_TYPES else None


def _scheduler_fills(user: dict) -> dict:
    """Spec key -> (value, file key) for the schedule: its type and warmup (a DeepSpeed warmup of 0 or 1 step is
    no warmup: DeepSpeed >= 0.19.6 refuses 0, so HF writes 1)."""
    block = user.get("scheduler")
    if not isinstance(block, dict) or not _concrete(block.get("type")):
        return {}
    name = str(block["type"]).lower()
    params = block.get("params") if isinstance(block.get("params"), dict) else {}
    warmup = params.get("warmup_num_steps")
    warms = _concrete(warmup) and isinstance(warmup, (int, float)) and warmup > 1
    out = {}
    if name in SCHEDULER_TYPES:
        out["train.scheduler.type"] = (SCHEDULER_TYPES[name], "scheduler.type")
    elif name == "warmuplr" and warms:
        out["train.scheduler.type"] = ("constant_with_warmup", "scheduler.type")
    if not warms:
        return out  # no warmup to fill (and "constant" must not get warmup_steps)
    if _concrete(params.get("warmup_max_lr")) and not _concrete(_get(user, "optimizer.params.lr")):
        out["train.optimizer.lr"] = (params["warmup_max_lr"], "scheduler.params.warmup_max_lr")
    return out


def _file_values(user: dict) -> dict:
    """Spec key -> (value, file key) for every concrete value of the file that a spec key holds."""
    values = {}
    for file_key, spec_key in SPEC_KEY_OF.items():
        value = _get(user, file_key)
        if _concrete(value) or (isinstance(value, list) and AUTO not in value):
            values[spec_key] = (_as_spec_value(spec_key, value), file_key)
    if "train.scheduler.warmup_steps" in values and not _scheduler_fills(user):
        values.pop("train.scheduler.warmup_steps")  # 0 or 1 step, or a schedule dstune has no name for
    for spec_key, found in (("train.precision", _precision(user)), ("train.optimizer.type", _optimizer_type(user))):
        if found:
            values[spec_key] = found
    for spec_key, found in _scheduler_fills(user).items():
        values.setdefault(spec_key, found)
    return values


def spec_sets(spec: Spec, dotted: str) -> bool:
    """True when the spec itself (its YAML or --set) wrote `dotted`: pydantic's model_fields_set at every level."""
    node: Any = spec
    for part in dotted.split("."):
        if part not in getattr(node, "model_fields_set", ()):
            return False
        node = getattr(node, part)
    return True


def _spec_value(spec: Spec, dotted: str) -> Any:
    node: Any = spec
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _set(data: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})  # model_dump gives every written section as a dict
    data[last] = value


def _attribute(issue: SpecIssue, reading: _Reading, source: SpecSource) -> SpecIssue:
    """A spec error about a value the file filled names the file's key (and where stays the file's line)."""
    filled = {spec_key: file_key for spec_key, (_, file_key) in reading.fills.items()}
    if issue.key in filled:
        return SpecIssue(
            filled[issue.key],
            f"{issue.message} (the file's value for {issue.key}, which the spec leaves unset)",
            reading.line(filled[issue.key]),
            issue.severity,
        )
    # A section's or the whole spec's rule: the filled key whose name it mentions (the most specific name first).
    under = [spec_key for spec_key in filled if not issue.key or spec_key.startswith(issue.key + ".")]
    for depth in (-1, -2):
        for spec_key in under:
            parts = spec_key.split(".")
            if len(parts) >= -depth and re.search(rf"\b{re.escape(parts[depth])}\b", issue.message):
                file_key = filled[spec_key]
                return SpecIssue(
                    file_key,
                    f"{issue.message} (from the file's {file_key}: it fills {spec_key}, which the spec leaves unset)",
                    reading.line(file_key),
                    issue.severity,
                )
    return issue


def apply_ds_file(spec: Spec, source: SpecSource) -> tuple[Spec, SpecSource, list[SpecIssue]]:
    """(the spec with the file's concrete values in the keys it leaves unset, a source that knows their lines, the
    conflicts: keys written in both places to different values, where the spec's value stays for what follows).

    Raises SpecError (conflicts included) when the file cannot be read or a filled value breaks a spec rule.
    Running it again on its own result changes nothing."""
    if spec.deepspeed.config is None:
        return spec, source, []
    path = user_config_path(spec.deepspeed.config, source)
    user, text = load_user_ds_config(path, source)
    reading = _Reading(user, text, path)
    conflicts = []
    for spec_key, (value, file_key) in _file_values(user).items():
        if spec_key in source.filled or not spec_sets(spec, spec_key):
            reading.fills[spec_key] = (value, file_key)
        elif not same_value(value, _spec_value(spec, spec_key)):
            conflicts.append(
                SpecIssue(
                    file_key,
                    (
                        f"{json.dumps(_get(user, file_key))} in the file, but the spec sets {spec_key}: "
                        f"{_shown(_spec_value(spec, spec_key))} at {source.where(spec_key)}{_note(user, file_key)}. A key "
                        "written in both places must agree: remove it from one of them, or make them equal."
                    ),
                    reading.line(file_key),
                )
            )
    data = spec.model_dump(mode="python", exclude_unset=True)
    for spec_key, (value, _) in reading.fills.items():
        _set(data, spec_key, value)
    filled = {spec_key: reading.line(file_key) for spec_key, (_, file_key) in reading.fills.items()}
    merged_source = dataclasses.replace(source, filled={**source.filled, **filled})
    try:
        merged = validate_data(data, merged_source, deepspeed_file_read=True)
    except SpecError as err:
        raise SpecError(conflicts + [_attribute(issue, reading, merged_source) for issue in err.issues]) from None
    return merged, merged_source, conflicts


def merged_spec(spec: Spec, source: SpecSource) -> tuple[Spec, SpecSource]:
    """apply_ds_file for the commands that stop at the first problem (training, caching): conflicts raise too."""
    spec, source, conflicts = apply_ds_file(spec, source)
    if conflicts:
        raise SpecError(conflicts)
    return spec, source


def _note(user: dict, file_key: str) -> str:
    if file_key == "optimizer.type" and str(_get(user, file_key)).lower() == "adam":
        return ' (DeepSpeed\'s "Adam" runs AdamW unless optimizer.params.adam_w_mode is false)'
    return ""


def _shown(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else repr(value) if isinstance(value, str) else str(value)


# ------------------------------------------------------------------------------------------ where values came from

# DeepSpeed keys the plan derives when the spec (or file) leaves them to it.
_DERIVED = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
# Names a file may use for a key dstune writes under another name (dstune.ds_json.merge normalizes them).
_OLD_NAMES = [
    ("bf16", "bfloat16"),
    (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    ),
    *(
        (f"zero_optimization.stage3_{name}", f"zero_optimization.{name}")
        for name in ("prefetch_bucket_size", "param_persistence_threshold", "gather_16bit_weights_on_model_save")
    ),
]


def _spec_origin(spec: Spec, source: SpecSource, spec_key: str, ds_key: str) -> str:
    if spec_key in source.filled:
        return source.filled[spec_key]
    if spec_sets(spec, spec_key):
        return source.where(spec_key)
    return "plan" if ds_key in _DERIVED else "default"


def _file_key(user_flat: dict, ds_key: str) -> str | None:
    if ds_key in user_flat:
        return ds_key
    for new, old in _OLD_NAMES:
        if ds_key.startswith(new) and old + ds_key[len(new) :] in user_flat:
            return old + ds_key[len(new) :]
    return None


def ds_value_sources(ds_config: dict, spec: Spec, source: SpecSource) -> dict[str, str]:
    """Dotted DeepSpeed key -> where its value came from: "ds.json:12" (the file), "spec.yaml:7" or "--set" (the
    spec), "default" (dstune's default or fixed choice), "plan" (a batch number the plan derived); "auto at
    ds.json:5 -> ..." when the file wrote "auto"."""
    user, text, path = {}, "", None
    if spec.deepspeed.config is not None:
        path = user_config_path(spec.deepspeed.config, source)
        try:
            user, text = load_user_ds_config(path, source)
        except SpecError:
            user = {}
    user_flat = flatten(user)
    spec_keys = {ds_key: rule.spec_key for ds_key, rule in OWNED.items()}
    spec_keys.update({key: spec_key for key, spec_key in SPEC_KEY_OF.items() if key.startswith("optimizer.")})
    out = {}
    for ds_key in flatten(ds_config):
        file_key = _file_key(user_flat, ds_key)
        line = json_key_line(text, file_key) if file_key else None
        where = f"{path}:{line}" if line else str(path)
        spec_key = spec_keys.get(ds_key)
        origin = _spec_origin(spec, source, spec_key, ds_key) if spec_key else "default"
        if file_key is not None and user_flat[file_key] != AUTO:
            out[ds_key] = where
        elif file_key is not None:
            out[ds_key] = f"auto at {where} -> {origin}"
        else:
            out[ds_key] = origin
    return out
