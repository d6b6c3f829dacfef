"""Spec + Plan -> the DeepSpeed JSON dict, and a cross-check of that dict by DeepSpeed's own config code.

`compile_ds_config` is pure (no torch or deepspeed import): it always writes the three batch numbers and
gradient_clipping, never "auto", and never a `scheduler` (dstune's LR schedule is a client scheduler).
`cross_check` imports deepspeed lazily and resolves the dict with `deepspeed.runtime.config.DeepSpeedConfig` for
the plan's world size, so that `dstune validate` fails exactly where `deepspeed.initialize` would.

Rules read in DeepSpeed 0.19.8's source:
- deepspeed/runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS / is_zero_supported_optimizer: ZeRO trusts a client
  optimizer only if `type(opt)` is exactly torch.optim.Adam, AdamW, Adagrad or a DeepSpeed Adam/Adagrad/Lion class;
  engine.py _do_optimizer_sanity_check asserts `zero_allow_untested_optimizer` for any other (transformers'
  Adafactor, torch SGD, dstune's Lion) when ZeRO is on (stage >= 1; config.py: zero_enabled = stage > 0).
- engine.py _configure_optimizer: with offload_optimizer device cpu/nvme a client optimizer that is not
  DeepSpeedCPUAdam/CPULion raises ZeRORuntimeException unless `zero_force_ds_cpu_optimizer` is false (default true,
  runtime/constants.py). Adam/AdamW therefore go through DeepSpeed's `optimizer` block, which builds
  DeepSpeedCPUAdam (engine.py get_optimizer_configuration).
- engine.py _configure_basic_optimizer: type "Adam" runs AdamW unless params.adam_w_mode is false (ADAM_W_MODE_DEFAULT
  = True in config.py), so dstune writes adam_w_mode explicitly; `max_grad_norm` in params is refused there.
- config.py DeepSpeedConfig._set_batch_related_parameters / _batch_assertion: the batch triad rules (see plan.py).
- config.py DeepSpeedConfig.__init__: `mpu` is consulted only after dist.get_rank() succeeds; without a process group
  that raises and the world size silently becomes 1, whatever mpu says. See `deepspeed_resolve`.
- config.py reads top-level keys one by one (param_dict.get), so an unknown top-level key is ignored silently
  (dstune warns: ds_user_config.KNOWN_TOP_LEVEL_KEYS); the blocks parsed by pydantic models (config_utils.py
  DeepSpeedConfigModel: extra="forbid", "auto" values dropped) refuse unknown keys, and _reject_removed_config_keys
  refuses removed features (amp, elasticity, ...): cross_check reports those in one line.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import logging
import re
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from dstune.ds_user_config import AUTO, DEEPSPEED_CHECKED, merge_user_ds_config, stage3_bucket_sizes
from dstune.library_logs import library_logs_verbose
from dstune.plan import Plan
from dstune.spec.load import SpecError, SpecIssue, SpecSource, json_key_line
from dstune.spec.models import ADAFACTOR_STYLE, DeepSpeedSpec, OffloadSpec, TrainSpec
from dstune.world import use_cpu_accelerator_if_no_cuda

STEPS_PER_PRINT = 1_000_000_000  # dstune prints its own progress; DeepSpeed's step log would interleave with it
DEEPSPEED_OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW"}  # DeepSpeedCPUAdam under optimizer offload
ZERO_TESTED_CLIENT_OPTIMIZERS = frozenset({"adam", "adamw"})  # torch.optim.Adam/AdamW are in ZERO_SUPPORTED_OPTIMIZERS
FP16_DYNAMIC_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                             "min_loss_scale": 1}  # loss_scale 0 = dynamic, starting at 2**16


def find_auto(value: Any, prefix: str = "") -> list[str]:
    """Dotted keys (list items as .N) whose value is still "auto"."""
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in find_auto(v, f"{prefix}{key}.")]
    if isinstance(value, list):
        return [k for i, v in enumerate(value) for k in find_auto(v, f"{prefix}{i}.")]
    return [prefix[:-1]] if value == AUTO else []


def with_universal_loading(ds_config: dict) -> dict:
    """A copy that makes engine.load_checkpoint read DeepSpeed's universal checkpoint format (the checkpoint of
    another number of ranks, converted by dstune.universal). Only the engine of that resume gets it."""
    out = copy.deepcopy(ds_config)
    out.setdefault("checkpoint", {})["load_universal"] = True
    return out


def uses_deepspeed_optimizer(ds_config: dict) -> bool:
    """True when DeepSpeed builds the optimizer from the config (the engine then passes no optimizer object)."""
    return "optimizer" in ds_config


def _offload_block(offload: OffloadSpec) -> dict:
    block = {"device": offload.device, "pin_memory": offload.pin_memory}
    if offload.device == "nvme":
        block["nvme_path"] = offload.nvme_path
    return block


def _zero_block(deepspeed: DeepSpeedSpec) -> dict:
    stage = deepspeed.zero_stage
    block: dict = {"stage": stage}
    if stage == 0:
        return block
    block.update(contiguous_gradients=True, overlap_comm=deepspeed.overlap_comm,
                 reduce_bucket_size=deepspeed.reduce_bucket_size)
    if stage < 3:
        block["allgather_bucket_size"] = deepspeed.allgather_bucket_size
    else:
        prefetch, persistence = stage3_bucket_sizes(deepspeed.reduce_bucket_size)
        block.update(stage3_prefetch_bucket_size=prefetch, stage3_param_persistence_threshold=persistence,
                     stage3_gather_16bit_weights_on_model_save=True)  # save_16bit_model writes nothing otherwise
    if deepspeed.offload_optimizer.device != "none":
        block["offload_optimizer"] = _offload_block(deepspeed.offload_optimizer)
    if deepspeed.offload_param.device != "none":
        block["offload_param"] = _offload_block(deepspeed.offload_param)
    return block


def _precision_blocks(precision: str) -> dict:
    """Both blocks, always explicit: fp32 is both disabled, so an "auto" in a user's file has a value to take."""
    fp16 = {"enabled": precision == "fp16"}
    if precision == "fp16":
        fp16.update(FP16_DYNAMIC_LOSS_SCALING)
    return {"fp16": fp16, "bf16": {"enabled": precision == "bf16"}}


def _optimizer_settings(train: TrainSpec, deepspeed: DeepSpeedSpec, plan: Plan) -> dict:
    """DeepSpeed's optimizer block (offloaded Adam/AdamW) or the flags a client optimizer needs under ZeRO."""
    opt = train.optimizer
    offloaded = deepspeed.zero_stage >= 1 and deepspeed.offload_optimizer.device in ("cpu", "nvme")
    if offloaded and opt.type in DEEPSPEED_OPTIMIZER_TYPES:
        return {"optimizer": {"type": DEEPSPEED_OPTIMIZER_TYPES[opt.type], "params": {
            "lr": plan.effective_lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay,
            "adam_w_mode": opt.type == "adamw"}}}
    out = {}
    if deepspeed.zero_stage >= 1 and opt.type not in ZERO_TESTED_CLIENT_OPTIMIZERS:
        out["zero_allow_untested_optimizer"] = True
    if offloaded:
        out["zero_force_ds_cpu_optimizer"] = False
    return out


def _activation_checkpointing(deepspeed: DeepSpeedSpec) -> dict:
    spec = deepspeed.activation_checkpointing
    if not (spec.partition_activations or spec.cpu_checkpointing):
        return {}  # plain torch checkpointing (model.gradient_checkpointing) needs no DeepSpeed block
    return {"activation_checkpointing": spec.model_dump(exclude_none=True)}


def _optimizer_notes(train: TrainSpec, deepspeed: DeepSpeedSpec, source: SpecSource) -> list[SpecIssue]:
    opt_type = train.optimizer.type
    notes = []
    if opt_type in ADAFACTOR_STYLE and deepspeed.zero_stage >= 1:
        notes.append(source.issue("train.optimizer.type", (
            f"adafactor under ZeRO stage {deepspeed.zero_stage}: ZeRO hands the optimizer flattened 1-D partitions of "
            "the parameters, so Adafactor's factored second moment (its memory advantage) is lost and its "
            "per-parameter update clipping becomes per-partition (results depend on the number of ranks). Use "
            "zero_stage 0, or adamw."), severity="warning"))
    if opt_type not in DEEPSPEED_OPTIMIZER_TYPES and deepspeed.offload_optimizer.device != "none":
        notes.append(source.issue("deepspeed.offload_optimizer", (
            f"{opt_type} with offload_optimizer {deepspeed.offload_optimizer.device}: its step runs on the CPU in "
            "plain PyTorch (DeepSpeed's fast CPU kernels cover only its own Adam/AdamW); expect slow steps."),
            severity="warning"))
    return notes


def spec_ds_config(train: TrainSpec, deepspeed: DeepSpeedSpec, plan: Plan) -> dict:
    """The DeepSpeed dict for the spec alone (no user file)."""
    return {
        "train_batch_size": int(plan.global_batch_size),
        "train_micro_batch_size_per_gpu": int(plan.micro_batch_size),
        "gradient_accumulation_steps": int(plan.gradient_accumulation_steps),
        # Always explicit: DeepSpeed's default changed from 0.0 to 1.0 in 0.19.3; Adafactor needs 0.0.
        "gradient_clipping": float(plan.gradient_clipping),
        **_precision_blocks(train.precision),
        "zero_optimization": _zero_block(deepspeed),
        **_optimizer_settings(train, deepspeed, plan),
        **_activation_checkpointing(deepspeed),
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }


# ------------------------------------------------------------------------------------------ the user's file


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)  # DeepSpeed loads files with dict_raise_error_on_duplicate_keys too
        seen[key] = value
    return seen


def user_config_path(config: str, source: SpecSource) -> Path:
    """`deepspeed.config` is relative to the spec file's folder (so a spec and its JSON can move together)."""
    path = Path(config).expanduser()
    return path if path.is_absolute() else Path(source.path).parent / path


def load_user_ds_config(path: Path, source: SpecSource) -> tuple[dict, str]:
    """Read the JSON object; raise SpecError naming the file (and line) when it is missing or not JSON."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([source.issue("deepspeed.config", f"DeepSpeed config file not found: {path} (a relative "
                                      "path is taken from the spec file's folder)")]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError([source.issue("deepspeed.config", f"cannot read the DeepSpeed config {path}: {err}")]) from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        raise SpecError([SpecIssue("", f"not valid JSON: {err.msg} (column {err.colno}); DeepSpeed configs for dstune "
                                   "are plain JSON, without comments", f"{path}:{err.lineno}")]) from None
    except _DuplicateKey as err:
        line = _last_line_of_key(text, err.key)
        raise SpecError([SpecIssue(err.key, "appears twice in the same object; DeepSpeed refuses duplicate keys",
                                   f"{path}:{line}" if line else str(path))]) from None
    if not isinstance(data, dict):
        raise SpecError([SpecIssue("", "a DeepSpeed config must be a JSON object ({...})", str(path))])
    return data, text


def _last_line_of_key(text: str, key: str) -> int | None:
    found = list(re.finditer(rf'"{re.escape(key)}"\s*:', text))
    return text.count("\n", 0, found[-1].start()) + 1 if found else None


def compile_ds_config(train: TrainSpec, deepspeed: DeepSpeedSpec, plan: Plan,
                      source: SpecSource) -> tuple[dict, list[SpecIssue]]:
    """(DeepSpeed config dict, warnings). Raises SpecError with every error found (user file included)."""
    config = spec_ds_config(train, deepspeed, plan)
    issues = _optimizer_notes(train, deepspeed, source)
    if deepspeed.config is not None:
        path = user_config_path(deepspeed.config, source)
        user, text = load_user_ds_config(path, source)
        config, merge_issues = merge_user_ds_config(user, config, train, deepspeed, plan, source, path, text)
        issues += merge_issues
    for key in find_auto(config):  # a safety net: every path above fills or refuses "auto"
        issues.append(source.issue("deepspeed.config", f'"auto" left at {key} in the DeepSpeed config; write a value'))
    errors = [issue for issue in issues if issue.severity == "error"]
    if errors:
        raise SpecError(errors)
    return config, issues


# ------------------------------------------------------------------------------------- DeepSpeed's own check


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


def cross_check(ds_config: dict, plan: Plan, source: SpecSource, user_file: str | Path | None = None) -> list[SpecIssue]:
    """Errors (one line each) where DeepSpeed's config code refuses `ds_config` or resolves other batch numbers
    than the plan. `user_file`: the user's DeepSpeed JSON (deepspeed.config), so messages can point into it."""
    try:
        resolved = deepspeed_resolve(ds_config, plan.world_size)
    except ImportError as err:
        return [source.issue("deepspeed", f"cannot import DeepSpeed to check the config: {err}")]
    except Exception as err:  # AssertionError, ValueError (pydantic), DeepSpeedConfigError, TypeError ...
        return _rejection_issues(err, ds_config, source, user_file)
    ours = (plan.global_batch_size, plan.micro_batch_size, plan.gradient_accumulation_steps)
    theirs = (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu, resolved.gradient_accumulation_steps)
    if tuple(theirs) != ours:
        return [source.issue("train", (
            f"DeepSpeed {DEEPSPEED_CHECKED} resolves train_batch_size {theirs[0]} = micro {theirs[1]} x accumulation "
            f"{theirs[2]} x {resolved.world_size} ranks, but the plan has global batch {ours[0]} = micro {ours[1]} x "
            f"accumulation {ours[2]} x {plan.world_size} ranks"))]
    return []


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _rejection_issues(err: Exception, ds_config: dict, source: SpecSource,
                      user_path: str | Path | None) -> list[SpecIssue]:
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
_MODEL_BLOCKS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16",
                 "DeepSpeedBF16Config": "bf16"}


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
        candidates = [a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type)
                      and issubclass(a, BaseModel)]
        model = candidates[0] if candidates else None
    if model is None:
        return []
    return [n for name, f in model.model_fields.items() for n in (name, f.alias) if n]
