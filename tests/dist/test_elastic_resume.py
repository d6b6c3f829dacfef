"""Resuming on another number of ranks with real processes: a 1-rank ZeRO-2 run with EMA, checkpointed at step 2,
continued on 2 ranks (micro 2 x accumulation 2 x 1 rank -> micro 2 x accumulation 1 x 2 ranks, the same global
batch) trains steps 3-4 exactly as the uninterrupted run did: same losses, LR, weights and EMA.

Two launches (the run, the resume), shared through the module fixture. The other direction (2 -> 1 rank) is tested
on the runs tests/dist/test_train.py (ZeRO-2) and test_lora_ema_runs.py (ZeRO-3, LoRA, EMA) already make; the
refusal of a changed global batch is decided before any process group (tests/unit/test_resume_plan.py)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from harness import base_spec, explain, launch, metrics, write_spec

pytestmark = pytest.mark.dist

STEPS = 4
TAG = "step-00000002"


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("elastic")
    run_dir, resumed = root / "run", root / "resumed"
    spec = base_spec(run_dir, train={"global_batch_size": 4, "micro_batch_size": 2, "gradient_accumulation_steps": None,
                                     "max_steps": STEPS, "ema": {"decay": 0.8, "device": "cpu"}},
                     deepspeed={"zero_stage": 2}, output={"save_every_steps": 2, "keep_last": 5})
    spec_path = write_spec(root / "spec.yaml", spec)
    out = {"run": (run_dir, launch(spec_path, num_ranks=1))}
    if out["run"][1].returncode == 0:
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(run_dir / "checkpoints" / TAG, resumed / "checkpoints" / TAG)
        (resumed / "checkpoints" / "latest").write_text(TAG)
        out["before"] = _digest(resumed / "checkpoints" / TAG)
        out["resumed"] = (resumed, launch(spec_path, num_ranks=2, args=(
            "--resume", "latest", "--set", f"output.dir={resumed}")))
    return out


def _ok(runs, name) -> Path:
    assert name in runs, explain(runs["run"][1])
    run_dir, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    return run_dir


def test_two_ranks_continue_a_one_rank_run_exactly(runs):
    run_dir, resumed = _ok(runs, "run"), _ok(runs, "resumed")
    out = runs["resumed"][1].stdout
    assert "written by 1 rank, continued on 2" in out
    assert "universal checkpoint for 2 ranks" in out
    first, second = metrics(run_dir), metrics(resumed)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)
        assert after["lr"] == pytest.approx(before["lr"]) and after["samples"] == before["samples"]


def test_weights_and_ema_after_the_resume_are_the_uninterrupted_runs(runs):
    from dstune.ema import consolidated_ema
    from dstune.export import consolidated_state_dict

    run_dir, resumed = _ok(runs, "run"), _ok(runs, "resumed")
    tag = f"step-{STEPS:08d}"
    for load in (lambda d: consolidated_state_dict(d / "checkpoints", tag, 2),
                 lambda d: consolidated_ema(d / "checkpoints" / tag)):
        a, b = load(run_dir), load(resumed)
        scale = max(v.abs().max().item() for v in a.values())
        assert max((a[k] - b[k]).abs().max().item() for k in a) / scale < 1e-5
    shares = [torch.load(resumed / "checkpoints" / tag / f"ema_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all((s["world_size"], s["optimizer_steps"], s["updates"]) == (2, STEPS, STEPS) for s in shares)


def test_the_checkpoint_read_is_left_as_it_was_and_the_converted_copy_is_gone(runs):
    resumed = _ok(runs, "resumed")
    assert _digest(resumed / "checkpoints" / TAG) == runs["before"]
    assert not (resumed / ".resume-universal").exists()
