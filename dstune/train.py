"""Training entry point.

    dstune train spec.yaml --num-gpus N ...   (from any folder: validates, then runs DeepSpeed's launcher on this module)
    deepspeed --num_gpus N --module dstune.train spec.yaml [--set key=value]... [--resume latest|PATH]
    deepspeed --num_gpus N dstune/train.py spec.yaml ...      (the same, from a checkout of dstune)
    python -m dstune.train spec.yaml          (one process, no launcher)
    deepspeed --num_gpus N --module dstune.train spec.yaml --cache-only   (build data.cache on all ranks, then exit)

The flow is the one `dstune validate` shows: spec -> plan (for the real world the launcher started) -> DeepSpeed
JSON -> engine -> batch check -> loop -> checkpoint -> export. Exit codes: 0 ok, 1 invalid spec or failed check,
2 usage error.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script, Python puts dstune/ itself first on sys.path, where our module names could shadow others'.
    # Replace it with the repository root so `import dstune` works even without `pip install -e .`.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import argparse  # noqa: E402
import os  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dstune/train.py", description="Train from a dstune spec under DeepSpeed.")
    parser.add_argument("spec", help="the spec YAML")
    from dstune.cli_args import add_run_flags, add_verbose_flag

    add_run_flags(parser)
    add_verbose_flag(parser)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # launcher
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from dstune.library_logs import quiet_native_warnings, set_library_verbosity

    set_library_verbosity(args.verbose)
    quiet_native_warnings(args.verbose)
    from dstune.world import use_cpu_accelerator_if_no_cuda

    use_cpu_accelerator_if_no_cuda()
    if args.cache_only:
        from dstune.startup import run_cache_command

        return run_cache_command(args.spec, args.overrides, verify_only=False)
    from dstune.checkpoints.resume import ResumeOptions
    from dstune.training import run_training

    return run_training(
        args.spec, args.overrides, args.resume, ResumeOptions(args.allow_batch_change, args.allow_spec_changes)
    )


def run_rank(argv: list[str] | None = None) -> int:
    """`main` on a launched rank, with SIGINT / SIGTERM handled (dstune/interrupts.py): a stop before or after the
    training loop ends here as one line on rank 0 and exit 130 (SIGINT) or 143 (SIGTERM), not a traceback per rank
    (exit 0 when `dstune train` forwarded the stop: it reports it). An error that follows a stop signal (a peer that
    stopped first breaks a collective; an import the signal cut short) is part of the stop too."""
    from dstune.interrupts import finishing_stop, install_stop_handlers, rank_exit_code_for_stop, stop_requested

    try:
        install_stop_handlers()
        return main(argv)
    except (KeyboardInterrupt, Exception):
        finishing_stop()  # first thing: a second signal must not cut these last words short
        if not stop_requested():
            raise
        if _launcher_rank() == 0:
            print(_interrupted_text(argv), file=sys.stderr, flush=True)
        return rank_exit_code_for_stop()


def _launcher_rank() -> int:
    try:
        from dstune.distributed import launcher_rank  # torch-free

        return launcher_rank()
    except BaseException:  # noqa: BLE001
        return int(os.environ.get("RANK", "0"))


def _interrupted_text(argv: list[str] | None) -> str:
    """Rank 0's line after a stop outside the loop, from torch-free modules only (torch may be half imported)."""
    try:
        from dstune.checkpoints.stop_text import interrupted_text
        from dstune.spec.load import load_spec
    except BaseException:  # noqa: BLE001 - the stop is reported without the details
        return "interrupted"
    run_dir = None
    try:  # the run folder, for its last complete checkpoint (deepspeed.config never sets output.dir)
        args = parse_args(sys.argv[1:] if argv is None else argv)
        run_dir = Path(load_spec(args.spec, args.overrides)[0].output.dir)
    except BaseException:  # noqa: BLE001 - a spec problem was reported before the stop; the line goes without it
        pass
    return interrupted_text(None, run_dir)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    code = run_rank()
    from dstune.distributed import exit_rank

    exit_rank(code)  # a launched rank leaves without the interpreter's clean-up (see exit_rank)
