"""Distributed set-up in one place: the only reader of RANK / LOCAL_RANK / WORLD_SIZE / CROSS_RANK (the node).

`init_run` brings the process group up (gloo on CPU, nccl on CUDA) with an explicit timeout, learns which host each
rank is on, and returns a frozen `Run` that every later stage receives. The helpers below make "all ranks agree"
decisions: a rank never leaves a collective early, so a failure on one rank stops all of them instead of hanging.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, replace
from typing import Callable, TypeVar
from datetime import timedelta

from dstune.runlock import release_held as release_run_lock
from dstune.world import World

T = TypeVar("T")


@dataclass(frozen=True)
class Run:
    rank: int
    local_rank: int
    world: World
    device: str  # "cpu" or "cuda:N"
    accelerator: str  # "cpu" or "cuda"
    node_rank: int
    launched: bool  # False for `python dstune/train.py spec.yaml` (a single process without the launcher)
    # deepspeed.sequence_parallel_size (set once the spec is validated, with_sequence_groups): the N consecutive
    # ranks dp * N .. dp * N + N - 1 share each sample, each holding 1/N of its tokens
    sequence_parallel_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel_rank(self) -> int:
        """Which sequence group this rank is in: what the loader, the held-out share and the batch check key on."""
        return self.rank // self.sequence_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world.world_size // self.sequence_parallel_size

    @property
    def world_size(self) -> int:
        return self.world.world_size


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# `deepspeed --launcher openmpi` runs mpirun, which names ranks only in OMPI_COMM_WORLD_*; DeepSpeed's
# init_distributed then discovers the rest (MASTER_ADDR, via mpi4py) when RANK & co. are incomplete.
_MPI_NAMES = {
    "RANK": "OMPI_COMM_WORLD_RANK",
    "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
    "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
    "LOCAL_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE",
}


def _adopt_mpi_ranks() -> None:
    if "RANK" not in os.environ and _MPI_NAMES["RANK"] in os.environ:
        for ours, mpi in _MPI_NAMES.items():
            if mpi in os.environ:
                os.environ.setdefault(ours, os.environ[mpi])


def launcher_rank() -> int:
    """This process's rank as the launcher set it, before the process group exists (0 without a launcher)."""
    _adopt_mpi_ranks()
    return int(os.environ.get("RANK", "0"))


def launcher_world_size() -> int:
    """The number of ranks the launcher started, before the process group exists (1 without a launcher)."""
    _adopt_mpi_ranks()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_run(timeout_minutes: int) -> Run:
    """Start the process group and describe this rank. Must run before deepspeed.initialize: DeepSpeed sizes its
    batch config from the process group and silently assumes one rank when it is not up yet."""
    import torch
    import torch.distributed as dist
    import deepspeed

    _adopt_mpi_ranks()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not launched:  # plain `python dstune/train.py`: a world of one, on a port nobody else uses
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    else:
        device = "cpu"
        # Ranks share the cores: without this, each rank starts one thread per core and they thrash.
        local_size = int(os.environ.get("LOCAL_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_size)))
    if not dist.is_initialized():
        try:
            deepspeed.init_distributed(timeout=timedelta(minutes=timeout_minutes), verbose=False)
        except RuntimeError as err:  # torch's DistNetworkError is one
            if "EADDRINUSE" not in str(err) and "address already in use" not in str(err).lower():
                raise
            if rank == 0:  # the rank that listens on the master port; the others only connect to it
                print(
                    busy_port_text(os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")),
                    file=sys.stderr,
                    flush=True,
                )
            exit_rank(1)
    nodes = all_gather_object(_node_identity())  # also a barrier: every rank is past init_distributed
    if accelerator == "cpu":
        release_shm_allreduce_name(rank)
    order: list[tuple] = []
    for node in nodes:  # launch order: ranks are numbered node by node
        if node not in order:
            order.append(node)
    world = World(
        world_size=world_size,
        num_nodes=len(order),
        ranks_per_node=tuple(nodes.count(n) for n in order),
        hosts=_node_labels(order),
        source="launcher" if launched else "single process (no launcher)",
    )
    return Run(
        rank=rank,
        local_rank=local_rank,
        world=world,
        device=device,
        accelerator=accelerator,
        node_rank=order.index(nodes[rank]),
        launched=launched,
    )


def with_sequence_groups(run: Run, sequence_parallel_size: int) -> Run:
    """Collective at N > 1: DeepSpeed's sequence-parallel process groups (deepspeed.runtime.sequence_parallel.
    parallel_state_sp: groups of N consecutive ranks, and all ranks as the group ZeRO partitions and reduces over),
    which dstune.engine hands DeepSpeed as its mpu. Made once per process. Returns the run that knows its
    data-parallel rank."""
    if sequence_parallel_size == 1:
        return run
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if _sequence_groups_made.get("size") is None:
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        _sequence_groups_made["size"] = sequence_parallel_size
    elif _sequence_groups_made["size"] != sequence_parallel_size:
        raise RuntimeError(
            f"this process already has sequence-parallel groups of {_sequence_groups_made['size']} "
            f"ranks, not {sequence_parallel_size}"
        )
    return replace(run, sequence_parallel_size=sequence_parallel_size)


_sequence_groups_made: dict = {}  # {"size": N} once with_sequence_groups made DeepSpeed's groups in this process


def busy_port_text(address: str, port) -> str:
    return (
        f"master port {port} on {address} is already in use (another run on this machine, or another program): "
        "the ranks cannot meet there. Pick a free port: `dstune train ... --master-port N`, or leave "
        "--master-port out and dstune train picks a free one; with the deepspeed command, "
        "`deepspeed --master_port N ...`."
    )


def release_shm_allreduce_name(rank: int) -> None:
    """On the CPU accelerator DeepSpeed's shm all-reduce gives each rank a ~69 MB POSIX shared-memory segment,
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>, maps every peer's during init_distributed and
    never unlinks them: each run, and each killed run, would leave 69 MB per rank in RAM until reboot. Once every
    rank is past init (the caller's collective), all mappings exist, so the name can go; the memory lives on while
    the ranks run and is freed by the kernel when the last one exits, however it exits. Call it only after a
    collective that every rank entered after init_distributed: a peer still in init would wait for the name forever."""
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    )
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:  # no shm op built, ranks on several nodes (no segment), or not Linux
        pass


def _node_identity() -> tuple:
    """(node rank, hostname). DeepSpeed's per-node launcher (deepspeed.launcher.launch, started on each node by pdsh,
    openmpi or slurm) sets CROSS_RANK to its --node_rank; two nodes may share a hostname (containers, a test
    on one machine), so the node rank decides, and the hostname only when no launcher said (torchrun, mpirun)."""
    cross_rank = os.environ.get("CROSS_RANK")
    return (int(cross_rank) if cross_rank is not None else -1, socket.gethostname())


def _node_labels(order: list[tuple]) -> tuple[str, ...]:
    hostnames = [host for _, host in order]
    if len(set(hostnames)) == len(hostnames):
        return tuple(hostnames)
    return tuple(f"{host}#node{node_rank}" for node_rank, host in order)


def all_gather_object(value) -> list:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def agree_or_stop(run: Run, error: str | None) -> None:
    """Collective: stop every rank if any rank has an error. Rank 0 prints the message once when every rank
    failed the same way, else each failing rank's message under its rank number."""
    errors = all_gather_object(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        same = len({e for _, e in failed}) == 1 and len(failed) == run.world_size
        text = failed[0][1] if same else "\n".join(f"rank {rank}: {e}" for rank, e in failed)
        stop(run, text, 1)


def rank0_first(run: Run, work: Callable[[], T], catch: tuple = (ValueError, OSError)) -> tuple[T | None, str | None]:
    """Run `work` on rank 0, then on the others (what rank 0 makes once, such as a built-in model in a shared
    cache, the others then load). Collective. Returns (result, None) or (None, the error's text) for `catch`."""
    result, error = None, None
    for turn in (True, False):
        if run.is_main == turn:
            try:
                result = work()
            except catch as err:
                error = str(err)
        barrier()
    return result, error


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - tearing down after a failure must not raise a second error
            pass


def stop(run: Run | None, message: str, code: int = 1) -> "NoReturn":  # noqa: F821
    """Print (rank 0 only, or every rank when the message is rank-specific) and exit on every rank with `code`.

    Callers reach this on all ranks together (after an agreement step), so no rank is left waiting in a collective.
    """
    if run is None or run.is_main:
        print(message, file=sys.stderr, flush=True)
    shutdown()
    exit_rank(code)


def exit_rank(code: int) -> "NoReturn":  # noqa: F821
    """End this process with `code`. A launched rank skips the interpreter's final clean-up, where torch/gloo
    threads being torn down sometimes abort a finished rank ("terminate called without an active exception", seen
    on the CPU under load), which the launcher would report instead of `code`. Everything is written and flushed
    (checkpoints and exports are complete before their callers return; metrics are flushed per line)."""
    release_run_lock()  # before os._exit, which skips every `finally`
    sys.stdout.flush()
    sys.stderr.flush()
    if "RANK" in os.environ:
        os._exit(code)
    sys.exit(code)


def device_memory_bytes(run: Run):
    """This rank's GPU memory, which the memory plan chooses the cache's chunk for (dstune.memory.verdict
    .choose_encoding); None on the CPU accelerator (no budget: the most entries per encoder pass)."""
    import torch

    if run.accelerator != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
