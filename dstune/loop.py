"""`train_loop`: next batch -> model.loss -> engine.backward -> engine.step -> EMA -> log -> save -> samples. One
function, no callbacks: every step it takes is written in it.

Every rank runs the same number of micro batches (the sampler guarantees it), so every collective below is reached by
all ranks. Once per optimizer step, before the update is applied, the ranks exchange their losses: a non-finite loss
on any rank stops all of them at that step, with the rank named, and the weights of the last checkpoint untouched.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from dstune.cache.latents import frozen_on_device
from dstune.checkpoints.layout import TrainState
from dstune.checkpoints.store import checkpoint_bytes_estimate, save_checkpoint, space_problem
from dstune.distributed import Run, all_gather_object, stop
from dstune.ema import Ema
from dstune.engine import current_lr
from dstune.optimizers import averaged_weights
from dstune.evaluation import HeldOut, evaluate
from dstune.families.base import TrainedModel
from dstune.families.diffusion import compile_seconds
from dstune.families.samples import write_contact_sheet
from dstune.interrupts import stop_requested
from dstune.memory.record import MemoryRecorder, cuda_peak_bytes, peak_rss_bytes
from dstune.plan import Plan
from dstune.progress import MetricsFile, ProgressDisplay, read_metrics
from dstune.spec.models import SampleSpec


class NonFiniteLoss(RuntimeError):
    pass


class TrainingInterrupted(Exception):
    """Every rank agreed to stop (a stop signal reached one of them) after `step` optimizer steps."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


@dataclass
class LoopContext:
    run: Run
    plan: Plan
    engine: object  # the DeepSpeed engine
    model: TrainedModel  # the model's class, loaded (its trainable module is the engine's)
    loader: object  # DataLoader over the GlobalBatchSampler
    sampler: object  # GlobalBatchSampler (set_epoch / position)
    run_dir: Path
    seed: int
    save_every_steps: Optional[int]
    keep_last: int
    log_every_steps: int
    checkpoint_extra: dict  # JSON stored with every checkpoint (spec, DeepSpeed config, plan, promoted scalars)
    sample_spec: SampleSpec
    resolution: int  # data.resolution (image families sample at it)
    ema: Optional[Ema] = None
    offloaded: list = field(default_factory=list)  # frozen encoders the cache moved off the accelerator
    compute_dtype: torch.dtype = torch.float32
    held_out: Optional[HeldOut] = None  # data.eval
    # Seconds this rank spent blocked on the loader (data_s) and everything else in its steps (compute_s): the
    # loop's own measure of whether data loading is the bottleneck (see progress.time_split_text).
    timings: dict = field(default_factory=lambda: {"data_s": 0.0, "compute_s": 0.0})
    memory: MemoryRecorder = field(default_factory=MemoryRecorder)  # peaks per phase beside the memory plan
    # train.compile: the process's compile seconds before this run (its first step compiles the blocks, and the log
    # says how long); None: nothing compiled
    compiled_after: Optional[float] = None


def render_samples(ctx: LoopContext, step: int, metrics: MetricsFile) -> None:
    """Collective (ZeRO-3 gathers the weights): sample the prompts with the weights the export will hold (the EMA
    when it is exported), then rank 0 writes them (also to TensorBoard / W&B) and the samples page with the loss
    and LR curves logged so far."""
    prompts = ctx.sample_spec.prompts
    ctx.memory.mark("step")  # the training since the last mark (a sample phase's peak is its own)
    if not prompts:
        return
    with_ema = ctx.ema is not None and ctx.ema.use_for_export
    with (
        frozen_on_device(ctx.model, ctx.offloaded),
        ctx.ema.weights_in_model() if with_ema else contextlib.nullcontext(),
    ):
        outputs = ctx.model.sample(ctx.engine.module, prompts, ctx.sample_spec, ctx.resolution)
    ctx.memory.mark("sample")
    if ctx.run.is_main:
        path = ctx.run_dir / "samples" / f"step-{step:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path = ctx.model.save_samples(outputs, prompts, path) or path  # speech models: a WAV folder
        metrics.samples(step, path)
        sheet = write_contact_sheet(
            path.parent, prompts, "EMA" if with_ema else "trained", read_metrics(ctx.run_dir / "metrics.jsonl")
        )
        print(f"samples: {path} (all steps: {sheet})", flush=True)


def _agree_on_loss(
    run: Run, loss_sum: float, micro_batches: int, step: int, part_sums: dict
) -> tuple[float, bool, dict]:
    """Gather every rank's loss for this optimizer step; stop everyone if any is not finite. Returns the global mean,
    whether any rank received a stop signal (then all of them stop after this step) and the global means of the
    loss's named parts (model.loss_parts), averaged as the loss is."""
    reports = all_gather_object((run.rank, loss_sum, micro_batches, stop_requested(), part_sums))
    bad = [rank for rank, value, *_ in reports if not math.isfinite(value)]
    if bad:
        raise NonFiniteLoss(
            f"non-finite loss at optimizer step {step + 1} on rank {', '.join(map(str, bad))}; stopped before the "
            "update was applied. The last checkpoint is intact. Lower the learning rate, use fp32/bf16 instead of "
            "fp16, or check the data of that step."
        )
    micro_total = sum(report[2] for report in reports)
    mean = sum(report[1] for report in reports) / micro_total
    parts = {name: sum(report[4].get(name, 0.0) for report in reports) / micro_total for name in part_sums}
    return mean, any(report[3] for report in reports), parts


def _check_space_for_checkpoints(ctx: LoopContext) -> None:
    """Before step 1, on every rank: stop all ranks together when some rank's disk cannot hold a checkpoint."""
    needed = checkpoint_bytes_estimate(ctx.engine)
    problems = [p for p in all_gather_object(space_problem(ctx.run_dir, needed)) if p]
    if problems:
        unique = list(dict.fromkeys(problems))
        stop(ctx.run, "\n".join(unique), 1)


def memory_fields(device: torch.device) -> dict:
    """Rank 0's peak memory in GiB: the accelerator's allocated peak on CUDA, and the process's resident peak (the
    same readings dstune.memory.record takes for memory.json)."""
    fields = {"memory_host_peak_gib": peak_rss_bytes() / 2**30}
    if device.type == "cuda":
        fields["memory_accelerator_peak_gib"] = cuda_peak_bytes() / 2**30
    return fields


def held_out_fields(ctx: LoopContext, display: ProgressDisplay, step: int) -> dict:
    """Collective when due: {"eval_loss", "eval_samples"} after the steps data.eval.every_steps names, else {}."""
    if ctx.held_out is None or not ctx.held_out.due(step, ctx.plan.total_steps):
        return {}
    with averaged_weights(ctx.engine):  # schedule-free: its averaged weights (a no-op for other optimizers)
        loss, count = evaluate(ctx.run, ctx.model, ctx.engine, ctx.held_out, ctx.compute_dtype, ctx.offloaded)
    display.message(f"held-out loss at step {step}: {loss:.5f} ({count} samples, data.eval)")
    return {"eval_loss": loss, "eval_samples": count}


def train_loop(ctx: LoopContext, state: TrainState, display: ProgressDisplay, metrics: MetricsFile) -> TrainState:
    run, plan, engine, model = ctx.run, ctx.plan, ctx.engine, ctx.model
    _check_space_for_checkpoints(ctx)
    accumulation = plan.gradient_accumulation_steps
    loop_started = time.perf_counter()  # metrics' elapsed_s: wall time including logging and checkpoints
    while state.global_step < plan.total_steps:
        ctx.sampler.set_epoch(state.epoch, start_step=state.step_in_epoch)
        loss_sum, micro_in_step, part_sums = 0.0, 0, {}
        step_started = time.perf_counter()
        data_wait = 0.0
        fetch_started = time.perf_counter()
        for batch in ctx.loader:
            data_wait += time.perf_counter() - fetch_started
            encoded = model.encode_batch(batch, ctx.compute_dtype)
            loss = model.loss(engine, encoded, ctx.seed, state.global_step)
            engine.backward(loss)
            loss_sum += float(loss.detach().float())
            for name, value in model.loss_parts().items():
                part_sums[name] = part_sums.get(name, 0.0) + value
            micro_in_step += 1
            if micro_in_step < accumulation:
                engine.step()  # DeepSpeed only counts the micro step here; the update happens at the boundary
                fetch_started = time.perf_counter()
                continue
            mean_loss, stop_agreed, loss_parts = _agree_on_loss(
                run, loss_sum, micro_in_step, state.global_step, part_sums
            )
            lr = current_lr(engine)  # the LR this update applies: engine.step() moves the schedule to the next one
            engine.step()
            if ctx.ema is not None and engine.was_step_applied():  # not after a skipped (fp16 overflow) step
                ctx.ema.on_optimizer_step()
            state.global_step += 1
            state.step_in_epoch += 1
            state.samples_seen += plan.global_batch_size
            step_seconds = time.perf_counter() - step_started
            if not any(record["phase"] == "first_step" for record in ctx.memory.phases):
                ctx.memory.mark("first_step")
                _say_compile_time(ctx, step_seconds)
            ctx.timings["data_s"] += data_wait
            ctx.timings["compute_s"] += step_seconds - data_wait
            samples_per_s = plan.global_batch_size / max(step_seconds, 1e-9)
            display.update(state.global_step, state.epoch, state.samples_seen, mean_loss, lr, samples_per_s, loss_parts)
            held_out = held_out_fields(ctx, display, state.global_step)
            if held_out or state.global_step % ctx.log_every_steps == 0 or state.global_step == plan.total_steps:
                grad_norm = engine.get_global_grad_norm()
                metrics.write(
                    {
                        "step": state.global_step,
                        "epoch": state.epoch + 1,  # counted from 1, as the progress line and the plan show it
                        "samples": state.samples_seen,
                        "loss": mean_loss,
                        **{f"loss_{name}": value for name, value in loss_parts.items()},
                        "lr": lr,
                        "grad_norm": None if grad_norm is None else float(grad_norm),
                        "samples_per_s": samples_per_s,
                        "data_s": data_wait,
                        "compute_s": step_seconds - data_wait,
                        "data_wait_fraction": data_wait / max(step_seconds, 1e-9),
                        "elapsed_s": time.perf_counter() - loop_started,
                        **held_out,
                        **(memory_fields(model.device) if run.is_main else {}),
                        "peak_memory_bytes": ctx.memory.peak_bytes(),
                        "predicted_memory_bytes": ctx.memory.predicted_bytes(),
                    }
                )
            if (
                ctx.save_every_steps
                and state.global_step % ctx.save_every_steps == 0
                and state.global_step < plan.total_steps
            ):
                with averaged_weights(engine):  # schedule-free: a checkpoint holds its averaged weights
                    save_checkpoint(
                        engine,
                        run,
                        ctx.run_dir,
                        _next_position(state, plan),
                        ctx.checkpoint_extra,
                        ctx.keep_last,
                        ema=ctx.ema,
                    )
            sample_every = ctx.sample_spec.every_steps
            if sample_every and state.global_step % sample_every == 0 and state.global_step < plan.total_steps:
                with averaged_weights(engine):
                    render_samples(ctx, state.global_step, metrics)
            if state.global_step >= plan.total_steps:
                break
            if stop_agreed:
                raise TrainingInterrupted(state.global_step)
            loss_sum, micro_in_step, part_sums, data_wait = 0.0, 0, {}, 0.0
            step_started = fetch_started = time.perf_counter()
        else:  # the epoch ran out: the next one starts from its first step
            state.epoch += 1
            state.step_in_epoch = 0
            continue
        break
    return _next_position(state, plan)


def _say_compile_time(ctx: LoopContext, step_seconds: float) -> None:
    """train.compile: after the first step, how much of it went to compiling the blocks (rank 0)."""
    if ctx.compiled_after is not None and ctx.run.is_main:
        seconds = compile_seconds() - ctx.compiled_after
        print(
            f"train.compile: {seconds:.1f} s of this rank's first step ({step_seconds:.1f} s) went to "
            "compiling the blocks (forward and backward graphs)",
            flush=True,
        )


def _next_position(state: TrainState, plan: Plan) -> TrainState:
    """The position to resume from: an epoch whose steps are all done continues at the start of the next one."""
    if state.step_in_epoch >= plan.steps_per_epoch:
        return TrainState(state.global_step, state.epoch + 1, 0, state.samples_seen)
    return TrainState(state.global_step, state.epoch, state.step_in_epoch, state.samples_seen)
