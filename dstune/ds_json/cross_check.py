"""DeepSpeed's own config code, offline: `cross_check` resolves the compiled dict with
`deepspeed.runtime.config.DeepSpeedConfig` for the plan's world size (deepspeed imported lazily), so that
`dstune validate` fails exactly where `deepspeed.initialize` would, and points into the user's file where it can.
The rules read in DeepSpeed's source are listed in dstune.ds_json.blocks."""

from __future__ import annotations

import contextlib
import copy
import difflib
import logging
import typing
from pathlib import Path

from pydantic import BaseModel, ValidationError

from dstune.ds_json.merge import DEEPSPEED_CHECKED
from dstune.library_logs import library_logs_verbose
from dstune.plan import Plan
from dstune.spec.load import SpecIssue, SpecSource, json_key_line
from dstune.world import use_cpu_accelerator_if_no_cuda


class _OfflineDist:
    """Stands in for deepspeed.comm inside DeepSpeedConfig: rank 0 of `world_size`, no process group needed."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def get_rank(self, group=None) -> int:
        return 0

    def get_world_size(self, group=None) -> int:
        return self.world_size


@contextlib.contextmanager
def _deepspeed_offline(world_size: int):
    """DeepSpeed's config module with an offline `dist` and its logger silenced; both restored afterwards."""
    use_cpu_accelerator_if_no_cuda()  # before the first deepspeed import, which picks the accelerator
    from deepspeed.runtime import config as ds_config_module
    from deepspeed.utils import logger

    saved_dist, saved_level = ds_config_module.dist, logger.level
    ds_config_module.dist = _OfflineDist(world_size)
    logger.setLevel(saved_level if library_logs_verbose() else logging.CRITICAL + 1)
    try:
        yield ds_config_module
    finally:
        ds_config_module.dist = saved_dist
        logger.setLevel(saved_level)


def deepspeed_resolve(ds_config: dict, world_size: int):
    """DeepSpeed's own DeepSpeedConfig for `world_size` data-parallel ranks, built without a process group.

    DeepSpeedConfig.__init__ asks deepspeed.comm for the rank first and only then for the world size (or the
    mpu's data-parallel size); with no process group the rank call raises and it silently uses world size 1. So
    the module's `dist` is swapped for an offline one for the duration of the call; everything else is DeepSpeed's
    code as deepspeed.initialize runs it (mpu=None). Raises whatever DeepSpeed raises.
    """
    with _deepspeed_offline(world_size) as module:
        return module.DeepSpeedConfig(copy.deepcopy(ds_config))


def cross_check(
    ds_config: dict, plan: Plan, source: SpecSource, user_file: str | Path | None = None
) -> list[SpecIssue]:
    """Errors (one line each) where DeepSpeed's config code refuses `ds_config` or resolves other batch numbers
    than the plan. `user_file`: the user's DeepSpeed JSON (deepspeed.config), so messages can point into it."""
    try:
        resolved = deepspeed_resolve(ds_config, plan.world_size)
    except ImportError as err:
        return [source.issue("deepspeed", f"cannot import DeepSpeed to check the config: {err}")]
    except Exception as err:  # noqa: BLE001 - DeepSpeed rejects with AssertionError, ValueError, TypeError, its own ...
        return _rejection_issues(err, ds_config, source, user_file)
    ours = (plan.global_batch_size, plan.micro_batch_size, plan.gradient_accumulation_steps)
    theirs = (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu, resolved.gradient_accumulation_steps)
    if tuple(theirs) != ours:
        return [
            source.issue(
                "train",
                (
                    f"DeepSpeed {DEEPSPEED_CHECKED} resolves train_batch_size {theirs[0]} = micro {theirs[1]} x accumulation "
                    f"{theirs[2]} x {resolved.world_size} ranks, but the plan has global batch {ours[0]} = micro {ours[1]} x "
                    f"accumulation {ours[2]} x {plan.world_size} ranks"
                ),
            )
        ]
    return []


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _rejection_issues(
    err: Exception, ds_config: dict, source: SpecSource, user_path: str | Path | None
) -> list[SpecIssue]:
    text = ""
    if user_path is not None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            text = Path(user_path).read_text(encoding="utf-8")

    def where(key: str) -> str:
        if user_path is None:
            return source.where("deepspeed")
        line = json_key_line(text, key) if key and text else None
        return f"{user_path}:{line}" if line else str(user_path)

    if isinstance(err, ValidationError):
        issues = []
        for detail in err.errors():
            key, message = _describe_validation_error(detail, err.title, ds_config)
            issues.append(SpecIssue(key, message, where(key)))
        return issues
    message = f"DeepSpeed {DEEPSPEED_CHECKED} refuses this config: {type(err).__name__}: {_one_line(err)}"
    return [SpecIssue("", message, where(""))]


# Where DeepSpeed's main pydantic models sit in the JSON, to place an error when a location fits several blocks.
_MODEL_BLOCKS = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedFP16Config": "fp16",
    "DeepSpeedBF16Config": "bf16",
}


def _describe_validation_error(detail: dict, model_name: str, ds_config: dict) -> tuple[str, str]:
    """A pydantic error inside one of DeepSpeed's config models -> (dotted key in the config, one-line message)."""
    loc = [str(part) for part in detail["loc"]]
    prefix = _find_prefix(ds_config, loc if detail["type"] != "missing" else loc[:-1], _MODEL_BLOCKS.get(model_name))
    key = ".".join(prefix + loc)
    if detail["type"] == "extra_forbidden":
        close = difflib.get_close_matches(loc[-1], _accepted_names(model_name, loc[:-1]), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return key, f"DeepSpeed {DEEPSPEED_CHECKED} refuses this unknown key{hint}"
    got = f" (got {detail['input']!r})" if "input" in detail and not isinstance(detail["input"], dict) else ""
    return key, f"DeepSpeed {DEEPSPEED_CHECKED} refuses this value: {_one_line(detail['msg'])}{got}"


def _has_path(node, loc: list[str]) -> bool:
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _find_prefix(config: dict, loc: list[str], hint: str | None) -> list[str]:
    """Path of the block where `loc` exists (pydantic locations start at the model's own dict)."""
    found, pending = [], [([], config)]
    while pending:
        path, node = pending.pop(0)
        if loc and _has_path(node, loc):
            found.append(path)
        pending.extend((path + [k], v) for k, v in node.items() if isinstance(v, dict))
    for path in found:
        if path[:1] == [hint]:
            return path
    return found[0] if found else ([hint] if hint else [])


def _accepted_names(model_name: str, loc: list[str]) -> list[str]:
    """Field names and aliases of the DeepSpeed pydantic model at `loc` inside `model_name`, for a "did you mean"."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    pending, model = [DeepSpeedConfigModel], None
    while pending and model is None:
        cls = pending.pop()
        model = cls if cls.__name__ == model_name else None
        pending.extend(cls.__subclasses__())
    for part in loc:
        fields = {n: f for name, f in (model.model_fields.items() if model else ()) for n in (name, f.alias) if n}
        annotation = fields[part].annotation if part in fields else None
        candidates = [
            a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        model = candidates[0] if candidates else None
    if model is None:
        return []
    return [n for name, f in model.model_fields.items() for n in (name, f.alias) if n]
