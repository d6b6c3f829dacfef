"""Resuming on another number of ranks: the checkpoint's ZeRO state re-partitioned by DeepSpeed's universal format.

ZeRO 1-3 (and DeepSpeed's bf16 optimizer) save each rank's partition of the fp32 master weights and of the optimizer
state; those files only fit the world that wrote them. DeepSpeed's own converter (deepspeed.checkpoint.ds_to_universal)
turns them into one folder per parameter (fp32 weights, exp_avg, exp_avg_sq, step), and an engine started with
`checkpoint.load_universal` cuts its own partition out of those for any world. Tried here, on DeepSpeed 0.19.8 (CPU,
gloo): ZeRO 2 and 3, torch AdamW as client optimizer, LoRA checkpoints without the frozen base, fp32 and bf16,
2 -> 1 and 1 -> 2 ranks: the losses after resuming are those of the uninterrupted run. What it cannot carry:
optimizers whose state is not Adam's (the converter reads exactly exp_avg and exp_avg_sq), so those are refused
(dstune.checkpoints.resume_plan.reshard_refusal, decided from the files before any process group).

The converted copy is written by rank 0 into the resuming run's folder (RUN/.resume-universal/<tag>, through a
temporary folder renamed at the end), never into the checkpoint it reads, and removed once every rank has loaded.
A stage-0 fp32 checkpoint needs none of this: its optimizer state is whole in one file, loaded on any world.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import secrets
import shutil
from pathlib import Path

from dstune.checkpoints.layout import CheckpointError
from dstune.checkpoints.store import only_tensors_unpickled
from dstune.distributed import Run, agree_or_stop, barrier

UNIVERSAL_DIR = ".resume-universal"


def convert(folder: Path, out: Path) -> None:
    """Write the universal form of the checkpoint `folder` to `out` (one process, no launcher). Atomic: a temporary
    folder beside `out`, renamed at the end; `folder` is only read. CheckpointError with DeepSpeed's output on failure."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f"{out.name}.partial-{secrets.token_hex(4)}"
    args = argparse.Namespace(
        input_folder=str(folder),
        output_folder=str(partial),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )  # dstune's checkpoints carry no universal_checkpoint_info
    log = io.StringIO()
    try:
        with (
            only_tensors_unpickled(f"checkpoint {folder}"),
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            ds_to_universal(args)
    except CheckpointError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except Exception as err:  # DeepSpeed's converter asserts and raises anything; report it with its output
        shutil.rmtree(partial, ignore_errors=True)
        tail = "\n".join(log.getvalue().splitlines()[-10:])
        raise CheckpointError(
            f"converting {folder} for another number of ranks failed: {type(err).__name__}: {err}\n{tail}"
        ) from err
    if out.exists():
        shutil.rmtree(out)  # a copy left by an earlier resume that stopped before loading: ours, made again
    partial.rename(out)


def universal_copy(run: Run, run_dir: Path, root: Path, tag: str) -> Path:
    """Collective. Rank 0 converts checkpoint root/tag into RUN/.resume-universal/tag; every rank waits, and all stop
    together if it failed. Returns the folder to pass to engine.load_checkpoint (with the same tag)."""
    universal_root = Path(run_dir) / UNIVERSAL_DIR
    error = None
    if run.is_main:
        ranks = f"{run.world_size} rank{'s' if run.world_size != 1 else ''}"
        print(
            f"converting {root / tag} to DeepSpeed's universal checkpoint for {ranks} (into {universal_root / tag})",
            flush=True,
        )
        try:
            convert(root / tag, universal_root / tag)
        except (CheckpointError, OSError) as err:
            error = str(err)
    agree_or_stop(run, error if run.is_main else None)
    return universal_root


def remove_universal_copy(run: Run, universal_root: Path) -> None:
    """Collective: once every rank has loaded, rank 0 removes the converted copy (the run's own checkpoints follow)."""
    barrier()
    if run.is_main:
        shutil.rmtree(universal_root, ignore_errors=True)
