"""Training entry point.

    deepspeed --num_gpus N dstune/train.py spec.yaml [--set key=value]... [--resume latest|PATH [--allow-batch-change]]
    deepspeed --num_gpus N --module dstune.train spec.yaml ...
    python dstune/train.py spec.yaml          (one process, no launcher)
    deepspeed --num_gpus N dstune/train.py spec.yaml --cache-only   (build data.cache on all ranks, then exit)

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
    from dstune.library_logs import set_library_verbosity

    set_library_verbosity(args.verbose)
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
    training loop ends here as one line on rank 0 and exit 130 (SIGINT) or 143 (SIGTERM), not a traceback per rank.
    An error that follows a stop signal (a peer that stopped first breaks a collective) is part of the stop too."""
    from dstune.interrupts import exit_code_for_stop, install_stop_handlers, stop_requested

    install_stop_handlers()
    try:
        return main(argv)
    except (KeyboardInterrupt, Exception):
        if not stop_requested():
            raise
        from dstune.distributed import launcher_rank

        if launcher_rank() == 0:
            print(_interrupted_text(argv), file=sys.stderr, flush=True)
        return exit_code_for_stop()


def _interrupted_text(argv: list[str] | None) -> str:
    from dstune.training import interrupted_text

    run_dir = None
    try:  # the run folder, for the last complete checkpoint; any problem here was reported before the stop
        from dstune.ds_file_spec import merged_spec
        from dstune.spec.load import load_spec

        args = parse_args(sys.argv[1:] if argv is None else argv)
        run_dir = Path(merged_spec(*load_spec(args.spec, args.overrides))[0].output.dir)
    except Exception:  # noqa: BLE001 - the line is printed without it
        pass
    return interrupted_text(None, run_dir)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    code = run_rank()
    from dstune.distributed import exit_rank

    exit_rank(code)  # a launched rank leaves without the interpreter's clean-up (see exit_rank)
