"""Launch real multi-process dstune runs for the tests in this folder (2 ranks on CPU, gloo)."""

from __future__ import annotations

import atexit
import base64
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

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
    out = {key: value for key, value in os.environ.items() if key != "COLUMNS"}  # dstune's lines whole, as piped
    out.update(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    out["PYTHONPATH"] = f"{REPO}{os.pathsep}{out['PYTHONPATH']}" if out.get("PYTHONPATH") else str(REPO)
    return out


def launch(spec_path: Path, num_ranks: int = 2, args: tuple = (), script: Path = TRAIN,
           script_args: tuple = (), as_module: bool = False, via_runner: bool = False,
           real_launcher: bool = False) -> subprocess.CompletedProcess:
    """N ranks of `script spec` (one rank: `python script spec`, no launcher).

    By default the ranks are forked from this worker's warm process (tests/dist/warm_launcher.py): real processes with
    the environment DeepSpeed's per-node launcher gives them, without each of them importing torch, DeepSpeed and
    diffusers again (~28 of a tiny launch's ~33 CPU-seconds). The tests about launching itself ask for
    `real_launcher` (deepspeed.launcher.launch, what `deepspeed --num_gpus N` runs on each node, with the world info
    the runner would encode) or `via_runner` / `as_module` (the `deepspeed` command itself,
    deepspeed.launcher.runner, as users type it: `deepspeed --num_gpus N [--module dstune.train] spec`)."""
    if not (real_launcher or via_runner or as_module):
        port = free_port() if num_ranks > 1 else 0
        if port:
            LAUNCHED_PORTS.append(port)
        return warm_launch([str(script), *script_args, str(spec_path), *args], num_ranks, port)
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


class _WarmProcess:
    """This worker's warm launcher process, started on first use and again whenever the environment it imported
    under changed in a way imports could read (anything but pytest's PYTEST_CURRENT_TEST, which names the running
    test, and the DSTUNE_ variables tests set per launch)."""

    process: Optional[subprocess.Popen] = None
    imported_under: dict = {}


def _import_env(environment: dict) -> dict:
    return {k: v for k, v in environment.items() if not k.startswith(("DSTUNE_", "PYTEST_CURRENT_TEST"))}


def _warm_process(environment: dict) -> subprocess.Popen:
    warm = _WarmProcess
    if warm.process is not None and (warm.process.poll() is not None
                                     or warm.imported_under != _import_env(environment)):
        warm.process.kill()
        warm.process.wait()
        warm.process = None
    if warm.process is None:
        warm.process = subprocess.Popen([sys.executable, "-u", str(Path(__file__).with_name("warm_launcher.py"))],
                                        cwd=REPO, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        warm.imported_under = _import_env(environment)
        atexit.register(_close_warm_process, warm.process)
        ready = warm.process.stdout.readline()
        if not ready:
            raise RuntimeError(f"the warm launcher process failed to start (exit {warm.process.wait()}); run "
                               f"{sys.executable} tests/dist/warm_launcher.py to see why")
    return warm.process


def _close_warm_process(process: subprocess.Popen) -> None:
    """At the worker's exit: end of requests, and wait, so no process outlives the test session."""
    if process.poll() is None:
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def warm_launch(argv: list[str], num_ranks: int, port: int) -> subprocess.CompletedProcess:
    """Run `argv` (script and its arguments) as `num_ranks` ranks forked from the warm process; the ranks' output
    (stdout and stderr, both ranks in one stream each, as under the launcher) comes back in the result."""
    environment = env()
    with tempfile.TemporaryDirectory(prefix="dstune-launch-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        out.touch()
        err.touch()
        request = {"script": argv[0], "args": argv[1:], "num_ranks": num_ranks, "port": port, "cwd": str(REPO),
                   "env": environment, "stdout": str(out), "stderr": str(err), "timeout_s": LAUNCH_TIMEOUT_S}
        process = _warm_process(environment)
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm launcher process died during a launch (exit {process.wait()})")
        reply = json.loads(line)
        cmd = ["warm_launcher", f"--num_ranks={num_ranks}", *argv]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, LAUNCH_TIMEOUT_S, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(cmd, reply["returncode"], out.read_text(), err.read_text())


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


# The memory plan against a run's measurement, per phase (docs/performance.md section 5): memory.json holds, for each
# phase, the plan's per-rank bytes and the largest rank's own peak (on the CPU accelerator the growth of the peak
# RSS over the rank's baseline; the runtime reserve is part of both there).
MEMORY_FLOOR = 0.9  # predicted >= 0.9 x measured in every phase: the plan may be low by at most 10 %


def memory_phase_rows(run_dir: Path) -> list[tuple[str, float, float, float]]:
    """(phase, predicted, measured, ceiling) of a run's memory.json. The ceiling is the upper tolerance stated in
    docs/performance.md: measured + that phase's runtime reserve, and in the load and cache phases also the module's
    fp32 weights (the plan counts them read whole; the CPU maps them from the file and reads them lazily). A run
    without a cache marks a cache phase all the same: it holds what the load phase holds, and is held to that."""
    report = json.loads((run_dir / "memory.json").read_text())
    predicted_plan = report["predicted"]
    step_reserve = predicted_plan["per_gpu"]["runtime_reserve_bytes"]
    startup_reserve = predicted_plan["phases"]["load"]["parts"].get("runtime reserve", 0)
    weights = 4 * predicted_plan["parameters"]["module_params"]
    rows = []
    for name, row in report["phases"].items():
        predicted = row["predicted_bytes"] if row["predicted_bytes"] is not None else \
            report["phases"]["load"]["predicted_bytes"]
        measured = row["measured_max_bytes"]
        slack = step_reserve if name in ("step", "sample") else startup_reserve + weights
        rows.append((name, predicted, measured, measured + slack))
    return rows


def memory_problems(run_dir: Path) -> list[str]:
    """Every phase where the plan is more than 10 % below the measured peak or above the stated ceiling."""
    return [f"{name}: predicted {predicted / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB (floor "
            f"{MEMORY_FLOOR * measured / 1e6:.1f}, ceiling {ceiling / 1e6:.1f})"
            for name, predicted, measured, ceiling in memory_phase_rows(run_dir)
            if not MEMORY_FLOOR * measured <= predicted <= ceiling]
