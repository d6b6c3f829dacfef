"""The `dstune` command line: its subcommands and flags (argparse), kept apart from what the commands do
(dstune/cli.py). Imports are lazy here too: building the parser never loads torch."""

from __future__ import annotations

import argparse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _gpu_memory(text: str) -> int:
    from dstune.memory.plan import parse_size

    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_world_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "world (who trains; DeepSpeed launcher semantics; none given: this machine's GPUs, 1 rank without GPUs)"
    )
    group.add_argument("--world-size", type=_positive_int, metavar="N", help="plan for N ranks in total")
    group.add_argument(
        "--num-gpus",
        "--num_gpus",
        dest="num_gpus",
        type=_positive_int,
        metavar="N",
        help="ranks per node, as `deepspeed --num_gpus N`",
    )
    group.add_argument(
        "--num-nodes",
        "--num_nodes",
        dest="num_nodes",
        type=_positive_int,
        metavar="M",
        help="nodes (with --hostfile: the first M hosts; with --world-size: N split over M nodes)",
    )
    group.add_argument("--hostfile", metavar="FILE", help="DeepSpeed hostfile: lines `HOST slots=N`")
    group.add_argument("--include", metavar="S", help="hosts/slots to use, e.g. 'worker-0:0,1@worker-1'")
    group.add_argument("--exclude", metavar="S", help="hosts/slots to leave out, same syntax as --include")


def _add_spec_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="the spec YAML file")
    _add_world_flags(parser)
    parser.add_argument(
        "--num-samples",
        type=_positive_int,
        metavar="N",
        help="dataset size to plan with when data.path is not on this machine",
    )
    parser.add_argument(
        "--accelerator",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="what the run trains on (decides whether fp16 is possible); auto: this machine's",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec key, e.g. --set train.micro_batch_size=4 (repeatable)",
    )


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="dstune",
        description="Fine-tune diffusion models on DeepSpeed ZeRO from one validated YAML spec.",
        epilog="Training: dstune train SPEC --num-gpus N (in a checkout also: deepspeed --num_gpus N dstune/train.py "
        "SPEC). Exit codes: 0 ok, 1 invalid, 2 usage error; dstune train: 130 after Ctrl-C.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {}
    validate = subparsers["validate"] = commands.add_parser(
        "validate",
        help="check a spec and show what a run on a given world will do",
        description="Check a spec for a world (ranks, nodes) and show the plan: batches, epochs, steps, LR, ZeRO.",
    )
    _add_spec_flags(validate)
    validate.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object {"plan", "ds_config", "warnings", "errors", "memory"} instead',
    )
    validate.add_argument(
        "--gpu-memory",
        type=_gpu_memory,
        metavar="SIZE",
        help="memory of one GPU (24GB, 80GB, "
        "40GiB): whether the run fits; if not, the cheapest changes that make it fit",
    )
    validate.add_argument(
        "--require-fit",
        action="store_true",
        help="exit 1 when the run does not fit in --gpu-memory (default: a plan, exit 0)",
    )
    validate.add_argument(
        "--resume-from",
        metavar="RUN_DIR",
        help="also show what `--resume latest` of that run would do on this world (exit 1 when it would be refused)",
    )
    compile_ = subparsers["compile"] = commands.add_parser(
        "compile",
        help="write the DeepSpeed JSON a run of this spec will use",
        description='Compile the spec into the DeepSpeed JSON for a world (all three batch numbers, no "auto").',
    )
    _add_spec_flags(compile_)
    compile_.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    subparsers["schema"] = commands.add_parser("schema", help="print the spec's JSON schema (for editor completion)")
    init = subparsers["init"] = commands.add_parser(
        "init", help="print a commented example spec that validates and runs as printed"
    )
    from dstune.spec.models import FAMILIES

    init.add_argument(
        "--family",
        choices=FAMILIES,
        default=None,
        help=f"model family: every key, the built-in tiny model and data (default {FAMILIES[0]})",
    )
    init.add_argument(
        "--model",
        metavar="NAME",
        help="a model's spec with its real defaults and only its family's keys; `--model list` lists them",
    )
    init.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    init.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    _add_train_command(commands, subparsers)
    _add_run_folder_commands(commands, subparsers)
    for subparser in subparsers.values():
        add_verbose_flag(subparser)
    return parser, subparsers


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also print the libraries' own notices: DeepSpeed's INFO lines, bitsandbytes' import "
        "notices, torch/diffusers/transformers deprecation warnings (default: only their warnings "
        "and errors)",
    )


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a training run, which `dstune train` passes on to dstune/train.py: both parse them here."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec key, e.g. --set train.micro_batch_size=4 (repeatable)",
    )
    parser.add_argument("--resume", metavar="latest|PATH", help="continue from the newest or a given checkpoint")
    parser.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="with --resume: continue with another global batch (the schedule follows the new one)",
    )
    parser.add_argument(
        "--allow-spec-changes",
        action="store_true",
        help="with --resume: continue although the spec changed in a way that breaks exact "
        "continuation (the changes are listed)",
    )
    parser.add_argument(
        "--cache-only",
        action="store_true",
        help="build the latent / text-embedding cache (data.cache) on all ranks, then exit",
    )


def _add_train_command(commands, subparsers: dict) -> None:
    """`dstune train`: DeepSpeed's launcher on a validated spec (dstune/launcher.py); the flags of dstune/train.py."""
    from dstune.launcher import DEFAULT_GRACE_S

    train = subparsers["train"] = commands.add_parser(
        "train",
        help="validate a spec, then train it on N ranks with DeepSpeed's launcher",
        description="Validate SPEC for the world the flags describe (every error at once; nothing starts on an "
        "error), then run DeepSpeed's launcher on it from any folder. Ctrl-C or SIGINT/SIGTERM to this process stops "
        "every rank at its next step; the last line names the last complete checkpoint and the command that "
        "continues the run. Exit codes: 0 finished, 1 invalid spec or failed check (busy --master-port, output.dir "
        "in use), 2 usage error, 130 stopped by SIGINT (143 SIGTERM, 129 SIGHUP), else the exit code of a failed "
        "rank.",
    )
    train.add_argument("spec", help="the spec YAML file")
    _add_launcher_world_flags(train)
    add_run_flags(train)
    train.add_argument(
        "--grace",
        type=_positive_int,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="after a stop signal, how long the ranks may take to reach their next step before "
        "they are killed (default %(default)s)",
    )
    train.set_defaults(world_size=None, num_samples=None, accelerator="auto")


def _add_launcher_world_flags(train) -> None:
    """`dstune train`'s world: DeepSpeed's own launcher flags, passed on to it."""
    group = train.add_argument_group(
        "world (DeepSpeed launcher flags; none given: this machine's GPUs, 1 rank without GPUs)"
    )
    group.add_argument(
        "--num-gpus", "--num_gpus", dest="num_gpus", type=_positive_int, metavar="N", help="ranks per node"
    )
    group.add_argument(
        "--num-nodes",
        "--num_nodes",
        dest="num_nodes",
        type=_positive_int,
        metavar="M",
        help="with --hostfile: the first M hosts",
    )
    group.add_argument("--hostfile", metavar="FILE", help="DeepSpeed hostfile: lines `HOST slots=N`")
    group.add_argument("--include", metavar="S", help="hosts/slots to use, e.g. 'worker-0:0,1@worker-1'")
    group.add_argument("--exclude", metavar="S", help="hosts/slots to leave out, same syntax as --include")
    group.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=_positive_int,
        metavar="PORT",
        help="where the ranks meet (default: a free port on this machine, printed at start)",
    )
    group.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        metavar="HOST",
        help="multi-node: the address of the first host (default: DeepSpeed asks it over ssh)",
    )
    group.add_argument(
        "--launcher",
        choices=("pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm"),
        help="multi-node: DeepSpeed's backend that starts the other nodes (default pdsh)",
    )


def _add_run_folder_commands(commands, subparsers: dict) -> None:
    """export, synthesize and cache: the commands that work on a run folder, an export or a spec's cache."""
    export = subparsers["export"] = commands.add_parser(
        "export",
        help="consolidate a run's checkpoint into a diffusers folder (safetensors)",
        description="Gather a checkpoint's ZeRO shards (any stage) into full fp32 weights and write a folder that "
        "DiffusionPipeline.from_pretrained loads. Runs on one CPU process; no GPU or launcher needed.",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (output.dir of the spec)")
    export.add_argument("--step", type=_positive_int, metavar="N", help="the checkpoint of step N (default: latest)")
    export.add_argument("--out", metavar="DIR", help="where to write (default: RUN_DIR/export/step-N)")
    export.add_argument(
        "--lora-format",
        choices=("diffusers", "kohya", "comfyui", "peft"),
        metavar="FORMAT",
        help="a LoRA run: write the LoRA file in this key scheme (diffusers, kohya or comfyui; "
        "default: the run's output.lora_format)",
    )
    synthesize = subparsers["synthesize"] = commands.add_parser(
        "synthesize",
        help="speak a text with an exported TTS folder (any speech family's export)",
        description="Write a WAV of TEXT from the export of a speech family's run (the family "
        "whose export the folder is speaks it).",
    )
    synthesize.add_argument("folder", metavar="FOLDER", help="an export folder (RUN_DIR/export/step-N)")
    synthesize.add_argument("text", metavar="TEXT", help="what to say")
    synthesize.add_argument("-o", "--output", metavar="WAV", required=True, help="the WAV file to write")
    synthesize.add_argument("--seconds", type=float, default=4.0, help="longest audio generated (default 4)")
    synthesize.add_argument("--temperature", type=float, default=0.8, help="tts_lm: audio-token temperature, 0 greedy")
    synthesize.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synthesize.add_argument(
        "--speaker",
        metavar="NAME",
        help="a speaker of the training data, by the name its clips gave (the export's speakers.json; default: the "
        "model's default voice)",
    )
    cache = subparsers["cache"] = commands.add_parser(
        "cache",
        help="build (or --verify) the latent / text-embedding cache of a spec, in this one process",
        description="Encode every image and caption the spec trains on into data.cache.dir (entries that are "
        "already complete are kept). Under the launcher: deepspeed --num_gpus N dstune/train.py SPEC --cache-only.",
    )
    cache.add_argument("spec", metavar="SPEC", help="the spec YAML")
    cache.add_argument(
        "--verify",
        action="store_true",
        help="check the existing cache and report, build nothing (exit 1 when incomplete)",
    )
    cache.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec key (repeatable)",
    )
