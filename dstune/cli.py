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
import signal
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
            if outcome.memory.get("fits") is False:  # the cheapest settings that fit, each re-planned
                from dstune.memory_advice import advise

                advice = advise(
                    args.spec, args.overrides, outcome.world, args.num_samples, args.accelerator, args.gpu_memory
                )
                outcome = dataclasses.replace(outcome, memory={**outcome.memory, **advice})
    resume = None  # --resume-from: (text, ok), shown before the verdict, which it decides too
    if args.resume_from and outcome.plan and not outcome.errors:
        text, ok = _resume_preview(outcome, Path(args.resume_from), "latest")
        resume = (text if ok or text.startswith("resume from") else f"--resume-from {args.resume_from}: {text}", ok)
    if args.json:
        print(json.dumps(outcome.as_json(), indent=2))
        if resume is not None:
            print(resume[0], file=sys.stderr)
    else:
        print_report(outcome, report_console(), title=f"dstune validate {args.spec}", resume=resume)
    resumable = resume is None or resume[1]
    unfit = args.require_fit and outcome.memory is not None and outcome.memory.get("fits") is not True
    return EXIT_INVALID if outcome.errors or not resumable or unfit else EXIT_OK


def _resume_preview(outcome, run_dir: Path, resume: str, allow_batch: bool = False, allow_spec: bool = False):
    """(text, ok): the resume of `run_dir`'s checkpoint (`resume`: latest or a folder) on the validated world,
    offline (reads only JSON files); the text of a refusal says what to change."""
    from dstune.checkpoints.layout import CheckpointError, read_state, resolve_resume
    from dstune.checkpoints.resume_plan import reshard_refusal, resume_preview

    try:
        root, tag = resolve_resume(run_dir, resume)
        saved = read_state(root, tag)
        reshard = reshard_refusal(
            root / tag, saved["spec"]["train"]["optimizer"]["type"], saved["world_size"], outcome.plan.world_size
        )
        return resume_preview(
            outcome.spec.model_dump(mode="json"),
            outcome.spec.train,
            outcome.plan,
            saved,
            outcome.source,
            f"checkpoint {root / tag}",
            reshard,
            allow_batch,
            allow_spec,
        )
    except (CheckpointError, OSError, ValueError) as err:
        return str(err), False
    except KeyError as err:
        return f"checkpoint {run_dir}: its dstune_state.json has no {err} (not written by this dstune?)", False


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
        config, ranks = outcome.ds_config, outcome.plan.world_size
        print(
            f"wrote {args.output}: the DeepSpeed JSON of {args.spec} for {ranks} rank{'s' if ranks != 1 else ''} "
            f"(train_batch_size {config.get('train_batch_size')}, ZeRO stage "
            f"{config.get('zero_optimization', {}).get('stage', 0)})"
        )
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
    shown = Path(args.output).name if args.output else "spec.yaml"
    text = model_spec(args.model, shown) if args.model is not None else example_spec(args.family or "sd")
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


STOPS_BEFORE_LAUNCH: list[int] = []  # the SIGINTs dstune train received before it launched


def _note_stop_before_launch(signum, frame) -> None:
    """dstune train's SIGINT handler until the launch: noted (a library that catches every exception while it is
    imported, as some do around optional imports, cannot make the stop disappear) and raised as usual."""
    STOPS_BEFORE_LAUNCH.append(signum)
    raise KeyboardInterrupt


def _exit_now_if_the_interpreter_saw_the_stop(code: int) -> None:
    """Exit with `code` now when the SIGINT reached Python code that a library ran through the C API while it was
    imported: CPython then remembers an unhandled KeyboardInterrupt, and under `python -m dstune` it ends the process
    with SIGINT after our return (exit -2, not 130). Nothing was started before the launch, so nothing is skipped."""
    if STOPS_BEFORE_LAUNCH:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def cmd_train(args) -> int:
    """Validate for the flags' world (nothing starts on an error), refuse an output.dir in use and a resume that
    cannot go on, then launch. A stop signal before the launch ends here with one line."""
    try:
        checked = _checked_for_launch(args)
        if STOPS_BEFORE_LAUNCH:  # received, but swallowed on its way up
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        print("dstune train: interrupted (SIGINT) before the launch; nothing was started", file=sys.stderr)
        _exit_now_if_the_interpreter_saw_the_stop(130)
        return 130
    if isinstance(checked, int):
        return checked
    from dstune.launcher import launch

    return launch(args, *checked)


def _checked_for_launch(args):
    """(run folder, world) to launch, or the exit code of a refusal (printed)."""
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
    if args.resume and not args.cache_only:  # the ranks check the same; refused here, nothing starts
        text, ok = _resume_preview(outcome, run_dir, args.resume, args.allow_batch_change, args.allow_spec_changes)
        if not ok:
            print(f"dstune train: not launched: {text}", file=sys.stderr)
            return EXIT_INVALID
        print(text, flush=True)
    return run_dir, outcome.world


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
    if args.command == "train":  # before the libraries load: one of them may swallow the KeyboardInterrupt
        signal.signal(signal.SIGINT, _note_stop_before_launch)
    from dstune.library_logs import set_library_verbosity

    set_library_verbosity(args.verbose)
    try:
        return COMMANDS[args.command](args)
    except UsageError as err:
        subparsers[args.command].print_usage(sys.stderr)
        print(f"dstune {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"dstune {args.command}: interrupted", file=sys.stderr)
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
