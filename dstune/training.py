"""One training run from start to finish, on every rank: the stages of docs/architecture.md in order.

    spec (loaded once) -> validate_spec for the launched world -> run folder -> build_family -> engine (+ EMA)
    -> resume -> records -> caches -> loader -> batch check -> train_loop -> last checkpoint -> export (rank 0)

Every failure that can differ between ranks (a dataset one node cannot read, an unwritable folder) is agreed on
before the next collective, so all ranks stop together with one message instead of hanging until the timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dstune.check import bucket_report, check_batches, expected_from_plan, rank_report
from dstune.checkpoint import (CheckpointError, TrainState, checkpoint_root, list_complete, load_checkpoint,
                               read_latest, read_state, resolve_resume, save_checkpoint, shared_folder_problem,
                               tag_for)
from dstune.distributed import Run, agree_or_stop, barrier, init_run, launcher_rank, shutdown, stop
from dstune.ema import Ema
from dstune.engine import PRECISION_DTYPES, promote_scalar_params, wrap_model
from dstune.export import ExportError, export_checkpoint
from dstune.loop import LoopContext, NonFiniteLoss, render_samples, train_loop
from dstune.progress import MetricsFile, ProgressDisplay, fmt_seconds, time_split_text
from dstune.report import plan_text
from dstune.spec.diff import describe_changes, spec_changes
from dstune.spec.load import SpecError, load_spec
from dstune.spec.models import Spec
from dstune.startup import build_family, checked_records, make_training_loader, prepare_caches
from dstune.validate import Resolved, validate_spec


def _prepare_run_dir(run_dir: Path, resume: str | None) -> str | None:
    """An error message, or None. Nothing already in the folder is overwritten without --resume."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        return (f"output.dir {run_dir}: cannot write there ({err.strerror or err}). Choose a writable folder "
                "(output.dir) before training starts.")
    if resume is None and list_complete(checkpoint_root(run_dir)):
        return (f"output.dir {run_dir} already holds checkpoints of an earlier run. Continue it with "
                "`--resume latest`, or choose another output.dir (nothing was overwritten).")
    return None


def run_training(spec_path: str, overrides: list[str], resume: str | None, allow_spec_changes: bool = False) -> int:
    try:  # spec errors need no process group: every rank reads the same file and reaches the same verdict
        spec, source = load_spec(spec_path, overrides)
    except SpecError as err:
        if launcher_rank() == 0:
            print(f"invalid spec:\n{err}", file=sys.stderr)
        return 1
    run = init_run(spec.deepspeed.timeout_minutes)
    resolved, error = None, None
    try:
        resolved = validate_spec(spec, source, run.world, accelerator=run.accelerator)
    except SpecError as err:
        error = f"invalid spec for this launch ({run.world.source}, {run.world_size} ranks):\n{err}"
    agree_or_stop(run, error)
    run_dir = Path(spec.output.dir)
    agree_or_stop(run, _prepare_run_dir(run_dir, resume))  # every rank: nodes may not share the folder
    agree_or_stop(run, shared_folder_problem(run, run_dir))
    if run.is_main:
        print(plan_text(resolved), flush=True)
        (run_dir / "ds_config.json").write_text(json.dumps(resolved.ds_config, indent=2) + "\n")
        (run_dir / "plan.json").write_text(json.dumps(resolved.plan.as_dict(), indent=2) + "\n")
        (run_dir / "spec.json").write_text(json.dumps(spec.model_dump(mode="json"), indent=2) + "\n")
    try:
        return _train(run, resolved, run_dir, resume, allow_spec_changes)
    finally:
        shutdown()


def _check_spec_changes(run: Run, spec: Spec, saved_spec: dict, allow: bool) -> None:
    """Rank 0 lists what changed since the checkpoint; changes that break exact continuation stop every rank unless
    --allow-spec-changes (then they are listed as a warning)."""
    safe_text, breaking_text = describe_changes(spec_changes(saved_spec, spec.model_dump(mode="json")),
                                                spec.train.scheduler.type)
    if breaking_text and not allow:
        stop(run, breaking_text, 1)
    if run.is_main:
        for text in (safe_text, breaking_text and "--allow-spec-changes: continuing with " + breaking_text):
            if text:
                print(text, flush=True)


def _resume(run: Run, spec: Spec, run_dir: Path, resume: str | None, engine, ema,
            allow_spec_changes: bool) -> TrainState:
    """The position to continue from (a fresh TrainState without --resume); all ranks stop together on an error."""
    if not resume:
        return TrainState()
    root = tag = state = None
    error = None
    try:
        root, tag = resolve_resume(run_dir, resume)
    except CheckpointError as err:
        error = str(err)
    agree_or_stop(run, error)
    _check_spec_changes(run, spec, read_state(root, tag).get("spec", {}), allow_spec_changes)
    try:
        state = load_checkpoint(engine, run, root, tag, ema=ema)
    except CheckpointError as err:
        error = str(err)
    agree_or_stop(run, error)
    if run.is_main:
        print(f"resumed from {root / tag}: step {state.global_step}, epoch {state.epoch + 1}, "
              f"step {state.step_in_epoch} of that epoch", flush=True)
    return state


def _check_first_batch(run: Run, engine, plan, loader, sampler, state: TrainState) -> None:
    """The batch check (dstune.check) on every rank before step 1: stop all ranks when anything disagrees."""
    first_batch = next(iter(loader))
    report = rank_report(run, engine, len(loader), len(first_batch["index"]), sampler.num_samples,
                         buckets=bucket_report(sampler, first_batch))
    ok, table, _ = check_batches(run, report, expected_from_plan(plan, state.step_in_epoch))
    if not ok:
        stop(run, table, 1)
    if run.is_main:
        print("batch check passed (spec / plan / DeepSpeed / loader agree on every rank):\n" + table, flush=True)


def _prepare_loop(run: Run, resolved: Resolved, run_dir: Path, resume: str | None,
                  allow_spec_changes: bool) -> tuple[LoopContext, TrainState]:
    """Every stage between the validated spec and step 1: model, engine, EMA, resume, data, caches, batch check."""
    spec, plan, ds_config = resolved.spec, resolved.plan, resolved.ds_config
    family, built = build_family(run, spec)
    scalar_params = promote_scalar_params(built.trainable)
    engine = wrap_model(built.trainable, spec.train, ds_config, plan)
    ema = None
    if spec.train.ema is not None:
        trainable = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
        ema = Ema(trainable, spec.train.ema, run.rank, run.world_size)
    state = _resume(run, spec, run_dir, resume, engine, ema, allow_spec_changes)
    records = checked_records(run, spec, family)
    caches, code = prepare_caches(run, spec, family, built, records)
    if code:
        stop(run, "", code)
    loader, sampler = make_training_loader(spec, plan, run.rank, family, built, records, caches, state.epoch,
                                           state.step_in_epoch)
    _check_first_batch(run, engine, plan, loader, sampler, state)
    extra = {"spec": spec.model_dump(mode="json"), "ds_config": ds_config, "plan": plan.as_dict(),
             "scalar_params": scalar_params}
    ctx = LoopContext(run=run, plan=plan, engine=engine, family=family, built=built, loader=loader, sampler=sampler,
                      run_dir=run_dir, seed=spec.train.seed, save_every_steps=spec.output.save_every_steps,
                      keep_last=spec.output.keep_last, log_every_steps=spec.output.log_every_steps,
                      checkpoint_extra=extra, sample_spec=spec.sample, resolution=spec.data.resolution, ema=ema,
                      offloaded=caches.offloaded, compute_dtype=PRECISION_DTYPES[spec.train.precision][0])
    return ctx, state


def _train(run: Run, resolved: Resolved, run_dir: Path, resume: str | None, allow_spec_changes: bool) -> int:
    spec, plan = resolved.spec, resolved.plan
    ctx, state = _prepare_loop(run, resolved, run_dir, resume, allow_spec_changes)
    if state.global_step == 0:
        render_samples(ctx, 0)
    display = ProgressDisplay(run.is_main, plan.total_steps, plan.epochs, state.global_step)
    metrics = MetricsFile(run_dir / "metrics.jsonl", run.is_main)
    started = time.perf_counter()
    try:
        state = train_loop(ctx, state, display, metrics)
    except NonFiniteLoss as err:
        display.close()
        stop(run, str(err), 1)
    finally:
        display.close()
        metrics.close()
    elapsed = time.perf_counter() - started
    tag = tag_for(state.global_step)
    if read_latest(checkpoint_root(run_dir)) != tag:  # resuming a finished run: its last checkpoint stays as it is
        save_checkpoint(ctx.engine, run, run_dir, state, ctx.checkpoint_extra, spec.output.keep_last, ema=ctx.ema)
    render_samples(ctx, state.global_step)
    if run.is_main:
        print(f"trained {state.global_step} steps ({state.samples_seen} samples) in {fmt_seconds(elapsed)}; "
              f"{time_split_text(ctx.timings)}; checkpoint {checkpoint_root(run_dir) / tag}", flush=True)
    # Training is over on every rank. The export reads the checkpoint files and needs no other rank, so the others
    # leave now rather than wait in a collective for as long as a large export takes (and against its timeout);
    # an export failure on rank 0 still makes the launcher exit non-zero.
    barrier()
    shutdown()
    if spec.output.export == "none" or not run.is_main:
        return 0
    try:
        out = export_checkpoint(run_dir, built=ctx.built)
    except ExportError as err:
        print(f"export failed: {err}\nThe checkpoint {checkpoint_root(run_dir) / tag} is complete; retry with "
              f"`dstune export {run_dir}`.", file=sys.stderr, flush=True)
        return 1
    print(f"exported: {out}", flush=True)
    return 0
