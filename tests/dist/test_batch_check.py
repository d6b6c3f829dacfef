"""The batch checker stops every rank, before step 1 and without hanging, when the loader or DeepSpeed disagrees
with the plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import base_spec, explain, launch, write_spec

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_with_bug.py"


@pytest.fixture(scope="module")
def buggy(tmp_path_factory):
    """One launch with both bugs injected: the checker must name every disagreement of one run at once."""
    tmp_path = tmp_path_factory.mktemp("bugs")
    run_dir = tmp_path / "run"
    spec = base_spec(run_dir, train={"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4})
    spec_path = write_spec(tmp_path / "spec.yaml", spec)
    return run_dir, launch(spec_path, num_ranks=2, script=SCRIPT, script_args=("double-shard", "micro-override"))


def test_catches_a_loader_that_shards_twice(buggy):
    run_dir, proc = buggy
    assert proc.returncode == 1, explain(proc)
    out = proc.stdout + proc.stderr
    assert "batch check FAILED" in out
    # 256 samples / global 4 = 64 micro batches per rank planned; sharded again each rank gets 32.
    assert "loader micro batches this epoch is 32, the plan says 64" in out
    assert "rank 1" in out and "Traceback" not in out
    assert not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text() == ""


def test_catches_a_deepspeed_micro_batch_override(buggy):
    run_dir, proc = buggy
    assert proc.returncode == 1, explain(proc)
    out = proc.stdout + proc.stderr
    assert "batch check FAILED" in out
    assert "DeepSpeed micro batch per rank is 1, the plan says 2" in out
    assert "DeepSpeed gradient accumulation is 2, the plan says 1" in out
    assert "Traceback" not in out
