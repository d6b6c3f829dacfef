"""One training run from start to finish, on every rank: the stages of DESIGN.md section 1 in order.

Every failure that can differ between ranks (a dataset one node cannot read, an unwritable folder) is agreed on
before the next collective, so all ranks stop together with one message instead of hanging until the timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from dstune.check import bucket_report, check_batches, expected_from_plan, rank_report
from dstune.checkpoint import (CheckpointError, TrainState, checkpoint_root, list_complete, load_checkpoint,
                               read_latest, resolve_resume, save_checkpoint, tag_for)
from dstune.distributed import Run, all_gather_object, any_rank, barrier, init_run, shutdown, stop
from dstune.progress import MetricsFile, ProgressDisplay, fmt_seconds, time_split_text
from dstune.spec.load import SpecError, load_spec
from dstune.spec.models import AUDIO_FAMILIES


def _agree_or_stop(run: Run, error: str | None) -> None:
    """Stop every rank if any rank has an error; the messages of all failing ranks are printed by rank 0."""
    errors = all_gather_object(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        same = len({e for _, e in failed}) == 1 and len(failed) == run.world_size
        text = failed[0][1] if same else "\n".join(f"rank {rank}: {e}" for rank, e in failed)
        stop(run, text, 1)


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


def _shared_run_dir_problem(run: Run, run_dir: Path) -> str | None:
    """Collective: every rank must see the same output folder (checkpoints need all shards in one place)."""
    from dstune.checkpoint import shared_folder_problem

    return shared_folder_problem(run, run_dir)


def _plan_text(resolved) -> str:
    from dstune.cli_render import plan_text

    return plan_text(resolved)


def run_training(spec_path: str, overrides: list[str], resume: str | None) -> int:
    from dstune.distributed import launcher_rank

    try:  # spec errors need no process group: every rank reads the same file and reaches the same verdict
        spec, _ = load_spec(spec_path, overrides)
    except SpecError as err:
        if launcher_rank() == 0:
            print(f"invalid spec:\n{err}", file=sys.stderr)
        return 1
    run = init_run(spec.deepspeed.timeout_minutes)
    from dstune.resolve import resolve

    resolved, error = None, None
    try:
        resolved = resolve(spec_path, overrides, world=run.world, accelerator=run.accelerator)
    except SpecError as err:
        error = f"invalid spec for this launch ({run.world.source}, {run.world_size} ranks):\n{err}"
    _agree_or_stop(run, error)
    spec, plan, ds_config = resolved.spec, resolved.plan, resolved.ds_config
    run_dir = Path(spec.output.dir)
    _agree_or_stop(run, _prepare_run_dir(run_dir, resume))  # every rank: nodes may not share the folder
    _agree_or_stop(run, _shared_run_dir_problem(run, run_dir))
    if run.is_main:
        print(_plan_text(resolved), flush=True)
        (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
        (run_dir / "plan.json").write_text(json.dumps(plan.as_dict(), indent=2) + "\n")
        (run_dir / "spec.json").write_text(json.dumps(spec.model_dump(mode="json"), indent=2) + "\n")
    try:
        return _train(run, resolved, run_dir, resume)
    finally:
        shutdown()


def _build(run: Run, spec):
    from dstune.families import get_family

    family = get_family(spec.model.family)
    frozen_dtype = torch.bfloat16 if spec.train.precision == "bf16" else torch.float32
    # Rank 0 builds shared artefacts first (a built-in model is made once, into the cache), the others then load it.
    error, built = None, None
    for turn in (True, False):
        if run.is_main == turn:
            try:
                built = family.build(spec.model, spec.output.cache_dir, run.device, frozen_dtype)
            except (ValueError, OSError) as err:
                error = f"model.pretrained {spec.model.pretrained!r}: {err}"
        barrier()
    _agree_or_stop(run, error)
    from dstune.lora import apply_train_mode

    try:  # before DeepSpeed sees the module: with LoRA only the adapters are trainable (dstune.lora)
        summary = apply_train_mode(built.trainable, spec.model, spec.train.seed, family)
    except ValueError as err:
        summary, error = None, str(err)
    _agree_or_stop(run, error)
    if run.is_main:
        print(summary, flush=True)
    return family, built


def _start_ema(run: Run, settings, engine):
    """The EMA of the trainable parameters (None when train.ema is off), updated after every optimizer update by
    the LR scheduler's hook (dstune.engine.UpdateHookLR), so the loop itself needs no EMA code."""
    if settings is None:
        return None
    from dstune.ema import Ema

    trainable = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    ema = Ema(trainable, settings, run.rank, run.world_size)
    engine.lr_scheduler.after_update.append(ema.on_optimizer_step)
    return ema


def _checked_records(run: Run, data):
    """The dataset's samples, after every rank checked its share of the image files (before step 1, not mid-epoch).

    Bad files stop the run with their names, or with data.skip_bad_files are counted and replaced at load time by
    the next readable sample, so the plan (and every number validate printed) stays the same."""
    from dstune.data import find_bad_images, list_samples

    records = list_samples(data)
    mine = [(r.sample_id, reason) for r, reason in find_bad_images(records, run.rank, run.world_size)]
    bad = [item for share in all_gather_object(mine) for item in share]
    if bad:
        listing = "\n".join(f"  {sample_id}: {reason}" for sample_id, reason in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        if not data.skip_bad_files:
            stop(run, f"data.path: {len(bad)} unreadable image(s):\n{listing}{more}\nFix or remove them, or set "
                      "data.skip_bad_files: true to train without them.", 1)
        if run.is_main:
            print(f"data: {len(bad)} unreadable image(s) skipped (each replaced by the next readable sample):\n"
                  f"{listing}{more}", flush=True)
    return records


def _train(run: Run, resolved, run_dir: Path, resume: str | None) -> int:
    from dstune.data import build_loader
    from dstune.engine import promote_scalar_params, wrap_model
    from dstune.loop import LoopContext, NonFiniteLoss, train_loop

    spec, plan, ds_config = resolved.spec, resolved.plan, resolved.ds_config
    family, built = _build(run, spec)
    scalar_params = promote_scalar_params(built.trainable)
    engine = wrap_model(built.trainable, spec.train, ds_config, plan)
    ema = _start_ema(run, spec.train.ema, engine)
    state, error = TrainState(), None
    if resume:
        try:
            root, tag = resolve_resume(run_dir, resume)
        except CheckpointError as err:
            error = str(err)
        _agree_or_stop(run, error)
        try:
            state = load_checkpoint(engine, run, root, tag, ema=ema)
        except CheckpointError as err:
            error = str(err)
        _agree_or_stop(run, error)
        if run.is_main:
            print(f"resumed from {root / tag}: step {state.global_step}, epoch {state.epoch + 1}, "
                  f"step {state.step_in_epoch} of that epoch", flush=True)
    audio = spec.model.family in AUDIO_FAMILIES  # speech families: their own index, loader and codec cache
    if audio:
        from dstune.data.audio import speech_records_for_run

        records = speech_records_for_run(run, spec.data)
    else:
        records = _checked_records(run, spec.data)
    offloaded: list[str] = []
    if audio:
        from dstune.data.audio import speech_training_loader

        loader, sampler = speech_training_loader(run, spec, plan, built, records, state.epoch, state.step_in_epoch)
    elif spec.data.cache.latents or spec.data.cache.text_embeddings:  # built (or checked) before the batch check
        from dstune.cache_build import offload_frozen, prepare_cache
        from dstune.data.cached import build_cached_loader

        cache, code = prepare_cache(run, spec, built, records)
        if cache is None:
            stop(run, "", code)
        offloaded = offload_frozen(built, cache)
        loader, sampler = build_cached_loader(spec.data, plan, run.rank, spec.train.seed, records, cache,
                                              start_epoch=state.epoch, start_step=state.step_in_epoch)
    else:
        loader, sampler = build_loader(spec.data, plan, run.rank, spec.train.seed, records,
                                       start_epoch=state.epoch, start_step=state.step_in_epoch)
    first_batch = next(iter(loader))
    report = rank_report(run, engine, len(loader), len(first_batch["index"]), sampler.num_samples,
                         buckets=bucket_report(sampler, first_batch))
    ok, table, _ = check_batches(run, report, expected_from_plan(plan, state.step_in_epoch))
    if not ok:
        stop(run, table, 1)
    if run.is_main:
        print("batch check passed (spec / plan / DeepSpeed / loader agree on every rank):\n" + table, flush=True)
    compute_dtype = torch.bfloat16 if spec.train.precision == "bf16" else (
        torch.float16 if spec.train.precision == "fp16" else torch.float32)

    def render_samples(step: int) -> None:
        if not spec.sample.prompts:
            return
        from dstune.cache_build import frozen_on_device

        from dstune.families.base import write_contact_sheet

        with_ema = ema is not None and ema.use_for_export  # samples show the weights the export will hold
        with frozen_on_device(built, offloaded), (ema.weights_in_model() if with_ema else contextlib.nullcontext()):
            images = family.sample(built, engine.module, spec.sample.prompts, spec.sample, spec.data.resolution)
        if run.is_main:
            path = run_dir / "samples" / f"step-{step:06d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path = family.save_grid(images, spec.sample.prompts, path) or path  # audio families: a WAV folder
            sheet = write_contact_sheet(path.parent, spec.sample.prompts, "EMA" if with_ema else "trained")
            print(f"samples: {path} (all steps: {sheet})", flush=True)

    extra = {"spec": spec.model_dump(mode="json"), "ds_config": ds_config, "plan": plan.as_dict(),
             "scalar_params": scalar_params}
    if ema is not None:
        extra["ema"] = ema  # not stored in the JSON: each rank saves its EMA share beside its shards
    ctx = LoopContext(run=run, plan=plan, engine=engine, family=family, built=built, loader=loader, sampler=sampler,
                      run_dir=run_dir, seed=spec.train.seed, save_every_steps=spec.output.save_every_steps,
                      keep_last=spec.output.keep_last, log_every_steps=spec.output.log_every_steps,
                      checkpoint_extra=extra, sample_every_steps=spec.sample.every_steps,
                      render_samples=render_samples, compute_dtype=compute_dtype)
    if state.global_step == 0:
        render_samples(0)
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
        save_checkpoint(engine, run, run_dir, state, extra, spec.output.keep_last)
    render_samples(state.global_step)
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
    from dstune.export import ExportError, export_checkpoint

    try:
        out = export_checkpoint(run_dir, built=built)
    except ExportError as err:
        print(f"export failed: {err}\nThe checkpoint {checkpoint_root(run_dir) / tag} is complete; retry with "
              f"`dstune export {run_dir}`.", file=sys.stderr, flush=True)
        return 1
    print(f"exported: {out}", flush=True)
    return 0
