"""Launch real multi-process dstune runs for the tests in this folder (2 ranks on CPU, gloo)."""

from __future__ import annotations

import base64
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "dstune" / "train.py"
# One cache for the whole test session: the built-in tiny model is built once and reused, as users' runs do.
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
LAUNCH_TIMEOUT_S = 600


def base_spec(run_dir: Path, **sections) -> dict:
    spec = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": {"path": "builtin:shapes", "resolution": 32, "num_workers": 0},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4,
                  "optimizer": {"type": "adamw", "lr": 1e-3}, "precision": "fp32", "seed": 7},
        "deepspeed": {"zero_stage": 2},
        "output": {"dir": str(run_dir), "cache_dir": str(CACHE_DIR), "export": "none"},
    }
    for name, values in sections.items():
        spec.setdefault(name, {}).update(values)
    return spec


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def free_port() -> int:
    """A free master port for one launch. `make test` runs test modules in parallel (pytest-xdist), so launches of
    different workers run at the same time: each worker draws from its own slice of ports below Linux's ephemeral
    range (32768+), where neither another worker's master port nor a running launch's gloo connections (which take
    ephemeral ports) can collide with it. A port is never given twice in one session."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 20000 + (index % 8) * 1500
    while True:
        port = random.randrange(low, low + 1500)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port


_PORTS_GIVEN: set[int] = set()


def env() -> dict:
    out = dict(os.environ)
    out.update(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    out["PYTHONPATH"] = f"{REPO}{os.pathsep}{out['PYTHONPATH']}" if out.get("PYTHONPATH") else str(REPO)
    return out


def launch(spec_path: Path, num_ranks: int = 2, args: tuple = (), script: Path = TRAIN,
           script_args: tuple = (), as_module: bool = False, via_runner: bool = False) -> subprocess.CompletedProcess:
    """N ranks of `script spec` (plain python for one rank). By default through DeepSpeed's per-node launcher
    (deepspeed.launcher.launch, what `deepspeed --num_gpus N` runs on each node) with the world info the runner would
    encode: the same rank processes and environment, without a third process importing deepspeed only to start it
    (~3 s a launch). `via_runner` (and `as_module`, `deepspeed --num_gpus N --module dstune.train spec`) goes
    through the `deepspeed` command itself (deepspeed.launcher.runner), as users type it."""
    if num_ranks == 1:
        cmd = [sys.executable, str(script), *script_args, str(spec_path), *args]
    else:
        port = free_port()
        LAUNCHED_PORTS.append(port)
        if via_runner or as_module:
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_ranks),
                   "--master_port", str(port)]
        else:
            cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={_local_world(num_ranks)}",
                   "--master_addr=127.0.0.1", f"--master_port={port}"]
        cmd += ["--module", "dstune.train"] if as_module else [str(script), *script_args]
        cmd += [str(spec_path), *args]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def _local_world(num_ranks: int) -> str:
    """The runner's encoding of one local node with `num_ranks` slots (base64 JSON {"localhost": [0, 1, ...]})."""
    return base64.urlsafe_b64encode(json.dumps({"localhost": list(range(num_ranks))}).encode()).decode()


LAUNCHED_PORTS: list[int] = []  # the master port of every multi-rank launch, in order


def shm_segments(ports: list[int]) -> set[str]:
    """DeepSpeed's CPU all-reduce segments in /dev/shm (RAM) of the launches on these master ports (other programs on
    the machine may hold their own): a run must not leave its own behind."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return set()
    return {p.name for p in shm.glob("deepspeed_allreduce_buffer_*") if int(p.name.split("_")[-2]) in ports}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
