"""dstune.world: offline worlds with DeepSpeed launcher semantics, checked against DeepSpeed's own runner."""

from __future__ import annotations

import logging
import subprocess
import sys
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstune import world as world_mod
from dstune.world import World, WorldError, use_cpu_accelerator_if_no_cuda, world_from_flags, world_from_resources

CLUSTER = """\
# two big nodes and a small one

worker-0 slots=4
worker-1\tslots=4   # tab-separated, trailing comment
   # indented comment
small slots=2
"""


@pytest.fixture(autouse=True)
def no_local_gpus(monkeypatch):
    """Every test sees a machine without CUDA, whatever this one has, unless it says otherwise."""
    monkeypatch.setattr(world_mod, "_local_gpu_count", lambda: 0)


def write(tmp_path, text: str, name: str = "hostfile") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def layout(world: World) -> list[tuple[str, int]]:
    return list(zip(world.hosts, world.ranks_per_node))


# ---------------------------------------------------------------- single machine


def test_nothing_given_without_gpu_assumes_one_rank():
    world = world_from_flags()
    assert (world.world_size, world.hosts, world.assumed) == (1, ("localhost",), True)
    assert "no GPU, assuming 1 rank" in world.source


def test_nothing_given_counts_local_gpus(monkeypatch):
    monkeypatch.setattr(world_mod, "_local_gpu_count", lambda: 4)
    world = world_from_flags()
    assert (world.world_size, world.ranks_per_node, world.assumed) == (4, (4,), True)
    assert "4 CUDA GPUs" in world.source


def test_num_gpus_alone_is_this_machine_even_without_gpus():
    world = world_from_flags(num_gpus=8)
    assert layout(world) == [("localhost", 8)]
    assert not world.assumed and world.source.startswith("--num-gpus 8")


def test_num_gpus_with_one_node():
    assert layout(world_from_flags(num_gpus=2, num_nodes=1)) == [("localhost", 2)]


def test_num_nodes_one_alone_uses_this_machine(monkeypatch):
    monkeypatch.setattr(world_mod, "_local_gpu_count", lambda: 2)
    world = world_from_flags(num_nodes=1)
    assert layout(world) == [("localhost", 2)] and world.assumed


def test_world_size_alone_is_one_node():
    world = world_from_flags(world_size=6)
    assert (layout(world), world.source, world.assumed) == ([("localhost", 6)], "--world-size 6", False)


def test_world_size_split_over_nodes():
    world = world_from_flags(world_size=16, num_nodes=2)
    assert (world.num_nodes, world.ranks_per_node, world.source) == (2, (8, 8), "--world-size 16 --num-nodes 2")


def test_include_without_hostfile_filters_local_gpus(monkeypatch):
    monkeypatch.setattr(world_mod, "_local_gpu_count", lambda: 4)
    assert layout(world_from_flags(include="localhost:1,3")) == [("localhost", 2)]
    assert layout(world_from_flags(exclude="localhost:0")) == [("localhost", 3)]


def test_world_from_resources_keeps_order():
    world = world_from_resources({"b": 2, "a": 3}, "test")
    assert (world.world_size, world.num_nodes, world.hosts, world.ranks_per_node) == (5, 2, ("b", "a"), (2, 3))


# ---------------------------------------------------------------- hostfiles and filters


def test_hostfile_with_comments_blank_lines_and_uneven_slots(tmp_path):
    path = write(tmp_path, CLUSTER)
    world = world_from_flags(hostfile=path)
    assert layout(world) == [("worker-0", 4), ("worker-1", 4), ("small", 2)]
    assert world.world_size == 10 and world.source == f"hostfile {path} (3 nodes, 10 slots)"


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"include": "worker-0"}, [("worker-0", 4)]),
        ({"include": "worker-0:0,2@worker-1"}, [("worker-0", 2), ("worker-1", 4)]),
        ({"include": "small@worker-0:3"}, [("worker-0", 1), ("small", 2)]),  # hostfile order, not filter order
        ({"exclude": "worker-1"}, [("worker-0", 4), ("small", 2)]),
        ({"exclude": "worker-0:0,1@small:1"}, [("worker-0", 2), ("worker-1", 4), ("small", 1)]),
        ({"exclude": "small:0,1"}, [("worker-0", 4), ("worker-1", 4)]),  # excluding every slot drops the host
        ({"num_nodes": 2}, [("worker-0", 4), ("worker-1", 4)]),
        ({"num_gpus": 1}, [("worker-0", 1), ("worker-1", 1), ("small", 1)]),
        ({"num_nodes": 2, "num_gpus": 3}, [("worker-0", 3), ("worker-1", 3)]),
    ],
)
def test_hostfile_filters(tmp_path, flags, expected):
    world = world_from_flags(hostfile=write(tmp_path, CLUSTER), **flags)
    assert layout(world) == expected
    assert world.world_size == sum(n for _, n in expected)
    value = next(iter(flags.values()))
    assert str(value) in world.source


def test_num_nodes_beyond_hostfile_uses_all_hosts_and_says_so(tmp_path):
    world = world_from_flags(hostfile=write(tmp_path, CLUSTER), num_nodes=5)
    assert world.num_nodes == 3 and "only 3 hosts listed" in world.source


def test_num_gpus_beyond_slots_follows_deepspeed_and_says_so(tmp_path):
    # DeepSpeed's apply_num_nodes_and_gpus sets range(num_gpus) on every host; it does not cap at slots.
    world = world_from_flags(hostfile=write(tmp_path, CLUSTER), num_gpus=3)
    assert world.ranks_per_node == (3, 3, 3)
    assert "exceeds the slots of small" in world.source


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("worker-0 slots=4\nworker-1 slot=4\n", 2, "'worker-1 slot=4' is not a hostfile line"),
        ("# header\nworker-0\n", 2, "'worker-0' is not a hostfile line"),
        ("worker-0 slots=four\n", 1, "is not a hostfile line"),
        ("worker-0 slots=4\n\nworker-0 slots=2\n", 3, "lists host worker-0 again (first on line 1)"),
        ("worker-0 slots=4\nworker-1 slots=0\n", 2, "slots=0 gives worker-1 no ranks"),
    ],
)
def test_bad_hostfile_lines_name_file_and_line(tmp_path, text, line, words):
    path = write(tmp_path, text)
    with pytest.raises(WorldError) as err:
        world_from_flags(hostfile=path)
    assert f"{path}:{line}:" in str(err.value) and words in str(err.value)


def test_hostfile_with_only_comments(tmp_path):
    path = write(tmp_path, "# nothing here\n\n")
    with pytest.raises(WorldError, match="lists no hosts") as err:
        world_from_flags(hostfile=path)
    assert path in str(err.value) and "slots=N" in str(err.value)


def test_missing_hostfile_is_an_error_not_this_machine(tmp_path):
    path = str(tmp_path / "nope")
    with pytest.raises(WorldError, match="does not exist") as err:
        world_from_flags(hostfile=path)
    assert path in str(err.value)
    with pytest.raises(WorldError, match="is a directory"):
        world_from_flags(hostfile=str(tmp_path))


def test_binary_hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(WorldError, match="not a text file"):
        world_from_flags(hostfile=str(path))


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"include": "worker-7"}, "Hostname 'worker-7' not found"),
        ({"include": "worker-0:4"}, "No slot '4' specified on host 'worker-0'"),
        ({"exclude": "ghost:0"}, "--exclude ghost:0"),
        ({"include": "worker-0:a"}, "not of the form HOST[:SLOT"),
        ({"include": "worker-0:0:1"}, "not of the form"),
        ({"include": "worker-0:"}, "not of the form"),
        ({"exclude": "worker-0@worker-1@small"}, "no slots are left"),
        ({"include": "worker-0", "exclude": "small"}, "cannot be used together"),
        ({"include": "worker-0", "num_gpus": 2}, "--num-gpus 2 cannot be combined with --include worker-0"),
        ({"exclude": "small", "num_nodes": 1}, "--num-nodes 1 cannot be combined with --exclude small"),
    ],
)
def test_bad_filters(tmp_path, flags, words):
    path = write(tmp_path, CLUSTER)
    with pytest.raises(WorldError) as err:
        world_from_flags(hostfile=path, **flags)
    assert words in str(err.value)


def test_unknown_host_lists_what_is_available(tmp_path):
    with pytest.raises(WorldError) as err:
        world_from_flags(hostfile=write(tmp_path, CLUSTER), include="worker-9")
    assert "--include worker-9" in str(err.value) and "small (slots 0-1)" in str(err.value)


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"num_gpus": 0}, "--num-gpus 0"),
        ({"num_nodes": -1}, "--num-nodes -1"),
        ({"world_size": 0}, "--world-size 0"),
        ({"num_nodes": 2}, "needs a hostfile"),
        ({"num_gpus": 8, "num_nodes": 2}, "Num nodes is >1 but no extra nodes available via hostfile"),
        ({"world_size": 10, "num_nodes": 3}, "does not split evenly"),
        ({"world_size": 8, "num_gpus": 8}, "cannot be combined with --num-gpus 8"),
        ({"world_size": 8, "hostfile": "hosts"}, "cannot be combined with --hostfile hosts"),
        ({"include": "localhost:0"}, "has none"),
    ],
)
def test_bad_flags(flags, words):
    with pytest.raises(WorldError) as err:
        world_from_flags(**flags)
    assert words in str(err.value)


def test_world_error_is_a_value_error():
    assert issubclass(WorldError, ValueError)
    with pytest.raises(WorldError, match="no hosts"):
        world_from_resources({}, "empty")
    with pytest.raises(WorldError, match="at least 1"):
        world_from_resources({"a": 0}, "zero")


def test_system_exit_inside_deepspeed_becomes_world_error(tmp_path):
    with mock.patch("deepspeed.launcher.runner.parse_inclusion_exclusion", side_effect=SystemExit(2)):
        with pytest.raises(WorldError, match="exited"):
            world_from_flags(hostfile=write(tmp_path, CLUSTER), include="worker-0")


def test_system_exit_while_reading_hostfile_names_the_file(tmp_path):
    path = write(tmp_path, CLUSTER)
    with mock.patch("deepspeed.launcher.runner.fetch_hostfile", side_effect=SystemExit(1)):
        with pytest.raises(WorldError, match="exited with code 1") as err:
            world_from_flags(hostfile=path)
    assert path in str(err.value)


def test_deepspeed_logs_nothing_while_parsing(tmp_path, capfd):
    with pytest.raises(WorldError):
        world_from_flags(hostfile=write(tmp_path, "worker-0 slots=1\nworker-0 slots=1\n"))
    with pytest.raises(WorldError):
        world_from_flags(hostfile=str(tmp_path / "missing"))
    world_from_flags(hostfile=write(tmp_path, CLUSTER, "ok"), exclude="worker-0:1")
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


# ---------------------------------------------------------------- environment and imports


def test_cpu_accelerator_set_only_when_unset_and_no_cuda(monkeypatch):
    import torch

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    use_cpu_accelerator_if_no_cuda()
    assert world_mod.os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    use_cpu_accelerator_if_no_cuda()
    assert world_mod.os.environ["DS_ACCELERATOR"] == "cuda"
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    use_cpu_accelerator_if_no_cuda()
    assert "DS_ACCELERATOR" not in world_mod.os.environ


def test_importing_world_does_not_import_torch_or_deepspeed():
    code = (
        "import sys, dstune; before = set(sys.modules); import dstune.world; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; print(sorted(new & {'torch', 'deepspeed'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- agreement with DeepSpeed's runner.main()


class _Resolved(Exception):
    """Raised from inside runner.main() once it has resolved the resources, before it launches anything."""


def deepspeed_resources(hostfile, include, exclude, num_nodes, num_gpus):
    """What `deepspeed --hostfile ... train.py` would launch: runner.main() itself, stopped at encode_world_info."""
    from deepspeed.launcher import runner
    from deepspeed.utils import logger

    argv = ["--hostfile", hostfile, "--no_ssh_check", "--master_addr", "127.0.0.1", "--log_level", "critical"]
    for flag, value in (
        ("--include", include),
        ("--exclude", exclude),
        ("--num_nodes", num_nodes),
        ("--num_gpus", num_gpus),
    ):
        if value not in (None, ""):
            argv += [flag, str(value)]
    resolved = {}

    def capture(active_resources):
        resolved.update(active_resources)
        raise _Resolved

    levels = [logger.level] + [handler.level for handler in logger.handlers]
    try:
        with mock.patch.object(runner, "encode_world_info", capture):
            runner.main(argv + ["train.py"])
    except _Resolved:
        return [(host, len(slots)) for host, slots in resolved.items()]
    finally:  # main() sets DeepSpeed's log level globally
        logger.setLevel(levels[0])
        for handler, level in zip(logger.handlers, levels[1:]):
            handler.setLevel(level)
    raise AssertionError("runner.main() returned without resolving resources")


HOST_NAMES = ["worker-0", "worker-1", "node-a", "10.0.0.7", "gpu_box"]
NOISE = ["", "   ", "# comment", "   # indented comment"]
RARELY = st.sampled_from([False] * 9 + [True])  # hypothesis favours boundary integers, so not integers(0, 9) == 0
BAD_LINES = ["worker-9 slot=2", "worker-9", "slots=2", "worker-9 slots=x", "worker-9 = 2"]


@st.composite
def hostfile_texts(draw):
    hosts = draw(
        st.lists(
            st.tuples(st.sampled_from(HOST_NAMES), st.integers(1, 8)),
            min_size=1,
            max_size=4,
            unique_by=lambda host: host[0],
        )
    )
    if draw(RARELY):
        hosts = []  # a hostfile with no host lines
    if hosts and draw(RARELY):
        hosts.append((hosts[0][0], draw(st.integers(1, 8))))  # a duplicate host
    lines = []
    for host, slots in hosts:
        lines += draw(st.lists(st.sampled_from(NOISE), max_size=1))
        sep = draw(st.sampled_from([" ", "\t", "   "]))
        tail = draw(st.sampled_from(["", "  # trailing comment", " max_slots=8"]))
        lines.append(f"{draw(st.sampled_from(['', '  ']))}{host}{sep}slots={slots}{tail}")
    if draw(RARELY):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from(BAD_LINES)))
    return "\n".join(lines) + "\n", [host for host, _ in hosts]


@st.composite
def filter_strings(draw, names):
    specs = []
    for _ in range(draw(st.integers(1, 3))):
        host = draw(st.sampled_from(names * 3 + ["ghost"]))
        kind = draw(st.sampled_from(["host", "slots"] * 4 + ["garbage"] if names else ["host", "garbage"]))
        if kind == "host":
            specs.append(host)
        elif kind == "slots":
            slots = draw(st.lists(st.sampled_from([0, 0, 1, 1, 2, 3, 9]), min_size=1, max_size=3))
            specs.append(f"{host}:{','.join(map(str, slots))}")
        else:
            specs.append(draw(st.sampled_from([f"{host}:", f"{host}:a", f"{host}:0:1", ""])))
    return "@".join(specs)


@st.composite
def launches(draw):
    text, names = draw(hostfile_texts())
    mode = draw(
        st.sampled_from(
            ["none", "include", "include", "exclude", "exclude", "counts", "counts", "counts+filter", "both"]
        )
    )
    include = draw(filter_strings(names)) if mode in ("include", "both", "counts+filter") else ""
    exclude = draw(filter_strings(names)) if mode in ("exclude", "both") else ""
    counts = st.one_of(st.none(), st.integers(1, 6))
    num_nodes = draw(counts) if mode.startswith("counts") else None
    num_gpus = draw(counts) if mode.startswith("counts") else None
    return text, include, exclude, num_nodes, num_gpus


@settings(max_examples=100, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(launch=launches())
def test_agrees_with_deepspeed_runner_main(launch, tmp_path_factory):
    text, include, exclude, num_nodes, num_gpus = launch
    path = write(tmp_path_factory.getbasetemp(), text, "property-hostfile")
    try:
        expected = deepspeed_resources(path, include, exclude, num_nodes, num_gpus)
    except Exception:  # noqa: BLE001 - DeepSpeed refuses this launch (with any type), so must we
        expected = None
    if not expected:  # dstune also refuses what DeepSpeed would launch with zero ranks
        with pytest.raises(WorldError) as err:
            world_from_flags(hostfile=path, include=include, exclude=exclude, num_nodes=num_nodes, num_gpus=num_gpus)
        assert path in str(err.value) or "--" in str(err.value)  # names the file or the flag at fault
        return
    world = world_from_flags(hostfile=path, include=include, exclude=exclude, num_nodes=num_nodes, num_gpus=num_gpus)
    assert layout(world) == expected
    assert world.world_size == sum(n for _, n in expected) and world.num_nodes == len(expected)


def test_deepspeed_logger_level_is_restored(tmp_path):
    from deepspeed.utils import logger

    before = logger.level
    world_from_flags(hostfile=write(tmp_path, CLUSTER), include="worker-0")
    with pytest.raises(WorldError):
        world_from_flags(hostfile=write(tmp_path, "bad\n", "bad"))
    assert logger.level == before and logging.getLogger("DeepSpeed").level == before
