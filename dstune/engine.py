"""`wrap_model`: the only call to deepspeed.initialize.

Only the trainable module goes to DeepSpeed; frozen companions (VAE, text encoders, codecs) stay outside ZeRO
(frozen modules inside deepspeed.initialize are partitioned and wrapped for nothing; diffusers' DeepSpeed training
examples keep them out for that reason). dstune builds the optimizer and the LR schedule itself from the spec, except
when DeepSpeed's own optimizer block is compiled in (Adam with optimizer offload uses DeepSpeed's fast CPU Adam).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from dstune.ds_json.blocks import uses_deepspeed_optimizer
from dstune.optimizers import build_client_optimizer, train_mode
from dstune.plan import Plan
from dstune.spec.models import SchedulerSpec, TrainSpec


# spec train.precision -> (compute dtype of the trainable module's inputs, dtype of the frozen companions). fp16
# keeps the frozen parts in fp32: DeepSpeed's fp16 loss scaling covers only the trainable module.
PRECISION_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float32),
}


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): sign of an interpolated momentum, decoupled weight decay."""

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


def build_optimizer(train: TrainSpec, params, lr: float, sharded: bool = False) -> torch.optim.Optimizer:
    """The client optimizer DeepSpeed is given; `sharded`: ZeRO >= 1 hands it this rank's flat partitions."""
    opt = train.optimizer
    client = build_client_optimizer(train, params, lr, sharded)
    if client is not None:
        return client
    if opt.type == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    if opt.type == "adam":
        return torch.optim.Adam(params, lr=lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    if opt.type == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if opt.type == "lion":
        return Lion(params, lr=lr, betas=opt.betas, weight_decay=opt.weight_decay)
    if opt.type == "adafactor":
        from transformers.optimization import Adafactor

        # A fixed LR driven by our schedule: Adafactor's own relative-step schedule would fight train.scheduler.
        return Adafactor(
            params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False, weight_decay=opt.weight_decay
        )
    raise ValueError(f"unknown optimizer {opt.type!r}")  # unreachable: the spec restricts the type


class LrMultiplier:
    """LR multiplier per optimizer step (LambdaLR). A class, not a lambda, so it pickles with the checkpoint."""

    def __init__(self, scheduler: SchedulerSpec, total_steps: int):
        self.kind = scheduler.type
        self.warmup_steps = scheduler.warmup_steps
        self.min_ratio = scheduler.min_lr_ratio
        self.total_steps = total_steps

    def __call__(self, step: int) -> float:
        # LambdaLR calls this with the number of optimizer steps taken so far; step 0 is the first update.
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind in ("constant", "constant_with_warmup"):
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "linear":
            shape = 1.0 - progress
        else:  # cosine
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def promote_scalar_params(module: torch.nn.Module) -> list[str]:
    """DeepSpeed 0.19.8 broadcasts parameters as byte views, which fails on 0-dim tensors ("self.dim() cannot be 0");
    reshape them to (1,) here and back to () on export. Returns the dotted names changed."""
    names = []
    for module_name, sub in module.named_modules():
        for param_name, param in list(sub._parameters.items()):
            if param is not None and param.dim() == 0:
                sub._parameters[param_name] = torch.nn.Parameter(
                    param.detach().reshape(1), requires_grad=param.requires_grad
                )
                names.append(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def place_trainable(trainable: torch.nn.Module, device, precision: str, partition_config: Optional[dict] = None):
    """Move the trainable module (loaded in host memory) to `device`, its floating parameters first cast on the host
    to the dtype DeepSpeed would cast them to (train.precision: bf16/fp16 parameters, buffers as they are, as
    DeepSpeed's engine casts them), so the accelerator never holds the fp32 copy: the start-up's peak is the trained
    dtype's bytes, not twice them. A module built partitioned (ZeRO-3, deepspeed.zero.Init) is already placed.

    With `partition_config` (a ZeRO-3 DeepSpeed JSON: an int8 base, quantized on the host) the cast module is
    partitioned from the host instead, deepspeed.zero.Init(module=...): one parameter at a time goes to the device,
    is broadcast from rank 0 and cut to this rank's share, so no rank's device holds the whole base; a ZeRO-Init
    model, deepspeed.initialize neither casts nor moves it. Collective then: every rank calls it."""
    if any(hasattr(p, "ds_id") for p in trainable.parameters()):
        return
    dtype = PRECISION_DTYPES[precision][0]
    with torch.no_grad():
        for param in trainable.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    if partition_config is not None:
        import deepspeed

        deepspeed.zero.Init(module=trainable, config_dict_or_path=partition_config)
        for module in trainable.modules():  # buffers are not partitioned, and not moved by zero.Init(module=)
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(torch.device(device))
        return
    trainable.to(torch.device(device))


def wrap_model(trainable: torch.nn.Module, train: TrainSpec, ds_config: dict, plan: Plan):
    """deepspeed.initialize on the trainable module only; returns the engine."""
    import deepspeed

    promote_scalar_params(trainable)
    params = [p for p in trainable.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    multiplier = LrMultiplier(train.scheduler, plan.total_steps)
    sharded = int(ds_config.get("zero_optimization", {}).get("stage", 0)) >= 1
    optimizer = (
        None if uses_deepspeed_optimizer(ds_config) else build_optimizer(train, params, plan.effective_lr, sharded)
    )
    # Sequence parallelism: DeepSpeed's own sequence-parallel groups (dstune.distributed.with_sequence_groups made
    # them) as its mpu, so ZeRO partitions and reduces over every rank and averages over the data-parallel groups only
    mpu = None
    if plan.sequence_parallel_size > 1:
        mpu = SequenceGroups()
        ds_config = sequence_parallel_bucket(ds_config, params)
    engine, _, _, _ = deepspeed.initialize(
        model=trainable,
        model_parameters=params,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, multiplier),
        config=ds_config,
        mpu=mpu,
        dist_init_required=False,
    )
    train_mode(engine)  # schedule-free: the weights it steps (a no-op for the others)
    return engine


class SequenceGroups:
    """DeepSpeed's sequence-parallel groups (deepspeed.runtime.sequence_parallel.parallel_state_sp, made by
    dstune.distributed.with_sequence_groups) as the mpu deepspeed.initialize takes. That module also answers the
    model-parallel questions with the sequence group, so DeepSpeed would record a checkpoint as tensor-parallel over
    it and its universal-checkpoint converter (resume on another world) refuses the checkpoint; here the model is
    whole on every rank. `initialize_sequence_parallel` is how DeepSpeed tells a sequence-parallel mpu."""

    @staticmethod
    def _state():
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        return parallel_state_sp

    def initialize_sequence_parallel(self, size: int) -> None:
        raise RuntimeError("dstune.distributed.with_sequence_groups makes the groups")

    def get_sequence_parallel_group(self):
        return self._state().get_sequence_parallel_group()

    def get_sequence_parallel_world_size(self) -> int:
        return self._state().get_sequence_parallel_world_size()

    def get_sequence_parallel_rank(self) -> int:
        return self._state().get_sequence_parallel_rank()

    def get_sequence_data_parallel_group(self):
        return self._state().get_sequence_data_parallel_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._state().get_sequence_data_parallel_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return self._state().get_sequence_data_parallel_rank()

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size


def sequence_parallel_bucket(ds_config: dict, params: list) -> dict:
    """Under ZeRO-3 with sequence parallelism, the reduce bucket raised to the largest trainable parameter:
    DeepSpeed reduces a bucket that holds more elements than reduce_bucket_size (one parameter larger than it)
    through its reduce-scatter path, which averages over every rank instead of the data-parallel groups."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("stage") != 3:
        return ds_config
    largest = max(int(getattr(p, "ds_numel", p.numel())) for p in params)
    if largest <= int(zero.get("reduce_bucket_size", 0)):
        return ds_config
    return {**ds_config, "zero_optimization": {**zero, "reduce_bucket_size": largest}}


# Optimizer hyperparameters from the spec that a checkpoint's param groups carry (torch's load_state_dict puts the
# saved groups back): per optimizer type, spec field -> param-group key. The LR is the schedule's (below).
_GROUP_SETTINGS = {
    "adamw": {"betas": "betas", "eps": "eps", "weight_decay": "weight_decay"},
    "adam": {"betas": "betas", "eps": "eps", "weight_decay": "weight_decay"},
    "lion": {"betas": "betas", "weight_decay": "weight_decay"},
    "sgd": {"momentum": "momentum", "weight_decay": "weight_decay"},
    "adafactor": {"weight_decay": "weight_decay"},
    "prodigy": {"betas": "betas", "eps": "eps", "weight_decay": "weight_decay", "d_coef": "d_coef"},
    "adamw_schedulefree": {"betas": "betas", "eps": "eps", "weight_decay": "weight_decay"},
    "adamw8bit": {"betas": "betas", "eps": "eps", "weight_decay": "weight_decay"},
    # DeepSpeed's Muon: the Adam half's groups carry betas and eps, the Muon half's its momentum
    "muon": {"betas": "betas", "eps": "eps", "weight_decay": "weight_decay", "muon_momentum": "momentum"},
}


def group_base_lr(group: dict, train: TrainSpec, plan: Plan) -> float:
    """The peak LR of one param group: Muon's matrices have their own (train.optimizer.muon_lr, scaled like lr)."""
    if group.get("use_muon"):
        return train.optimizer.muon_lr * plan.lr_scale
    return plan.effective_lr


def follow_plan_schedule(engine, train: TrainSpec, plan: Plan, schedule_steps: int | None = None) -> None:
    """After loading a checkpoint: the spec's optimizer settings and LR schedule replace the checkpoint's.

    Loading restored the saved param groups (LR, betas, weight decay, ...) and the old LambdaLR multiplier and base
    LRs, so a resume with a new `train.optimizer.lr`, `train.scheduler` or LR scaling (--allow-spec-changes) or a new
    global batch (--allow-batch-change) would otherwise keep training on the old ones. The schedule continues from the
    step the checkpoint reached, over `schedule_steps` optimizer steps (None: this plan's total). With the spec the
    checkpoint was written with, every value set here equals the loaded one, so an exact resume stays exact."""
    scheduler = engine.lr_scheduler
    multiplier = LrMultiplier(train.scheduler, plan.total_steps if schedule_steps is None else schedule_steps)
    scheduler.lr_lambdas = [multiplier] * len(scheduler.lr_lambdas)
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [group_base_lr(group, train, plan) for group in groups]
    lrs = [base * multiplier(scheduler.last_epoch) for base in scheduler.base_lrs]
    settings = {
        key: getattr(train.optimizer, field) for field, key in _GROUP_SETTINGS.get(train.optimizer.type, {}).items()
    }
    for group, lr, base in zip(groups, lrs, scheduler.base_lrs):
        group["lr"], group["initial_lr"] = lr, base
        for key, value in settings.items():
            if key in group:  # DeepSpeed's own optimizers name the same settings the same way
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
    scheduler._last_lr = lrs


def saved_schedule_steps(engine) -> int:
    """The number of optimizer steps the loaded LR schedule spans (the length the run was started with)."""
    return int(engine.lr_scheduler.lr_lambdas[0].total_steps)


def current_lr(engine) -> float:
    return float(engine.get_lr()[0])
