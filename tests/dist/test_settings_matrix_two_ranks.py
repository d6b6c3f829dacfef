"""The settings matrix at two ranks (tests/unit/settings_matrix.py, docs/testing.md): what only DeepSpeed and several
ranks do, for every built-in model, in real `dstune train` runs.

One run per built-in model, one optimizer step: the rows of a pairwise design over ZeRO stage (0, 2, 3), gradient
accumulation through the engine (micro batch 1 x 2 micro steps, or micro batch 2), caches built by both ranks, bf16
(DeepSpeed's own optimizer over fp32 masters), LoRA, gradient checkpointing and grouped batches (aspect-ratio or
duration buckets over the ranks), handed out in turn, so that every pair of those settings' values meets in some
model's run. Each run must pass the batch check, log a finite loss, give every trainable parameter a gradient at the
optimizer step (assembled over the ranks by DeepSpeed, every ZeRO stage; LEFT_OUT as in the one-process cases), and
warn nothing from dstune's code, with no traceback. The runs share one launch (tests/dist/scripts/train_runs.py):
the whole path of each, on the same two processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness import CACHE_DIR, explain, launch, metrics, write_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import covering_array  # noqa: E402
import settings_matrix as matrix  # noqa: E402

from dstune.builtin import BUILTIN_MODELS, ensure_builtin_model  # noqa: E402

pytestmark = pytest.mark.dist

MODELS = sorted(BUILTIN_MODELS)
DESIGN = matrix.deepspeed_runs(MODELS)
# a user's spec: Dia at micro batch 1 (global batch 2 on 2 ranks, ZeRO 2, fp32, full) stopped every rank at step 1
REPORTED = [("tiny-dia", {"zero_stage": 2, "micro_batch_size": 1, "precision": "fp32", "train": "full"})]
RUNS = DESIGN + REPORTED
SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_runs.py"


def test_every_pair_of_the_deepspeed_settings_meets_in_a_run_and_each_model_runs_every_value():
    assert not covering_array.uncovered_pairs(
        matrix.DEEPSPEED_FACTORS, [matrix.as_deepspeed_row(row) for _, row in DESIGN]
    )
    for name in MODELS:
        rows = [matrix.as_deepspeed_row(row) for model, row in DESIGN if model == name]
        assert len(rows) == 2 and {row["zero_stage"] for row in rows} in ({0, 3}, {2, 3}), name
        for setting, values in matrix.DEEPSPEED_FACTORS.items():
            if setting != "zero_stage" and setting in rows[0]:
                assert {row[setting] for row in rows} == set(values), (name, setting)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(run dirs by model, the launch): every run in one 2-rank launch, the built-in models built here first."""
    root = tmp_path_factory.mktemp("settings-matrix-2-ranks")
    folders = matrix.write_datasets(root / "data")
    dirs, specs = {}, []
    for number, (name, row) in enumerate(RUNS):
        ensure_builtin_model(name, CACHE_DIR)
        run_dir = root / f"{number:02d}-{name}" / "run"
        run_dir.parent.mkdir(parents=True)
        specs.append(str(write_spec(run_dir.parent / "spec.yaml", matrix.case_spec(name, row, folders, run_dir,
                                                                                   CACHE_DIR))))
        dirs[number] = run_dir
    listed = root / "runs.txt"
    listed.write_text("\n".join(specs) + "\n")
    return dirs, launch(listed, num_ranks=2, script=SCRIPT)


def _output_of(proc, run_dir: Path) -> str:
    """What rank 0 printed during the run of `run_dir` (between its marker and the next one)."""
    parts = proc.stdout.split("=== settings matrix run: ")
    return next((part for part in parts if part.split("\n", 1)[0] == str(run_dir.parent / "spec.yaml")), "")


@pytest.mark.parametrize("number", range(len(RUNS)), ids=[matrix.case_id(name, row) for name, row in RUNS])
def test_every_model_trains_a_step_under_deepspeed_at_two_ranks(launched, number):
    (dirs, proc), (name, row) = launched, RUNS[number]
    run_dir = dirs[number]
    output = _output_of(proc, run_dir)
    found = run_dir / "matrix.json"
    assert found.is_file() and "Traceback" not in proc.stderr, explain(proc)
    assert "batch check passed" in output, output[-3000:]
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == [1] and all(m["loss"] == m["loss"] and abs(m["loss"]) < 1e6 for m in logged)
    # validate's warnings (printed with the plan): what the case's settings must be warned about, nothing else
    printed = [line for line in output.splitlines() if line.lower().startswith("warning")]
    assert matrix.unexpected_warnings(name, row, printed) == ([], []), printed
    result = json.loads(found.read_text())
    assert not result["warnings"], result["warnings"]  # Python warnings from dstune's files
    assert not matrix.unexplained(name, row, result["grads"]), matrix.unexplained(name, row, result["grads"])
