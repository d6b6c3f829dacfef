"""What the benchmarks in bench/ share: the output convention, launching ranks, and the larger benchmark model.

Output convention (every script): progress lines go to stderr; stdout holds one table (`print_table`) and then
exactly one line of JSON (`print_json`), whose "bench" key names the script, so
`python3 bench/X.py | tail -1` is machine-readable. Each script measures dstune and its baseline in the same
invocation, interleaving the repeats, and reports ratios: on a shared machine only same-run ratios mean much.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "dstune" / "train.py"
BENCH_CACHE = REPO / ".dstune-cache" / "bench"  # the built-in model and the benchmark model, built once
LAUNCH_TIMEOUT_S = 900

# The built-in tiny-sd pipeline with a larger UNet (~18 M parameters instead of 0.8 M), so that on the CPU a
# training step is dominated by the UNet's compute, as it is for real models, and not by fixed per-step costs.
# Same latent channels and cross-attention width as the built-in VAE and text encoder, so they still fit.
BENCH_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(64, 128, 256),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=32,
)
BENCH_MODEL_NAME = "bench-sd-v1"  # bump when BENCH_UNET changes


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """A Markdown table (pastes into docs/performance.md as is); floats with 3 significant digits."""

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(cell(v) for v in row) + " |")
    print(flush=True)


def print_json(bench: str, result: dict) -> None:
    def rounded(value):
        if isinstance(value, float):
            return float(f"{value:.4g}")
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rounded(v) for v in value]
        return value

    print(json.dumps({"bench": bench, **rounded(result)}), flush=True)


def machine() -> dict:
    """What the numbers were taken on; the load average says how shared the cores were."""
    import torch

    info = {"cpus": os.cpu_count(), "torch": torch.__version__, "load_avg_1min": round(os.getloadavg()[0], 2)}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def median(values: list[float]) -> float:
    return statistics.median(values)


def env() -> dict:
    out = dict(os.environ)
    out.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if not _has_cuda():
        out.setdefault("DS_ACCELERATOR", "cpu")  # without CUDA, DeepSpeed's CPU accelerator (gloo)
    out["PYTHONPATH"] = f"{REPO}{os.pathsep}{out['PYTHONPATH']}" if out.get("PYTHONPATH") else str(REPO)
    return out


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    script: Path,
    args: list[str],
    num_ranks: int,
    timeout_s: int = LAUNCH_TIMEOUT_S,
    check: bool = True,
    launcher: bool = False,
) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N script args` (plain python for one rank unless `launcher`); stops the benchmark if
    it fails."""
    if num_ranks == 1 and not launcher:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(num_ranks),
            "--master_port",
            str(_free_port()),
            str(script),
            *args,
        ]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise SystemExit(
            f"failed (exit {proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def bench_model_folder(cache_dir: Path = BENCH_CACHE) -> Path:
    """A diffusers pipeline folder: the built-in tiny-sd (trained VAE, text encoder, tokenizer, scheduler) with the
    UNet replaced by a random BENCH_UNET. Built once into `cache_dir`, reused after; usable as model.pretrained."""
    return sd_pipeline_with_unet(cache_dir / BENCH_MODEL_NAME, BENCH_UNET, cache_dir)


def sd_pipeline_with_unet(final: Path, unet_config: dict, cache_dir: Path) -> Path:
    """The built-in tiny-sd pipeline (from `cache_dir`) with its UNet replaced by a random (seed 0) UNet of
    `unet_config`, written once to `final` (built beside it, renamed into place), reused after."""
    if (final / "model_index.json").is_file() and (final / "unet" / "config.json").is_file():
        return final
    import torch
    from diffusers import UNet2DConditionModel

    from dstune.builtin import ensure_builtin_model

    base = ensure_builtin_model("builtin:tiny-sd", cache_dir)
    work = final.with_name(f".{final.name}-building-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    shutil.rmtree(work / "unet")
    (work / "dstune_builtin.json").unlink(missing_ok=True)  # it is no longer the built-in model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        UNet2DConditionModel(**unet_config).save_pretrained(work / "unet", safe_serialization=True)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(work, final)
    return final


def unet_parameters(config: dict) -> int:
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return sum(p.numel() for p in UNet2DConditionModel(**config).parameters())
