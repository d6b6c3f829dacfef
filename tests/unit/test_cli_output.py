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
    return subprocess.run(
        [sys.executable, "-m", "dstune", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )


def test_piped_validate_keeps_each_table_row_on_one_line_with_a_long_deepspeed_config_path(tmp_path):
    folder = tmp_path / ("a-folder-with-a-rather-long-name-for-the-deepspeed-configuration-files" * 2) / "zero"
    folder.mkdir(parents=True)
    ds_file = folder / "my-deepspeed-zero2-configuration-with-overlapping-communication.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}}))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "sd", "pretrained": "stable-diffusion-v1-5/stable-diffusion-v1-5"},
                "data": {"path": str(tmp_path / "not-here"), "resolution": 512},
                "train": {"micro_batch_size": 4, "global_batch_size": 128, "max_steps": 2000, "precision": "bf16"},
                "deepspeed": {"config": str(ds_file)},
            },
            sort_keys=False,
        )
    )
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
        return found.strip()[len(label) :].strip()

    assert row("merged JSON").startswith(f"{ds_file}: its values fill what the spec leaves unset")
    assert row("zero_optimization.stage") == f"2  <- {ds_file}:1"
    assert row("zero_optimization.overlap_comm") == f"true  <- {ds_file}:1"
    assert row("global batch") == "128 samples per optimizer step = 4 x 4 x 8 ranks"
    assert row("DeepSpeed JSON").startswith(
        "train_batch_size 128, train_micro_batch_size_per_gpu 4, gradient_accumulation_steps 4 (agreed by DeepSpeed"
    )


# ------------------------------------------------------------------------------------------ the libraries' notices

LIBRARY_NOTICES = """
import sys, warnings
from dstune.library_logs import set_library_verbosity

set_library_verbosity(sys.argv[1] == "verbose")
import bitsandbytes.backends.cpu.ops as bnb_cpu_ops  # the logger of its CPU-kernel notice (printed on CPUs with AVX512-BF16)
from deepspeed.accelerator import get_accelerator

get_accelerator()  # DeepSpeed's INFO line: "Setting ds_accelerator to cpu (override)"
bnb_cpu_ops.logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: no module named kernels")
warnings.warn_explicit("library-deprecation: torch.cuda.amp.custom_fwd is deprecated", FutureWarning, "zero.py", 1,
                       module="deepspeed.runtime.zero.linear")
warnings.warn_explicit("dstune-deprecation: this spec key is deprecated", FutureWarning, "validate.py", 1,
                       module="dstune.validate")
warnings.warn_explicit("library-user-warning: CUDA is not available", UserWarning, "grad_scaler.py", 1,
                       module="torch.cuda.amp.grad_scaler")
from transformers.utils.generic import logger as transformers_generic  # imported after the verbosity is set
transformers_generic.warning("`past_key_values`/`cache_params` are deprecated. Use `cache` instead.")
transformers_generic.warning("transformers-warning: a real problem with the model")
transformers_generic.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to `X`")
from dstune.library_logs import without_library_prints
with without_library_prints():
    print("DeepSpeed deepspeed_shm_comm_op built successfully")
    print("a line of its own")
with without_library_prints("stderr"):
    print("Loading checkpoint shards: 100%|##########| 1/1", file=sys.stderr)
    print("", file=sys.stderr)
    print("Gathering sharded weights: 100%|##########| 208/208", file=sys.stderr)
"""


def run_notices(mode: str) -> str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", LIBRARY_NOTICES, mode], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_library_notices_are_dropped_by_source_and_dstune_warnings_stay():
    quiet = run_notices("quiet")
    assert "Setting ds_accelerator" not in quiet and "[INFO]" not in quiet
    assert "gemm_4bit_forward" not in quiet
    assert "library-deprecation" not in quiet
    assert "dstune-deprecation" in quiet  # dstune's own FutureWarnings are never hidden
    assert "library-user-warning" in quiet  # nor other kinds of warnings from the libraries
    assert "past_key_values" not in quiet and "transformers-warning" in quiet  # its deprecation notices only
    assert "requires torchvision" not in quiet
    assert "built successfully" not in quiet and "Loading checkpoint shards" not in quiet
    assert "Gathering sharded weights" not in quiet
    assert "a line of its own" in quiet  # what the wrapped call prints besides is given back
    verbose = run_notices("verbose")
    for expected in (
        "[INFO]",
        "Setting ds_accelerator to cpu",
        "gemm_4bit_forward",
        "library-deprecation",
        "dstune-deprecation",
        "library-user-warning",
        "past_key_values",
        "built successfully",
        "Loading checkpoint shards",
    ):
        assert expected in verbose, f"{expected!r} missing with --verbose:\n{verbose}"


def test_validate_of_a_launch_spec_prints_no_library_lines_unless_verbose():
    spec = REPO / "launch" / "sd-tiny-demo.yaml"
    quiet = run_dstune("validate", spec, "--num-gpus", "2")
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    for noise in ("[INFO]", "gemm_4bit_forward", "FutureWarning", "DeprecationWarning"):
        assert noise not in quiet.stdout + quiet.stderr
    assert quiet.stderr == ""
    verbose = run_dstune("validate", spec, "--num-gpus", "2", "--verbose")
    assert verbose.returncode == 0, verbose.stdout + verbose.stderr
    assert "[INFO]" in verbose.stdout + verbose.stderr  # DeepSpeed's, e.g. its config parse
    assert verbose.stdout.rstrip().splitlines()[-1].startswith("valid: 2 ranks")


def test_the_plan_counts_in_words_a_reader_expects(tmp_path, capsys):
    """One of a thing in the singular ("1 sample", "1 optimizer step"), and large epoch counts as plain numbers
    (1000, not 1e+03)."""
    from dstune.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
                "data": {"path": str(tmp_path / "not-here"), "resolution": 32},
                "train": {"micro_batch_size": 1, "max_steps": 1},
            }
        )
    )
    assert main(["validate", str(spec), "--num-samples", "1"]) == 0
    out = capsys.readouterr().out
    for expected in (
        "micro batch          1 sample per rank per forward pass",
        "accumulation         1 micro-batch per optimizer step",
        "global batch         1 sample per optimizer step = 1 x 1 x 1 rank",
        "steps per epoch      1 optimizer step (1 micro-batch per rank)",
        "each epoch           uses 1 sample, leaves out 0",
        "total                1 optimizer step (train.max_steps)",
        "samples seen         1 (each sample 1 time on average)",
        "valid: 1 rank x micro 1 x accumulation 1 = global batch 1; 1 optimizer step = 1 epoch",
    ):
        assert expected in out, f"{expected!r} not in:\n{out}"
    assert "1 samples" not in out and "1 optimizer steps" not in out
    assert main(["validate", str(spec), "--num-samples", "1", "--set", "train.max_steps=1000"]) == 0
    out = capsys.readouterr().out
    assert "epochs               1000 (passes over the whole dataset" in out and "= 1000 epochs" in out, out
    assert "e+03" not in out
