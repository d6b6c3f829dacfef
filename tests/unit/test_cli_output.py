"""What the commands print when their output is not a terminal (a pipe, a file, a CI log): whole lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def run_dstune(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m dstune ...` with stdout and stderr captured (pipes, so no terminal) and no COLUMNS set."""
    environment = {k: v for k, v in os.environ.items() if k != "COLUMNS"} if env is None else env
    return subprocess.run([sys.executable, "-m", "dstune", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=environment)


def test_piped_validate_keeps_each_table_row_on_one_line_with_a_long_deepspeed_config_path(tmp_path):
    folder = tmp_path / ("a-folder-with-a-rather-long-name-for-the-deepspeed-configuration-files" * 2) / "zero"
    folder.mkdir(parents=True)
    ds_file = folder / "my-deepspeed-zero2-configuration-with-overlapping-communication.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}}))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "model": {"family": "sd", "pretrained": "stable-diffusion-v1-5/stable-diffusion-v1-5"},
        "data": {"path": str(tmp_path / "not-here"), "resolution": 512},
        "train": {"micro_batch_size": 4, "global_batch_size": 128, "max_steps": 2000, "precision": "bf16"},
        "deepspeed": {"config": str(ds_file)}}, sort_keys=False))
    proc = run_dstune("validate", spec, "--num-gpus", "8", "--num-samples", "20000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # A row is `  label  value`; a row broken by wrapping continues on a line that starts with the value column's
    # indent (dozens of spaces). Group titles start at column 0 and items at column 2 (sub-items at 4).
    broken = [line for line in lines if line.startswith(" " * 5)]
    assert not broken, "\n".join(lines)
    assert not [line for line in lines if line != line.rstrip()], "lines are padded with trailing spaces"

    def row(label: str) -> str:
        (found,) = [line for line in lines if line.strip().startswith(label + "  ")]
        return found.strip()[len(label):].strip()

    assert row("merged JSON").startswith(f"{ds_file}: its values fill what the spec leaves unset")
    assert row("zero_optimization.stage") == f"2  <- {ds_file}:1"
    assert row("zero_optimization.overlap_comm") == f"true  <- {ds_file}:1"
    assert row("global batch") == "128 samples per optimizer step = 4 x 4 x 8 ranks"
    assert row("DeepSpeed JSON").startswith(
        "train_batch_size 128, train_micro_batch_size_per_gpu 4, gradient_accumulation_steps 4 (agreed by DeepSpeed")
