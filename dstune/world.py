"""Who is training, worked out offline with DeepSpeed launcher semantics.

`dstune validate SPEC --num-gpus 8` must plan for exactly the ranks `deepspeed --num_gpus 8 ...` would start,
so this module calls DeepSpeed's own launcher helpers (deepspeed.launcher.runner: fetch_hostfile,
parse_inclusion_exclusion, apply_num_nodes_and_gpus) and combines them the way runner.main() does.
Two deliberate differences, because validate plans a run that may happen elsewhere:
  - without a hostfile, --num-gpus N means N ranks here even on a machine without GPUs (DeepSpeed would stop);
  - DeepSpeed's default hostfile /job/hostfile is not read: only a hostfile the user names counts.
torch and deepspeed are imported inside functions so that importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, replace

from dstune.library_logs import library_logs_verbose

_LINE_FORMAT = "each line must be 'HOST slots=N' (e.g. 'worker-0 slots=8'); '#' starts a comment"
_FILTER_FORMAT = "HOST[:SLOT[,SLOT...]][@HOST[:SLOT[,SLOT...]]...], e.g. 'worker-0:0,1@worker-1'"


class WorldError(ValueError):
    """A world that cannot be launched: the message says what, where and how to fix it."""


@dataclass(frozen=True)
class World:
    world_size: int  # total ranks = data-parallel size (dstune has no tensor/pipeline parallel)
    num_nodes: int
    ranks_per_node: tuple[int, ...]  # one entry per node, in launch order
    hosts: tuple[str, ...]  # same order as ranks_per_node
    source: str  # one human line saying where this came from
    assumed: bool = False  # True when the rank count was guessed from this machine, not given

    def __post_init__(self) -> None:
        if not (len(self.hosts) == len(self.ranks_per_node) == self.num_nodes >= 1):
            raise WorldError(
                f"{self.source}: {self.num_nodes} nodes, but hosts {self.hosts} and ranks {self.ranks_per_node}"
            )
        if sum(self.ranks_per_node) != self.world_size or min(self.ranks_per_node) < 1:
            raise WorldError(f"{self.source}: ranks per node {self.ranks_per_node} do not add up to {self.world_size}")


def use_cpu_accelerator_if_no_cuda() -> None:
    """Pick DeepSpeed's CPU accelerator up front when there is no CUDA, so importing deepspeed does not warn."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def world_from_resources(resources: dict[str, int], source: str) -> World:
    """Ordered {host: slots} (launch order) -> World."""
    if not resources:
        raise WorldError(f"{source}: no hosts left to train on")
    for host, slots in resources.items():
        if slots < 1:
            raise WorldError(f"{source}: host {host} has {slots} slots; every host needs at least 1")
    counts = tuple(resources.values())
    return World(sum(counts), len(counts), counts, tuple(resources), source)


def world_from_flags(
    *,
    world_size: int | None = None,
    num_gpus: int | None = None,
    num_nodes: int | None = None,
    hostfile: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
) -> World:
    """The world a `deepspeed` launch with these flags would start (see the module docstring)."""
    for flag, value in (("--world-size", world_size), ("--num-gpus", num_gpus), ("--num-nodes", num_nodes)):
        if value is not None and value < 1:
            raise WorldError(f"{flag} {value}: must be at least 1 (it counts ranks or nodes)")
    include, exclude = include or "", exclude or ""  # DeepSpeed's own default is "", meaning no filter
    if world_size is not None:
        return _world_of_size(world_size, num_nodes, num_gpus, hostfile, include, exclude)
    counted = _flags(num_gpus=num_gpus, num_nodes=num_nodes)
    if counted and (include or exclude):
        raise WorldError(
            f"{counted} cannot be combined with {_flags(include=include, exclude=exclude)} "
            "(DeepSpeed: 'Cannot specify num_nodes/gpus with include/exclude'). Pick hosts and slots "
            "with --include/--exclude, or take the first N with --num-nodes/--num-gpus, not both."
        )
    if include and exclude:
        raise WorldError(
            "--include and --exclude cannot be used together (DeepSpeed: 'include_str and exclude_str "
            "are mutually exclusive.'). Keep one of them."
        )
    if hostfile is not None:
        return _world_from_hostfile(hostfile, include, exclude, num_nodes, num_gpus)
    if num_nodes is not None and num_nodes > 1:
        raise WorldError(
            f"--num-nodes {num_nodes} needs a hostfile: without --hostfile DeepSpeed launches on this "
            "machine only ('Num nodes is >1 but no extra nodes available via hostfile'). Pass --hostfile "
            f"listing the nodes, or plan offline with --world-size N --num-nodes {num_nodes}."
        )
    if num_gpus is not None:  # apply_num_nodes_and_gpus replaces the local slot count with range(num_gpus)
        return world_from_resources({"localhost": num_gpus}, f"{counted} (this machine; no --hostfile)")
    local = _local_gpu_count()
    if include or exclude:
        if local == 0:
            raise WorldError(
                f"{_flags(include=include, exclude=exclude)} without --hostfile selects GPUs on this "
                "machine, and it has none. Pass --hostfile, or --num-gpus N to plan for N GPUs."
            )
        pool = {"localhost": local}
        source = f"this machine ({local} CUDA GPUs; {_flags(include=include, exclude=exclude)})"
        active = _filter(pool, include, exclude, "this machine")
        return world_from_resources({host: len(slots) for host, slots in active.items()}, source)
    prefix = f"{counted} on " if counted else ""
    if local == 0:
        world = world_from_resources({"localhost": 1}, f"{prefix}this machine: no GPU, assuming 1 rank")
    else:
        world = world_from_resources({"localhost": local}, f"{prefix}this machine: {local} CUDA GPUs")
    return replace(world, assumed=True)


def _world_of_size(
    world_size: int, num_nodes: int | None, num_gpus: int | None, hostfile: str | None, include: str, exclude: str
) -> World:
    others = _flags(num_gpus=num_gpus, hostfile=hostfile, include=include, exclude=exclude)
    if others:
        raise WorldError(
            f"--world-size gives the rank count directly, so it cannot be combined with {others}. "
            "Use --world-size N [--num-nodes M] to plan offline, or the DeepSpeed-style flags, not both."
        )
    if num_nodes is None or num_nodes == 1:
        return world_from_resources({"localhost": world_size}, _flags(world_size=world_size, num_nodes=num_nodes))
    if world_size % num_nodes:
        raise WorldError(
            f"--world-size {world_size} does not split evenly over --num-nodes {num_nodes}, and "
            "these flags plan the same number of ranks on every node. Use a multiple of "
            f"{num_nodes}, or describe uneven nodes in a --hostfile."
        )
    per_node = world_size // num_nodes
    resources = {f"node-{i}": per_node for i in range(num_nodes)}
    return world_from_resources(resources, _flags(world_size=world_size, num_nodes=num_nodes))


def _world_from_hostfile(path: str, include: str, exclude: str, num_nodes: int | None, num_gpus: int | None) -> World:
    runner = _runner()
    pool = _read_hostfile(runner, path)
    notes = [_flags(include=include, exclude=exclude, num_nodes=num_nodes, num_gpus=num_gpus)]
    active = _filter(pool, include, exclude, f"hostfile {path}")
    # Same call and the same "not given" value (-1) as runner.main().
    active = runner.apply_num_nodes_and_gpus(active, num_nodes or -1, num_gpus or -1)
    # DeepSpeed silently does both of these; say so, since the plan depends on it.
    if num_nodes is not None and num_nodes > len(pool):
        notes.append(f"only {len(pool)} hosts listed, DeepSpeed uses them all")
    over = [host for host in active if num_gpus is not None and num_gpus > pool[host]]
    if over:
        notes.append(
            f"--num-gpus {num_gpus} exceeds the slots of {', '.join(over)}; DeepSpeed starts "
            f"{num_gpus} ranks there anyway"
        )
    detail = "".join(f"; {note}" for note in notes if note)
    source = f"hostfile {path} ({len(pool)} nodes, {sum(pool.values())} slots{detail})"
    if not active:
        raise WorldError(f"{source}: no slots are left to train on. Exclude fewer hosts or slots.")
    return world_from_resources({host: len(slots) for host, slots in active.items()}, source)


def _read_hostfile(runner, path: str) -> dict[str, int]:
    try:
        with _quiet_deepspeed():
            pool = runner.fetch_hostfile(path)
    except UnicodeDecodeError:
        raise WorldError(f"hostfile {path} is not a text file; {_LINE_FORMAT}.") from None
    except OSError as err:
        raise WorldError(f"hostfile {path} cannot be read ({err.strerror}). Check the path and permissions.") from None
    except ValueError as err:  # DeepSpeed names the bad text but not the line: find it with DeepSpeed's parser
        raise WorldError(_blame_hostfile_line(runner, path, err)) from None
    if pool is None:  # DeepSpeed warns and falls back to this machine; a named hostfile that is missing is an error
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise WorldError(
            f"hostfile {path} {what} (DeepSpeed would fall back to this machine only). Pass the path "
            "of a file with lines like 'worker-0 slots=8', or drop --hostfile to use this machine."
        )
    for number, text, hosts in _parsed_lines(runner, path):
        for host, slots in hosts.items():
            if slots < 1:  # DeepSpeed accepts slots=0 and would start no rank there
                raise WorldError(
                    f"{path}:{number}: {text!r}: slots={slots} gives {host} no ranks. "
                    "Give it slots=1 or more, or delete the line."
                )
    return dict(pool)


def _blame_hostfile_line(runner, path: str, err: ValueError) -> str:
    first_seen: dict[str, int] = {}
    for number, text, hosts in _parsed_lines(runner, path):
        if hosts is None:
            return f"{path}:{number}: {text!r} is not a hostfile line: {_LINE_FORMAT}."
        for host in hosts:
            if host in first_seen:
                return (
                    f"{path}:{number}: {text!r} lists host {host} again (first on line {first_seen[host]}). "
                    "List each host once, with all its slots."
                )
            first_seen[host] = number
    if not first_seen:
        return f"hostfile {path} lists no hosts (only blank lines or comments); {_LINE_FORMAT}."
    return f"hostfile {path}: {err}."


def _parsed_lines(runner, path: str):
    """Yield (line number, text, {host: slots} or None when DeepSpeed rejects the line) for every host line.

    Each line goes through DeepSpeed's own parser next to a probe line, so blank lines and comments parse to
    the probe alone and "bad" means exactly what DeepSpeed calls bad.
    """
    probe = "\x00dstune-probe"
    with open(path) as fd:
        lines = fd.readlines()
    for number, line in enumerate(lines, start=1):
        try:
            with _quiet_deepspeed():
                hosts = dict(runner._parse_hostfile([line, f"{probe} slots=1"]))
        except ValueError:
            yield number, line.strip(), None
            continue
        hosts.pop(probe)
        if hosts:
            yield number, line.strip(), hosts


def _filter(pool: dict[str, int], include: str, exclude: str, where: str) -> dict[str, list[int]]:
    """runner.parse_inclusion_exclusion, with its errors turned into WorldError naming the flag and the hosts."""
    runner = _runner()
    try:
        with _quiet_deepspeed():
            return runner.parse_inclusion_exclusion(pool, include, exclude)
    except (ValueError, KeyError, IndexError) as err:
        flag = _flags(include=include, exclude=exclude)
        # int() and tuple unpacking inside DeepSpeed's parser fail with messages that do not name the flag
        known = ("not found", "No slot", "exited")
        reason = str(err) if any(word in str(err) for word in known) else f"not of the form {_FILTER_FORMAT}"
        available = ", ".join(f"{host} (slots 0-{slots - 1})" for host, slots in pool.items())
        raise WorldError(f"{flag} on {where}: {reason}. Available: {available}.") from None


def _flags(**values) -> str:
    """Flags as the user typed them: _flags(num_gpus=8, num_nodes=2) -> '--num-gpus 8 --num-nodes 2'."""
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in values.items() if value not in (None, ""))


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _runner():
    use_cpu_accelerator_if_no_cuda()
    try:
        from deepspeed.launcher import runner
    except (Exception, SystemExit) as err:  # noqa: BLE001 - e.g. a bad DS_ACCELERATOR value: a user error, no traceback
        raise WorldError(
            f"cannot load DeepSpeed's launcher ({err}); check the DeepSpeed install and DS_ACCELERATOR."
        ) from None
    return runner


@contextlib.contextmanager
def _quiet_deepspeed():
    """DeepSpeed logs at INFO/WARNING/ERROR while parsing; dstune reports the outcome itself.

    Its launcher code may also sys.exit(); a SystemExit must never leave `dstune validate`.
    """
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logger.level if library_logs_verbose() else logging.CRITICAL + 1)
    try:
        yield
    except SystemExit as exit_:  # a ValueError, so each caller adds which file or flag it was reading
        raise ValueError(f"DeepSpeed's launcher exited with code {exit_.code}") from None
    finally:
        logger.setLevel(level)
