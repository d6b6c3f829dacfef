"""Spec + Plan -> the DeepSpeed JSON dict, block by block (ZeRO, precision, optimizer, clipping, checkpointing),
with the user's own file (deepspeed.config) merged in (dstune.ds_json.merge).

`compile_ds_config` is pure (no torch or deepspeed import): it always writes the three batch numbers and
gradient_clipping, never "auto", and never a `scheduler` (dstune's LR schedule is a client scheduler).
dstune.ds_json.cross_check then has DeepSpeed's own config code resolve it.

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
  (dstune warns: dstune.ds_json.merge.KNOWN_TOP_LEVEL_KEYS); the blocks parsed by pydantic models (config_utils.py
  DeepSpeedConfigModel: extra="forbid", "auto" values dropped) refuse unknown keys, and _reject_removed_config_keys
  refuses removed features (amp, elasticity, ...): cross_check reports those in one line.
"""

from __future__ import annotations

import copy
from typing import Any


from dstune.ds_json.merge import AUTO, merge_user_ds_config, stage3_bucket_sizes
from dstune.ds_json.user_file import load_user_ds_config, user_config_path
from dstune.plan import Plan
from dstune.spec.load import SpecError, SpecIssue, SpecSource
from dstune.spec.models import ADAFACTOR_STYLE, ADAPTIVE_LR, SCHEDULE_FREE, DeepSpeedSpec, OffloadSpec, TrainSpec

STEPS_PER_PRINT = 1_000_000_000  # dstune prints its own progress; DeepSpeed's step log would interleave with it
DEEPSPEED_OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW"}  # DeepSpeedCPUAdam under optimizer offload
ZERO_TESTED_CLIENT_OPTIMIZERS = frozenset({"adam", "adamw"})  # torch.optim.Adam/AdamW are in ZERO_SUPPORTED_OPTIMIZERS
# Optimizers whose step keeps per-step counters or global sums in their param group (Prodigy's estimate,
# schedule-free's averaging weights): ZeRO-3 steps each sub-group of sub_group_size elements with its own step()
# call (stage3.py _optimizer_step), which would advance them once per sub-group, so their ZeRO-3 runs keep one
# sub-group per param group.
WHOLE_STEP_OPTIMIZERS = ADAPTIVE_LR | SCHEDULE_FREE
ONE_SUB_GROUP = 1 << 40
FP16_DYNAMIC_LOSS_SCALING = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}  # loss_scale 0 = dynamic, starting at 2**16


def find_auto(value: Any, prefix: str = "") -> list[str]:
    """Dotted keys (list items as .N) whose value is still "auto"."""
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in find_auto(v, f"{prefix}{key}.")]
    if isinstance(value, list):
        return [k for i, v in enumerate(value) for k in find_auto(v, f"{prefix}{i}.")]
    return [prefix[:-1]] if value == AUTO else []


def with_universal_loading(ds_config: dict) -> dict:
    """A copy that makes engine.load_checkpoint read DeepSpeed's universal checkpoint format (the checkpoint of
    another number of ranks, converted by dstune.checkpoints.reshard). Only the engine of that resume gets it."""
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


def _zero_block(
    deepspeed: DeepSpeedSpec, sequence_parallel_size: int = 1, whole_step: bool = False, muon: bool = False
) -> dict:
    stage = deepspeed.zero_stage
    block: dict = {"stage": stage}
    if stage == 0:
        return block
    block.update(
        contiguous_gradients=True, overlap_comm=deepspeed.overlap_comm, reduce_bucket_size=deepspeed.reduce_bucket_size
    )
    if stage < 3:
        block["allgather_bucket_size"] = deepspeed.allgather_bucket_size
    else:
        prefetch, persistence = stage3_bucket_sizes(deepspeed.reduce_bucket_size)
        if whole_step:
            block["sub_group_size"] = ONE_SUB_GROUP
        block.update(
            stage3_prefetch_bucket_size=prefetch,
            stage3_param_persistence_threshold=persistence,
            stage3_gather_16bit_weights_on_model_save=True,
        )  # save_16bit_model writes nothing otherwise
        if muon:  # stage3.py: "Muon and reduce scatter cannot be used together" (it all-reduces whole matrices)
            block["reduce_scatter"] = False
        if sequence_parallel_size > 1:
            # stage3.py's reduce-scatter path averages gradients over every rank, its all-reduce path over the
            # data-parallel groups only (ranks / sequence_parallel_size), which is what sequence parallelism needs
            # (each rank's gradient is its tokens' share); the all-reduce path also needs a reduce bucket that holds
            # the largest trainable parameter (dstune.engine.sequence_parallel_bucket).
            block["reduce_scatter"] = False
    if deepspeed.offload_optimizer.device != "none":
        block["offload_optimizer"] = _offload_block(deepspeed.offload_optimizer)
    if deepspeed.offload_param.device != "none":
        block["offload_param"] = _offload_block(deepspeed.offload_param)
    return block


def _precision_blocks(precision: str, bf16_states: bool = False) -> dict:
    """Both blocks, always explicit: fp32 is both disabled, so an "auto" in a user's file has a value to take.
    deepspeed.bf16_optimizer_states: DeepSpeed's bf16 master weights and gradients, which its bf16 states need."""
    fp16 = {"enabled": precision == "fp16"}
    if precision == "fp16":
        fp16.update(FP16_DYNAMIC_LOSS_SCALING)
    bf16 = {"enabled": precision == "bf16"}
    if bf16_states:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return {"fp16": fp16, "bf16": bf16}


def _optimizer_settings(train: TrainSpec, deepspeed: DeepSpeedSpec, plan: Plan) -> dict:
    """DeepSpeed's optimizer block (offloaded Adam/AdamW) or the flags a client optimizer needs under ZeRO."""
    opt = train.optimizer
    offloaded = deepspeed.zero_stage >= 1 and deepspeed.offload_optimizer.device in ("cpu", "nvme")
    if opt.type == "muon":  # DeepSpeed's own Muon: it tags the matrices (use_muon) and builds both halves
        return {
            "optimizer": {
                "type": "Muon",
                "params": {
                    "lr": plan.effective_lr,
                    "adam_lr": plan.effective_lr,
                    "muon_lr": opt.muon_lr * plan.lr_scale,
                    "momentum": opt.muon_momentum,
                    "betas": list(opt.betas),
                    "eps": opt.eps,
                    "weight_decay": opt.weight_decay,
                },
            }
        }
    if offloaded and opt.type in DEEPSPEED_OPTIMIZER_TYPES:
        return {
            "optimizer": {
                "type": DEEPSPEED_OPTIMIZER_TYPES[opt.type],
                "params": {
                    "lr": plan.effective_lr,
                    "betas": list(opt.betas),
                    "eps": opt.eps,
                    "weight_decay": opt.weight_decay,
                    "adam_w_mode": opt.type == "adamw",
                },
            }
        }
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
        notes.append(
            source.issue(
                "train.optimizer.type",
                (
                    f"adafactor under ZeRO stage {deepspeed.zero_stage}: ZeRO hands the optimizer flattened 1-D partitions of "
                    "the parameters, so Adafactor's factored second moment (its memory advantage) is lost and its "
                    "per-parameter update clipping becomes per-partition (results depend on the number of ranks). Use "
                    "zero_stage 0, or adamw."
                ),
                severity="warning",
            )
        )
    if (
        opt_type not in DEEPSPEED_OPTIMIZER_TYPES
        and opt_type != "muon"
        and deepspeed.offload_optimizer.device != "none"
    ):
        notes.append(
            source.issue(
                "deepspeed.offload_optimizer",
                (
                    f"{opt_type} with offload_optimizer {deepspeed.offload_optimizer.device}: its step runs on the CPU in "
                    "plain PyTorch (DeepSpeed's fast CPU kernels cover only its own Adam/AdamW); expect slow steps."
                ),
                severity="warning",
            )
        )
    return notes + optimizer_refusals(train, deepspeed, source)


def optimizer_refusals(train: TrainSpec, deepspeed: DeepSpeedSpec, source: SpecSource) -> list[SpecIssue]:
    """The combinations an optimizer or DeepSpeed cannot run, each with its reason (errors), and Prodigy's lr
    outside its range (a warning)."""
    opt, out = train.optimizer, []
    if opt.type in ADAPTIVE_LR and train.lr_scaling != "none":
        out.append(
            source.issue(
                "train.lr_scaling",
                (
                    f"{train.lr_scaling} scaling with {opt.type}: Prodigy estimates its own step size from the run, and "
                    "its lr multiplies that estimate, so there is no batch-size rule to apply. Set lr_scaling: none."
                ),
            )
        )
    if opt.type in ADAPTIVE_LR and not 0.1 <= opt.lr <= 10:
        out.append(
            source.issue(
                "train.optimizer.lr",
                (
                    f"{opt.lr:g} with prodigy multiplies its estimated step size by {opt.lr:g}: Prodigy's lr is 1.0 (the "
                    "estimate as is; an Adam learning rate here all but stops training). Tune d_coef (0.5 to 2) instead."
                ),
                severity="warning",
            )
        )
    if opt.type in SCHEDULE_FREE and train.scheduler.type not in ("constant", "constant_with_warmup"):
        out.append(
            source.issue(
                "train.scheduler.type",
                (
                    f"{train.scheduler.type} with {opt.type}: schedule-free AdamW replaces the decay schedule (its "
                    "averaged weights are the schedule) and a decaying LR breaks its averaging. Use constant, or "
                    "constant_with_warmup for a warmup."
                ),
            )
        )
    if deepspeed.bf16_optimizer_states:
        missing = [
            what
            for what, ok in (
                ("train.precision bf16", train.precision == "bf16"),
                ("zero_stage >= 1", deepspeed.zero_stage >= 1),
                ("offload_optimizer cpu", deepspeed.offload_optimizer.device == "cpu"),
                ("optimizer adam or adamw", opt.type in DEEPSPEED_OPTIMIZER_TYPES),
            )
            if not ok
        ]
        if missing:
            out.append(
                source.issue(
                    "deepspeed.bf16_optimizer_states",
                    (
                        f"needs {', '.join(missing)}: DeepSpeed keeps bf16 optimizer states only for its CPU Adam under "
                        "ZeRO optimizer offload, over bf16 master weights (runtime/config.py, base_optimizer.py). Set "
                        "those, or remove bf16_optimizer_states."
                    ),
                )
            )
    return out


def spec_ds_config(train: TrainSpec, deepspeed: DeepSpeedSpec, plan: Plan) -> dict:
    """The DeepSpeed dict for the spec alone (no user file)."""
    return {
        "train_batch_size": int(plan.global_batch_size),
        "train_micro_batch_size_per_gpu": int(plan.micro_batch_size),
        "gradient_accumulation_steps": int(plan.gradient_accumulation_steps),
        # Always explicit: DeepSpeed's default changed from 0.0 to 1.0 in 0.19.3; Adafactor needs 0.0.
        "gradient_clipping": float(plan.gradient_clipping),
        **_precision_blocks(train.precision, deepspeed.bf16_optimizer_states),
        "zero_optimization": _zero_block(
            deepspeed,
            plan.sequence_parallel_size,
            train.optimizer.type in WHOLE_STEP_OPTIMIZERS,
            train.optimizer.type == "muon",
        ),
        **_optimizer_settings(train, deepspeed, plan),
        **_activation_checkpointing(deepspeed),
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        # DeepSpeed sizes its data-parallel world as ranks / sequence_parallel_size (config.py, with or without the
        # sequence-parallel mpu dstune.engine passes); left out at 1 so that data-parallel runs' JSON is unchanged
        **({"sequence_parallel_size": plan.sequence_parallel_size} if plan.sequence_parallel_size > 1 else {}),
    }


def compile_ds_config(
    train: TrainSpec, deepspeed: DeepSpeedSpec, plan: Plan, source: SpecSource
) -> tuple[dict, list[SpecIssue]]:
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
