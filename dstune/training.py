"""One training run from start to finish, on every rank: the stages of docs/architecture.md in order.

    spec (loaded once) -> validate_spec for the launched world -> run folder -> load_trained_model -> engine (+ EMA)
    -> resume -> records -> caches -> loader -> batch check -> train_loop -> last checkpoint -> export (rank 0)

Every failure that can differ between ranks (a dataset one node cannot read, an unwritable folder) is agreed on
before the next collective, so all ranks stop together with one message instead of hanging until the timeout.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from dstune.batch_check import bucket_report, check_batches, expected_from_plan, rank_report, sample_report
from dstune.checkpoints.layout import TrainState, checkpoint_root, read_latest, tag_for
from dstune.checkpoints.resume import (
    ResumeOptions,
    continue_from,
    engine_config,
    find_resume,
    overwrite_refusal,
    resume_refusal,
    resumed_plan,
)
from dstune.checkpoints.stop_text import interrupted_text
from dstune.checkpoints.store import save_checkpoint, shared_folder_problem
from dstune.distributed import (
    device_memory_bytes,
    Run,
    agree_or_stop,
    all_gather_object,
    barrier,
    init_run,
    launcher_rank,
    launcher_world_size,
    shutdown,
    stop,
    with_sequence_groups,
)
from dstune.ds_json.fill_spec import merged_spec
from dstune.families.diffusion import compile_repeated_blocks, compile_seconds
from dstune.families.ulysses import split_sequences
from dstune.ema import Ema
from dstune.engine import PRECISION_DTYPES, promote_scalar_params, wrap_model
from dstune.evaluation import make_held_out
from dstune.export import ExportError, export_checkpoint
from dstune.interrupts import at_step_boundaries, rank_exit_code_for_stop
from dstune.loop import LoopContext, NonFiniteLoss, TrainingInterrupted, render_samples, train_loop
from dstune.memory.record import MemoryRecorder, phase_table, summary_text
from dstune.memory.counts import import_model_classes
from dstune.optimizers import averaged_weights
from dstune.progress import MetricsFile, ProgressDisplay, time_split_text, trained_text
from dstune.report import plan_text
from dstune.runlock import release_held as release_run_lock, take as take_run_lock
from dstune.spec.load import SpecError, load_spec
from dstune.startup import (
    load_trained_model,
    checked_records,
    give_voices,
    hear_speakers,
    held_out_records,
    loader_clip_rule,
    make_training_loader,
    prepare_caches,
    resolve_model_folders,
)
from dstune.trackers import open_trackers
from dstune.validate import Resolved, plan_memory, validate_spec


def _prepare_run_dir(run_dir: Path) -> str | None:
    """An error message, or None: the folder exists and this rank can write there."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        return (
            f"output.dir {run_dir}: cannot write there ({err.strerror or err}). Choose a writable folder "
            "(output.dir) before training starts."
        )
    return None


def _lock_run_dir(run: Run, run_dir: Path) -> str | None:
    """Collective. Global rank 0 takes the run folder's lock (dstune/runlock.py); every rank returns its verdict,
    so a refusal is printed once. Released when the rank exits (dstune.distributed.exit_rank)."""
    error = None
    if run.is_main:
        error, note = take_run_lock(run_dir, shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]))
        if note:
            print(note, flush=True)
    return all_gather_object(error)[0]


def run_training(
    spec_path: str, overrides: list[str], resume: str | None, options: ResumeOptions = ResumeOptions()
) -> int:
    try:  # spec errors need no process group: every rank reads the same file and reaches the same verdict
        spec, source = merged_spec(*load_spec(spec_path, overrides))  # deepspeed.config fills unset keys
    except SpecError as err:
        if launcher_rank() == 0:
            print(f"invalid spec:\n{err}", file=sys.stderr)
        return 1
    refusal = resume_refusal(spec, source, resume, launcher_world_size(), options.allow_batch_change)
    if refusal:  # likewise decided from files alone, before any process group
        if launcher_rank() == 0:
            print(f"cannot resume: {refusal}", file=sys.stderr)
        return 1
    run = init_run(spec.deepspeed.timeout_minutes)
    resolved, error = None, None
    try:
        resolved = validate_spec(spec, source, run.world, accelerator=run.accelerator)
    except SpecError as err:
        error = f"invalid spec for this launch ({run.world.source}, {run.world_size} ranks):\n{err}"
    agree_or_stop(run, error)
    run = with_sequence_groups(run, resolved.plan.sequence_parallel_size)  # ranks sharing a sample, for DeepSpeed
    run_dir = Path(spec.output.dir)
    agree_or_stop(run, _prepare_run_dir(run_dir))  # every rank: nodes may not share the folder
    agree_or_stop(run, _lock_run_dir(run, run_dir))  # before anything is written there
    agree_or_stop(run, overwrite_refusal(run_dir, resume))
    agree_or_stop(run, shared_folder_problem(run, run_dir))
    if run.is_main:
        print(plan_text(resolved), flush=True)
        (run_dir / "ds_config.json").write_text(json.dumps(resolved.ds_config, indent=2) + "\n")
        (run_dir / "plan.json").write_text(json.dumps(resolved.plan.as_dict(), indent=2) + "\n")
        (run_dir / "spec.json").write_text(json.dumps(resolved.spec.model_dump(mode="json"), indent=2) + "\n")
    try:
        return _train(run, resolved, run_dir, resume, options)
    finally:
        shutdown()
        release_run_lock()


def _check_first_batch(run: Run, engine, plan, loader, sampler, state: TrainState, clip_rule) -> None:
    """The batch check (dstune.batch_check) on every rank before step 1: stop all ranks when anything disagrees.
    `clip_rule`: the model's (startup.loader_clip_rule), not the loader's: the check holds whatever loader it is
    given to the model."""
    first_batch = next(iter(loader))
    report = rank_report(
        run,
        engine,
        len(loader),
        len(first_batch["index"]),
        sampler.num_samples,
        buckets=bucket_report(sampler, first_batch, clip_rule),
        samples=sample_report(run, sampler),
    )
    ok, table, _ = check_batches(run, report, expected_from_plan(plan, state.step_in_epoch))
    if not ok:
        stop(run, table, 1)
    if run.is_main:
        print("batch check passed (spec / plan / DeepSpeed / loader agree on every rank):\n" + table, flush=True)


def _prepare_loop(
    run: Run, resolved: Resolved, run_dir: Path, resume: str | None, options: ResumeOptions
) -> tuple[LoopContext, TrainState]:
    """Every stage between the validated spec and step 1: model, engine, EMA, resume, data, caches, batch check."""
    spec, plan, ds_config = resolved.spec, resolved.plan, resolved.ds_config
    resuming = find_resume(run, resolved, run_dir, resume, options)
    plan = resumed_plan(resuming, plan)
    predicted = plan_memory(
        spec, plan, ds_config, device_memory_bytes(run), accelerator=run.accelerator, clips=resolved.clips
    )
    import_model_classes(spec)  # the baseline below then holds the libraries, and what grows after it is the model
    folders = resolve_model_folders(run, spec)  # before the baseline: making a built-in model is not training memory
    memory = MemoryRecorder(predicted)
    model = load_trained_model(run, spec, ds_config=resolved.ds_config, folders=folders)
    memory.mark("load")
    # The caches before the engine: the encoders they replace leave the device before DeepSpeed's states arrive.
    sound_rate = model.sound_rate if model.modality == "video" else None  # a video model that trains on sound
    records = checked_records(run, spec, model.modality, sound_rate)
    give_voices(model, records)
    hear_speakers(run, spec, model, records, resuming.root / resuming.tag if resuming is not None else None)
    caches, code = prepare_caches(run, spec, model, records, encoding=predicted.get("cache_encoding"))
    if code:
        stop(run, "", code)
    memory.mark("cache")
    scalar_params, compiled_after = _before_deepspeed(run, spec, model)
    engine = wrap_model(model.trainable, spec.train, engine_config(resuming, ds_config), plan)
    ema = None
    if spec.train.ema is not None:
        trainable = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
        ema = Ema(trainable, spec.train.ema, run.rank, run.world_size)
    state = continue_from(run, resuming, engine, ema, resolved, plan)
    memory.mark("engine")
    loader, sampler = make_training_loader(
        spec, plan, run.data_parallel_rank, model, records, caches, state.epoch, state.step_in_epoch
    )
    _check_first_batch(run, engine, plan, loader, sampler, state, loader_clip_rule(spec, model))
    extra = {
        "spec": spec.model_dump(mode="json"),
        "ds_config": ds_config,
        "plan": plan.as_dict(),
        "scalar_params": scalar_params,
        **({"speakers": model.voices.as_json()} if model.modality == "audio" and model.voices is not None else {}),
    }
    ctx = LoopContext(
        run=run,
        plan=plan,
        engine=engine,
        model=model,
        loader=loader,
        sampler=sampler,
        run_dir=run_dir,
        seed=spec.train.seed,
        save_every_steps=spec.output.save_every_steps,
        keep_last=spec.output.keep_last,
        log_every_steps=spec.output.log_every_steps,
        checkpoint_extra=extra,
        sample_spec=spec.sample,
        resolution=spec.data.resolution,
        ema=ema,
        offloaded=caches.offloaded,
        compute_dtype=PRECISION_DTYPES[spec.train.precision][0],
        held_out=make_held_out(spec.data, held_out_records(run, spec), plan.micro_batch_size, spec.train.seed),
        memory=memory,
        compiled_after=compiled_after,
    )
    return ctx, state


def _before_deepspeed(run: Run, spec, model) -> tuple[list, float | None]:
    """What changes the trainable module before DeepSpeed wraps it: 0-d parameters made 1-d (DeepSpeed cannot
    broadcast them; their names go into the checkpoint, export turns them back), the sequence split (DeepSpeed's ZeRO-3 hooks then wrap the split forward) and train.compile's
    blocks, compiled in place so their names stay. (the promoted scalars, the compile clock's reading before or
    None)."""
    scalar_params = promote_scalar_params(model.trainable)
    if run.sequence_parallel_size > 1:
        size = run.sequence_parallel_size
        split_sequences(model.trainable, run.rank, run.world_size, size, model.split_plan(size))
    if spec.train.compile != "blocks":
        return scalar_params, None
    compiled_after = compile_seconds()
    compiled = compile_repeated_blocks(model.trainable)
    if run.is_main:
        blocks = ", ".join(f"{count} {name}" for name, count in compiled.items())
        print(f"train.compile blocks: {blocks} compiled with torch.compile (inductor) at their first call", flush=True)
    return scalar_params, compiled_after


def _write_memory_records(run: Run, run_dir: Path, memory: MemoryRecorder) -> None:
    """Collective: every rank's peaks per phase, with the memory plan's prediction, into memory.json; one line."""
    records = all_gather_object(memory.as_dict(run.rank))
    if run.is_main:
        phases = phase_table(memory.predicted_phases(), records)
        (run_dir / "memory.json").write_text(
            json.dumps(
                {
                    "predicted": memory.predicted,
                    "predicted_per_rank_bytes": memory.predicted_bytes(),
                    "phases": phases,
                    "ranks": records,
                },
                indent=2,
            )
            + "\n"
        )
        print(summary_text(memory.predicted_bytes(), records, phases), flush=True)


def _train(run: Run, resolved: Resolved, run_dir: Path, resume: str | None, options: ResumeOptions) -> int:
    ctx, state = _prepare_loop(run, resolved, run_dir, resume, options)
    spec, plan = resolved.spec, ctx.plan
    trackers = None
    if run.is_main:
        trackers = open_trackers(run_dir, spec.output.tensorboard, spec.output.wandb, spec.model_dump(mode="json"))
    metrics = MetricsFile(run_dir / "metrics.jsonl", run.is_main, trackers, from_step=state.global_step)
    if state.global_step == 0:
        with averaged_weights(ctx.engine):  # schedule-free's averaged weights (a no-op for other optimizers)
            render_samples(ctx, 0, metrics)
    display = ProgressDisplay(run.is_main, plan.total_steps, plan.epochs, state.global_step)
    started, start_step, start_samples = time.perf_counter(), state.global_step, state.samples_seen
    try:
        with at_step_boundaries():
            state = train_loop(ctx, state, display, metrics)
    except NonFiniteLoss as err:
        display.close()
        metrics.close()
        stop(run, str(err), 1)
    except TrainingInterrupted as interrupted:
        display.close()
        metrics.close()
        if run.is_main:
            print(interrupted_text(interrupted.step, run_dir), file=sys.stderr, flush=True)
        shutdown()
        return rank_exit_code_for_stop()
    finally:
        display.close()
    elapsed = time.perf_counter() - started
    tag = tag_for(state.global_step)
    with averaged_weights(ctx.engine):  # schedule-free: the checkpoint and the export hold its averaged weights
        if read_latest(checkpoint_root(run_dir)) != tag:  # resuming a finished run: its last checkpoint stays
            save_checkpoint(ctx.engine, run, run_dir, state, ctx.checkpoint_extra, spec.output.keep_last, ema=ctx.ema)
        render_samples(ctx, state.global_step, metrics)  # closes the last step phase
    _write_memory_records(run, run_dir, ctx.memory)
    metrics.close()
    if run.is_main:
        print(
            f"{trained_text(start_step, state.global_step, start_samples, state.samples_seen, elapsed)}; "
            f"{time_split_text(ctx.timings, cached=spec.data.cache.latents or spec.data.cache.codec_tokens)}; "
            f"checkpoint {checkpoint_root(run_dir) / tag}",
            flush=True,
        )
    # Training is over on every rank. The export reads the checkpoint files and needs no other rank, so the others
    # leave now rather than wait in a collective for as long as a large export takes (and against its timeout);
    # an export failure on rank 0 still makes the launcher exit non-zero.
    barrier()
    shutdown()
    if spec.output.export == "none" or not run.is_main:
        return 0
    try:
        out = export_checkpoint(run_dir, model=ctx.model)
    except ExportError as err:
        print(
            f"export failed: {err}\nThe checkpoint {checkpoint_root(run_dir) / tag} is complete; retry with "
            f"`dstune export {run_dir}`.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(f"exported: {out}", flush=True)
    return 0
