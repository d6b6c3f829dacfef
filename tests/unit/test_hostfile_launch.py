"""`dstune validate --hostfile` plans for exactly the world a real launch gets, and launch/multinode.sh validates
before it launches.

DeepSpeed's multi-node launch has two halves: `deepspeed` (deepspeed.launcher.runner.main) reads the hostfile and
the filters and encodes the chosen {host: [slots]} as --world_info; on every node, deepspeed.launcher.launch decodes
it and starts that node's ranks with RANK / LOCAL_RANK / WORLD_SIZE / CROSS_RANK / CROSS_SIZE. Both halves run for
real here: runner.main up to the point where it would start pdsh, and launch.py as real processes.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstune import world as world_mod
from dstune.world import World, WorldError, world_from_flags

REPO = Path(__file__).resolve().parents[2]
MULTINODE = REPO / "launch" / "multinode.sh"


class _Launched(Exception):
    """Raised where runner.main would start the per-node launchers: carries the world it would send them."""

    def __init__(self, world_info: dict):
        self.world_info = world_info


def runner_world_info(hostfile: str, flags: dict) -> dict | None:
    """The {host: [slots]} DeepSpeed's runner.main encodes for this hostfile and flags, or None if it refuses."""
    from deepspeed.launcher import runner

    argv = ["--hostfile", hostfile, "--no_ssh_check", "--master_addr", "127.0.0.1"]
    for name, value in flags.items():
        argv += [f"--{name}", str(value)]
    argv.append("train.py")

    def capture(active):
        raise _Launched(json.loads(json.dumps(active)))

    with mock.patch.object(runner, "encode_world_info", capture):
        try:
            runner.main(argv)
        except _Launched as launched:
            return launched.world_info
        except (ValueError, SystemExit, AssertionError, KeyError, IndexError):
            return None
    raise AssertionError("runner.main returned without launching")


def per_node_ranks(world: World) -> list[list[int]]:
    ranks, start = [], 0
    for count in world.ranks_per_node:
        ranks.append(list(range(start, start + count)))
        start += count
    return ranks


@st.composite
def clusters(draw):
    num_hosts = draw(st.integers(1, 4))
    hosts = {f"worker-{i}": draw(st.integers(1, 4)) for i in range(num_hosts)}
    kind = draw(st.sampled_from(["none", "include", "exclude", "num_nodes", "num_gpus", "both"]))
    flags: dict = {}
    if kind in ("include", "exclude"):
        chosen = draw(st.lists(st.sampled_from(sorted(hosts)), min_size=1, max_size=num_hosts, unique=True))
        parts = []
        for host in chosen:
            slots = draw(st.lists(st.integers(0, hosts[host] - 1), max_size=hosts[host], unique=True))
            parts.append(f"{host}:{','.join(map(str, sorted(slots)))}" if slots else host)
        flags[kind] = "@".join(parts)
    if kind in ("num_nodes", "both"):
        flags["num_nodes"] = draw(st.integers(1, num_hosts + 1))
    if kind in ("num_gpus", "both"):
        flags["num_gpus"] = draw(st.integers(1, 5))
    return hosts, flags


@pytest.fixture(autouse=True)
def no_local_gpus(monkeypatch):
    monkeypatch.setattr(world_mod, "_local_gpu_count", lambda: 0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(clusters())
def test_validate_world_equals_what_the_runner_launches(tmp_path, cluster):
    hosts, flags = cluster
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host} slots={slots}\n" for host, slots in hosts.items()))
    launched = runner_world_info(str(hostfile), flags)
    try:
        world = world_from_flags(hostfile=str(hostfile), **flags)
    except WorldError as err:
        assert launched is None or not launched, f"validate refused ({err}) but DeepSpeed launches {launched}"
        return
    assert launched is not None, f"validate planned {world} but DeepSpeed refuses {flags}"
    assert list(launched) == list(world.hosts)  # same nodes, same order (node ranks follow it)
    assert [len(slots) for slots in launched.values()] == list(world.ranks_per_node)
    assert sum(map(len, launched.values())) == world.world_size and len(launched) == world.num_nodes


def _launch_node(world_info: dict, node_rank: int, tmp_path: Path) -> list[dict]:
    """Run deepspeed.launcher.launch for one node with a script that reports each rank's environment."""
    encoded = base64.urlsafe_b64encode(json.dumps(world_info).encode()).decode()
    reports = tmp_path / f"node{node_rank}"
    reports.mkdir()
    script = tmp_path / "report_env.py"
    script.write_text(
        "import json, os, sys; from pathlib import Path\n"
        "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'CROSS_RANK', 'CROSS_SIZE', 'LOCAL_SIZE')\n"
        "(Path(sys.argv[1]) / f\"rank{os.environ['RANK']}.json\").write_text("
        "json.dumps({k: os.environ[k] for k in keys}))\n"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.launcher.launch",
            f"--world_info={encoded}",
            f"--node_rank={node_rank}",
            "--master_addr=127.0.0.1",
            "--master_port=29999",
            "--no_local_rank",
            str(script),
            str(reports),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return [json.loads(path.read_text()) for path in sorted(reports.glob("rank*.json"))]


@pytest.mark.parametrize(
    "hostfile_text, flags",
    [
        ("a slots=3\nb slots=2\n", {}),
        ("a slots=4\nb slots=4\nc slots=2\n", {"include": "a:1,3@c"}),
    ],
)
def test_each_node_gets_the_ranks_validate_planned(tmp_path, hostfile_text, flags):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hostfile_text)
    world = world_from_flags(hostfile=str(hostfile), **flags)
    world_info = runner_world_info(str(hostfile), flags)
    for node_rank, planned in enumerate(per_node_ranks(world)):
        envs = _launch_node(world_info, node_rank, tmp_path)
        assert sorted(int(e["RANK"]) for e in envs) == planned
        assert {int(e["WORLD_SIZE"]) for e in envs} == {world.world_size}
        assert {int(e["CROSS_RANK"]) for e in envs} == {node_rank}  # what dstune reads to tell nodes apart
        assert {int(e["CROSS_SIZE"]) for e in envs} == {world.num_nodes}
        assert {int(e["LOCAL_SIZE"]) for e in envs} == {world.ranks_per_node[node_rank]}
        # LOCAL_RANK is RANK % ranks-on-this-node: a permutation of 0..n-1, not always in rank order
        assert sorted(int(e["LOCAL_RANK"]) for e in envs) == list(range(world.ranks_per_node[node_rank]))


# ------------------------------------------------------------------------------------------ launch/multinode.sh


def _multinode(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DSTUNE_DRY_RUN="1", PYTHON=sys.executable, DS_ACCELERATOR="cpu")
    return subprocess.run(
        ["bash", str(MULTINODE), *args], capture_output=True, text=True, env=env, timeout=180, cwd=REPO
    )


def test_multinode_validates_then_prints_the_exact_command(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    done = _multinode(
        "launch/sd-tiny-demo.yaml",
        str(hostfile),
        "--master_port",
        "29600",
        "--",
        "--set",
        "train.seed=3",
        "--resume",
        "latest",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nodes" in done.stdout and "2" in done.stdout  # validate's plan for the hostfile's 2 nodes
    command = done.stdout.split("launching (in")[1].splitlines()[1].split()
    assert command[:3] == ["deepspeed", "--hostfile", str(hostfile)]
    assert command[3:] == [
        "--master_port",
        "29600",
        "dstune/train.py",
        str(REPO / "launch" / "sd-tiny-demo.yaml"),
        "--set",
        "train.seed=3",
        "--resume",
        "latest",
    ]
    assert "not launched" in done.stdout


def test_multinode_stops_before_launching_when_validate_fails(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    done = _multinode(
        "launch/sd-tiny-demo.yaml",
        str(hostfile),
        "--",
        "--set",
        "train.micro_batch_size=3",
        "--set",
        "train.global_batch_size=8",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "micro_batch_size" in done.stdout + done.stderr
    assert "nothing was launched" in done.stderr and "launching" not in done.stdout


def test_multinode_passes_include_to_validate(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    done = _multinode("launch/sd-tiny-demo.yaml", str(hostfile), "--include", "node-c")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "node-c" in done.stdout + done.stderr and "nothing was launched" in done.stderr


def test_openmpi_ranks_are_read_from_mpirun_variables(monkeypatch):
    """`deepspeed --launcher openmpi` starts ranks with mpirun, which sets only OMPI_COMM_WORLD_*."""
    from dstune import distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE"):
        monkeypatch.setenv(name, "placeholder")  # so that monkeypatch removes what the code under test sets
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert (distributed.launcher_rank(), int(os.environ["WORLD_SIZE"])) == (5, 8)
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["LOCAL_SIZE"] == "4"


def test_launcher_variables_win_over_mpirun_ones(monkeypatch):
    from dstune import distributed

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert (distributed.launcher_rank(), int(os.environ["WORLD_SIZE"])) == (2, 4)
