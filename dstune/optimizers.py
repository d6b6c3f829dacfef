"""The optimizers beyond torch's own that dstune builds as DeepSpeed client optimizers, and schedule-free AdamW's
two weight modes around everything that reads the weights.

- `Prodigy` (Mishchenko & Defazio 2023): Adam whose step size D is estimated from the run itself. Its estimate is a
  ratio of two sums over every trained parameter. Under ZeRO each rank steps only its flat partition, so the sums
  are completed over the ranks (one all-reduce of two numbers per step); without that every rank would estimate
  its own D from its share and the ranks' weights would drift apart. At ZeRO 0 every rank holds all parameters and
  sums them itself. The state per trained parameter: the two Adam moments, the running sum `s` and the starting
  point `p0` (16 bytes in fp32). Written for dstune after the paper and the authors' prodigyopt package, whose
  update it reproduces to float32 rounding (its sums are accumulated in float64 so that a resumed run takes the
  same steps bitwise; tests/unit/test_optimizers.py compares the two).
- schedule-free AdamW (Defazio et al. 2024, the `schedulefree` package): the parameters it steps are an
  interpolation y of its averaged weights x and its base iterate z. Samples, checkpoints, the held-out loss and so
  the export must see x: `averaged_weights(engine)` switches the optimizer to x ("eval" mode), writes that into the
  module's weights (DeepSpeed keeps the module's copy apart from the partitions the optimizer steps), and switches
  back to y afterwards. A checkpoint therefore holds x with z in its state, and `train_mode(engine)` after a resume
  computes y from them exactly as the uninterrupted run did after its save.
- adamw8bit: bitsandbytes' AdamW8bit (block-wise 8-bit moments; tensors under 4096 elements keep fp32 moments).
"""

from __future__ import annotations

import contextlib

import torch
from schedulefree import AdamWScheduleFree

from dstune.spec.models import TrainSpec

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep 32-bit moments


class Prodigy(torch.optim.Optimizer):
    """Prodigy with decoupled weight decay and no bias correction (prodigyopt's defaults). `sharded`: the parameters
    are this rank's partitions of flat ZeRO groups, so the estimate's sums are completed over the process group."""

    def __init__(
        self, params, lr=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, d_coef=1.0, d0=1e-6, sharded=False
    ):
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            d_coef=d_coef,
            d=d0,
            d0=d0,
            d_max=d0,
            d_numerator=0.0,
            k=0,
        )
        super().__init__(params, defaults)
        self.sharded = sharded

    def _completed(self, numerator: float, denominator: float) -> tuple[float, float]:
        """The two sums over every rank's partition (a no-op without ZeRO)."""
        if not self.sharded:
            return numerator, denominator
        import deepspeed.comm as dist
        from deepspeed.accelerator import get_accelerator

        both = torch.tensor(
            [numerator, denominator], dtype=torch.float64, device=get_accelerator().current_device_name()
        )
        dist.all_reduce(both)
        return float(both[0]), float(both[1])

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        first = self.param_groups[0]
        beta1, beta2 = first["betas"]
        beta3 = beta2**0.5
        d, d0, d_max, d_coef = first["d"], first["d0"], first["d_max"], first["d_coef"]
        lr = max(group["lr"] for group in self.param_groups)
        dlr = d * lr
        numerator_growth, denominator = 0.0, 0.0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["s"] = torch.zeros_like(p)
                    state["p0"] = p.detach().clone()
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                grad = p.grad
                if group["lr"] > 0:
                    # ATen's sum, accumulated in float64, not BLAS's dot: MKL's dot may round differently with the
                    # arrays' alignment, which a resume changes, and the sums steer every later step
                    moved = (grad * (state["p0"] - p)).sum(dtype=torch.float64).item()
                    numerator_growth += (d / d0) * dlr * moved
                    state["exp_avg"].mul_(beta1).add_(grad, alpha=d * (1 - beta1))
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=d * d * (1 - beta2))
                    state["s"].mul_(beta3).add_(grad, alpha=(d / d0) * dlr)
                    denominator += state["s"].abs().sum(dtype=torch.float64).item()
        numerator_growth, denominator = self._completed(numerator_growth, denominator)
        if denominator == 0:  # no gradient anywhere yet: nothing to estimate, nothing to step
            return loss
        numerator = first["d_numerator"] * beta3 + numerator_growth
        if lr > 0:
            d_max = max(d_max, d_coef * numerator / denominator)
            d = d_max  # the estimate never shrinks (no growth cap: prodigyopt's default growth_rate inf)
        for group in self.param_groups:
            group.update(d_numerator=numerator, d=d, d_max=d_max, k=group["k"] + 1)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                denom = state["exp_avg_sq"].sqrt().add_(d * group["eps"])
                if group["weight_decay"]:
                    p.add_(p, alpha=-group["weight_decay"] * dlr)
                p.addcdiv_(state["exp_avg"], denom, value=-dlr)
        return loss


def build_client_optimizer(train: TrainSpec, params, lr: float, sharded: bool):
    """The optimizers of this module for train.optimizer (None for the others: dstune.engine builds those)."""
    opt = train.optimizer
    if opt.type == "prodigy":
        return Prodigy(
            params,
            lr=lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            d_coef=opt.d_coef,
            sharded=sharded,
        )
    if opt.type == "adamw_schedulefree":
        # warmup comes from dstune's schedule (train.scheduler constant_with_warmup), not the optimizer's own
        return AdamWScheduleFree(
            params, lr=lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, warmup_steps=0
        )
    if opt.type == "adamw8bit":
        try:
            from bitsandbytes.optim import AdamW8bit
        except ImportError:
            raise RuntimeError(
                "train.optimizer.type adamw8bit needs bitsandbytes: pip install 'dstune[lora]' (or bitsandbytes)"
            ) from None
        return AdamW8bit(
            params, lr=lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, min_8bit_size=BNB_MIN_8BIT_SIZE
        )
    return None


# ------------------------------------------------------------------------------------- schedule-free's two modes


def _base_optimizer(engine):
    """The optimizer DeepSpeed steps: wrapped by its ZeRO / bf16 optimizers, or the engine's own at ZeRO 0 fp32."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _push_master_weights(engine) -> None:
    """Write the optimizer's (partitioned) master weights into the module's weights, as DeepSpeed does after a step:
    ZeRO 1/2 and the bf16 optimizer copy their partition and all-gather it (update_lp_params); ZeRO-3 copies each
    sub-group's partition into the partitioned 16-bit parameters (gathered again at the next forward) and refreshes
    the persistent ones. At ZeRO 0 in fp32 the optimizer steps the module's own tensors: nothing to copy."""
    wrapper = engine.optimizer
    if hasattr(wrapper, "update_lp_params"):
        wrapper.update_lp_params()
    elif hasattr(wrapper, "_reassign_or_swap_out_partitioned_parameters"):
        for sub_group in range(len(wrapper.fp16_groups)):
            wrapper._reassign_or_swap_out_partitioned_parameters(sub_group)
        if wrapper.persistent_parameters:
            wrapper.persistent_parameters[0].all_gather(wrapper.persistent_parameters)


def _two_modes(engine):
    """Schedule-free's optimizer (its param groups carry train_mode), or None for every other optimizer."""
    optimizer = _base_optimizer(engine)
    return optimizer if "train_mode" in optimizer.param_groups[0] else None


def train_mode(engine) -> None:
    """Collective under ZeRO. Schedule-free: the weights it steps (y), before the first step and after a resume (a
    checkpoint holds the averaged weights). A no-op for the other optimizers."""
    optimizer = _two_modes(engine)
    if optimizer is not None and not optimizer.param_groups[0]["train_mode"]:
        optimizer.train()
        if optimizer.state:  # before the first step there is no z: the weights are y already
            _push_master_weights(engine)


@contextlib.contextmanager
def averaged_weights(engine):
    """Collective under ZeRO. Inside: the module holds schedule-free's averaged weights x (what samples, the held-out
    loss and checkpoints use); after: the weights it steps again, computed from x and z as a resume computes them.
    A no-op for the other optimizers."""
    optimizer = _two_modes(engine)
    if optimizer is None:
        yield
        return
    optimizer.eval()
    _push_master_weights(engine)
    try:
        yield
    finally:
        optimizer.train()
        _push_master_weights(engine)
