"""The `dstune` command: validate, compile, schema, init, train, export, synthesize, cache. (`dstune train` runs
DeepSpeed's launcher on `python -m dstune.train`: dstune/launcher.py; in a checkout the ranks can also be started with
`deepspeed --num_gpus N dstune/train.py spec.yaml`.)

Exit codes, the same for every subcommand:
  0  done; for validate/compile: the spec is valid for that world (warnings allowed)
  1  invalid: the spec, its dataset, its DeepSpeed JSON or the hostfile it is planned for has errors (all listed)
  2  usage error: the command line itself is wrong (unknown flag, a --set without `=`, world flags that cannot be
     combined, such as --num-gpus with --include, or world flags that describe no launchable world without a
     hostfile, such as --num-nodes 2 without --hostfile; `init -o FILE` onto an existing file without --force).
     Problems found reading a --hostfile (or applying --include/--exclude to it) are exit 1, like spec errors.
  3  internal error: a bug in dstune (printed with its traceback; please report it)
  dstune train also ends with 128 + the signal when stopped by one (130 SIGINT, 143 SIGTERM, 129 SIGHUP), and with
  a failed rank's exit code when the run failed after it started.
User errors never print a Python traceback. Imports are lazy: `dstune schema` and spec errors never load torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Callable

from dstune.cli_args import build_parser

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3


class UsageError(Exception):
    """The command line is wrong: reported like argparse reports, exit 2."""


# ------------------------------------------------------------------------------------------------ helpers


def _check_overrides(overrides: list[str]) -> None:
    from dstune.spec.load import SpecError, parse_override

    for text in overrides:
        try:
            parse_override(text)
        except SpecError as err:
            raise UsageError("; ".join(issue.message for issue in err.issues)) from None


def _check_world_flag_combinations(args) -> None:
    """DeepSpeed's launcher rules for which flags go together; the rest is checked by dstune.world."""

    def given(*names: str) -> str:
        return " ".join(f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is not None)

    if args.world_size is not None and given("num_gpus", "hostfile", "include", "exclude"):
        raise UsageError(
            f"--world-size cannot be combined with {given('num_gpus', 'hostfile', 'include', 'exclude')}: "
            "it gives the rank count directly. Use --world-size N [--num-nodes M], or the "
            "DeepSpeed-style flags."
        )
    if given("num_gpus", "num_nodes") and given("include", "exclude"):
        raise UsageError(
            f"{given('num_gpus', 'num_nodes')} cannot be combined with {given('include', 'exclude')} "
            "(DeepSpeed: 'Cannot specify num_nodes/gpus with include/exclude'). Pick hosts and slots "
            "with --include/--exclude, or counts, not both."
        )
    if args.include is not None and args.exclude is not None:
        raise UsageError("--include and --exclude cannot be used together (DeepSpeed's rule); keep one.")


def _world_factory(args) -> Callable:
    def make_world():
        from dstune.world import world_from_flags

        return world_from_flags(
            world_size=args.world_size,
            num_gpus=args.num_gpus,
            num_nodes=args.num_nodes,
            hostfile=args.hostfile,
            include=args.include,
            exclude=args.exclude,
        )

    return make_world


@contextlib.contextmanager
def _stdout_to_stderr(active: bool):
    """While DeepSpeed runs, anything it prints (Python logging or C code) goes to stderr, so that stdout holds
    exactly the JSON a script asked for."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _outcome(args, quiet_stdout: bool):
    """Resolve the spec for the flags' world -> Outcome (errors included). WorldError passes through."""
    from dstune.report import Outcome
    from dstune.data.index import DataError
    from dstune.validate import ResolveError, load_and_validate
    from dstune.spec.load import SpecError, SpecIssue

    _check_world_flag_combinations(args)
    _check_overrides(args.overrides)
    try:
        with _stdout_to_stderr(quiet_stdout):
            resolved = load_and_validate(
                args.spec,
                args.overrides,
                world=_world_factory(args),
                num_samples=args.num_samples,
                accelerator=args.accelerator,
            )
        return Outcome.of(resolved)
    except ResolveError as err:
        return Outcome(
            err.spec,
            err.world,
            err.plan,
            err.ds_config,
            err.num_samples_origin,
            err.warnings,
            tuple(err.issues),
            clips=err.clips,
        )
    except SpecError as err:  # the spec did not load: nothing else was worked out
        return Outcome(errors=tuple(err.issues))
    except DataError as err:
        return Outcome(errors=(SpecIssue(err.key, err.message, args.spec),))


def _world_error(args, err) -> tuple[int, str]:
    """A hostfile that cannot be used is an invalid input (1); any other WorldError is about the flags (2)."""
    return (EXIT_INVALID if args.hostfile is not None else EXIT_USAGE), str(err)


# ------------------------------------------------------------------------------------------------ commands


def cmd_validate(args) -> int:
    from dstune.report import Outcome, print_report, report_console
    from dstune.spec.load import SpecIssue
    from dstune.world import WorldError

    try:
        outcome = _outcome(args, quiet_stdout=args.json)
    except WorldError as err:
        code, message = _world_error(args, err)
        if code == EXIT_USAGE:
            raise UsageError(message) from None
        outcome = Outcome(errors=(SpecIssue("--hostfile", message),))
    if args.require_fit and args.gpu_memory is None:
        raise UsageError("--require-fit needs --gpu-memory SIZE (the memory of one GPU, e.g. 24GB)")
    if outcome.plan is not None and not outcome.errors:  # the Memory section (imports torch: a valid spec has)
        from dstune.validate import plan_memory

        with _stdout_to_stderr(args.json):
            outcome = dataclasses.replace(
                outcome,
                memory=plan_memory(
                    outcome.spec,
                    outcome.plan,
                    outcome.ds_config,
                    args.gpu_memory,
                    "cpu" if args.accelerator == "cpu" else "cuda",
                    outcome.clips,
                ),
            )
    if args.json:
        print(json.dumps(outcome.as_json(), indent=2))
    else:
        print_report(outcome, report_console(), title=f"dstune validate {args.spec}")
    resumable = True
    if args.resume_from and outcome.plan and not outcome.errors:
        resumable = _print_resume_preview(args, outcome)
    unfit = args.require_fit and outcome.memory is not None and outcome.memory.get("fits") is not True
    return EXIT_INVALID if outcome.errors or not resumable or unfit else EXIT_OK


def _print_resume_preview(args, outcome) -> bool:
    """--resume-from: the resume of RUN_DIR's latest checkpoint on the validated world (reads only JSON files)."""
    from dstune.checkpoints.layout import CheckpointError, read_state, resolve_resume
    from dstune.checkpoints.resume_plan import reshard_refusal, resume_preview
    from dstune.spec.load import SpecSource

    try:
        root, tag = resolve_resume(Path(args.resume_from), "latest")
        saved = read_state(root, tag)
    except (CheckpointError, OSError, ValueError) as err:
        print(f"--resume-from {args.resume_from}: {err}", file=sys.stderr)
        return False
    plan = outcome.plan
    reshard = reshard_refusal(
        root / tag, saved["spec"]["train"]["optimizer"]["type"], saved["world_size"], plan.world_size
    )
    text, ok = resume_preview(
        outcome.spec.model_dump(mode="json"),
        outcome.spec.train,
        plan.world_size,
        plan.global_batch_size,
        saved,
        SpecSource(args.spec),
        f"checkpoint {root / tag}",
        reshard,
    )
    print(text, file=sys.stdout if ok and not args.json else sys.stderr)
    return ok


def cmd_compile(args) -> int:
    from dstune.report import print_issues, report_console
    from dstune.world import WorldError

    try:
        outcome = _outcome(args, quiet_stdout=args.output is None)
    except WorldError as err:
        code, message = _world_error(args, err)
        if code == EXIT_USAGE:
            raise UsageError(message) from None
        print(f"error: --hostfile: {message}", file=sys.stderr)
        return EXIT_INVALID
    print_issues(outcome, report_console(stderr=True))
    if outcome.errors:
        print(f"not compiled: {len(outcome.errors)} error(s)", file=sys.stderr)
        return EXIT_INVALID
    text = json.dumps(outcome.ds_config, indent=2) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        _write(args.output, text)
        print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def cmd_schema(args) -> int:
    from dstune.spec.models import Spec

    print(json.dumps(Spec.model_json_schema(), indent=2))
    return EXIT_OK


def cmd_init(args) -> int:
    from dstune import registry
    from dstune.reference import example_spec, model_spec

    if args.model is not None and args.family is not None:
        raise UsageError("give --model or --family, not both (a model names its family)")
    presets = registry.presets()
    if args.model is not None and args.model not in {p.name for p in presets}:
        listing = "\n".join(f"  {p.name:<16} {p.family:<9} {p.pretrained:<48} {p.title}" for p in presets)
        print(
            f"models (--model NAME, family, published checkpoint, what it is):\n{listing}",
            file=sys.stdout if args.model == "list" else sys.stderr,
        )
        if args.model == "list":
            return EXIT_OK
        raise UsageError(f"unknown model {args.model!r}: choose one of the models listed above")
    text = model_spec(args.model) if args.model is not None else example_spec(args.family or "sd")
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_OK
    if Path(args.output).exists() and not args.force:
        raise UsageError(f"{args.output} already exists; pass --force to overwrite it, or choose another -o FILE")
    _write(args.output, text)
    print(f"wrote {args.output}; check it with: dstune validate {args.output}", file=sys.stderr)
    return EXIT_OK


def _write(path: str, text: str) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None


def cmd_export(args) -> int:
    from dstune.world import use_cpu_accelerator_if_no_cuda

    use_cpu_accelerator_if_no_cuda()
    from dstune.export import ExportError, export_checkpoint

    if args.out and Path(args.out).exists():
        raise UsageError(f"--out {args.out} already exists; choose a new folder (an export never overwrites)")
    try:
        out = export_checkpoint(
            Path(args.run_dir),
            step=args.step,
            out_dir=Path(args.out) if args.out else None,
            lora_format=args.lora_format,
        )
    except (ExportError, ValueError, OSError) as err:
        print(f"dstune export: {err}", file=sys.stderr)
        return EXIT_INVALID
    print(f"exported {out}")
    return EXIT_OK


def cmd_synthesize(args) -> int:
    if not (Path(args.folder) / "config.json").is_file() or args.seconds <= 0:
        raise UsageError(f"FOLDER {args.folder} must be an export folder (config.json) and --seconds above 0")
    from dstune.export import speak
    from dstune.families.speakers import UnknownSpeaker, synthesis_speaker

    try:
        synthesis_speaker(Path(args.folder), args.speaker)  # an unknown name is a usage error, before any loading
    except UnknownSpeaker as err:
        raise UsageError(str(err)) from None
    except ValueError as err:
        print(f"dstune synthesize: {err}", file=sys.stderr)
        return EXIT_INVALID
    try:
        clip = speak(
            Path(args.folder), args.text, Path(args.output), args.seconds, args.temperature, args.seed, args.speaker
        )
    except (ValueError, OSError, KeyError, RuntimeError) as err:
        print(f"dstune synthesize: {args.folder}: {err}", file=sys.stderr)
        return EXIT_INVALID
    print(f"wrote {args.output} ({clip.wave.size / clip.sample_rate:.2f} s at {clip.sample_rate} Hz)")
    return EXIT_OK


def cmd_cache(args) -> int:
    _check_overrides(args.overrides)
    from dstune.world import use_cpu_accelerator_if_no_cuda

    use_cpu_accelerator_if_no_cuda()
    from dstune.startup import run_cache_command

    return run_cache_command(args.spec, args.overrides, verify_only=args.verify)


def cmd_train(args) -> int:
    """Validate for the flags' world (nothing starts on an error), refuse an output.dir in use, then launch."""
    from rich.console import Console

    from dstune.report import print_issues
    from dstune.runlock import in_use_problem
    from dstune.world import WorldError, use_cpu_accelerator_if_no_cuda

    use_cpu_accelerator_if_no_cuda()  # the runner and the ranks inherit it
    try:
        outcome = _outcome(args, quiet_stdout=False)
    except WorldError as err:
        code, message = _world_error(args, err)
        if code == EXIT_USAGE:
            raise UsageError(message) from None
        print(f"dstune train: --hostfile: {message}", file=sys.stderr)
        return EXIT_INVALID
    print_issues(outcome, Console(stderr=True, highlight=False))
    if outcome.errors:
        print(f"dstune train: not launched: {len(outcome.errors)} error(s) in {args.spec}", file=sys.stderr)
        return EXIT_INVALID
    run_dir = Path(outcome.spec.output.dir)
    problem = None if args.cache_only else in_use_problem(run_dir)
    if problem:
        print(f"dstune train: not launched: {problem}", file=sys.stderr)
        return EXIT_INVALID
    from dstune.launcher import launch

    return launch(args, run_dir, outcome.world)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "validate": cmd_validate,
    "compile": cmd_compile,
    "schema": cmd_schema,
    "init": cmd_init,
    "export": cmd_export,
    "synthesize": cmd_synthesize,
    "cache": cmd_cache,
    "train": cmd_train,
}


def main(argv: list[str] | None = None) -> int:
    parser, subparsers = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, message already printed)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from dstune.library_logs import set_library_verbosity

    set_library_verbosity(args.verbose)
    try:
        return COMMANDS[args.command](args)
    except UsageError as err:
        subparsers[args.command].print_usage(sys.stderr)
        print(f"dstune {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `dstune schema | head`
        return EXIT_OK
    except Exception:  # noqa: BLE001 - anything else is a bug in dstune, and the traceback is what a report needs
        import traceback

        print(
            "dstune: internal error (a bug in dstune, not in your spec). Please report it with this traceback:",
            file=sys.stderr,
        )
        traceback.print_exc()
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
