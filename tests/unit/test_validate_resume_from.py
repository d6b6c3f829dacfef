"""`dstune validate SPEC --resume-from RUN_DIR`: what `--resume latest` would do on the validated world, offline
(only the checkpoint's dstune_state.json is read)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dstune.cli import main
from dstune.plan import make_plan
from dstune.spec.load import load_spec
from dstune.world import World

SPEC = {
    "model": {"family": "sd"},
    "data": {"path": "builtin:shapes", "resolution": 32},
    "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 8, "seed": 7},
    "output": {"dir": "runs/x"},
}


def _run_with_checkpoint(tmp_path: Path, world_size: int, optimizer_files: bool = False) -> tuple[Path, Path]:
    """A spec and a run folder whose latest checkpoint (step 2) was written by `world_size` ranks."""
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    spec, source = load_spec(spec_path)
    world = World(world_size=world_size, num_nodes=1, ranks_per_node=(world_size,), hosts=("localhost",), source="test")
    plan = make_plan(spec.train, world, 256, source)
    tag = tmp_path / "run" / "checkpoints" / "step-00000002"
    tag.mkdir(parents=True)
    state = {
        "state": {"global_step": 2, "epoch": 0, "step_in_epoch": 2, "samples_seen": 8},
        "world_size": world_size,
        "tag": tag.name,
        "spec": spec.model_dump(mode="json"),
        "plan": plan.as_dict(),
    }
    (tag / "dstune_state.json").write_text(json.dumps(state))
    (tag.parent / "latest").write_text(tag.name)
    if optimizer_files:
        (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    return spec_path, tmp_path / "run"


def test_same_world_resumes_and_lists_safe_changes(tmp_path, capsys):
    spec_path, run = _run_with_checkpoint(tmp_path, 2)
    code = main(
        ["validate", str(spec_path), "--num-gpus", "2", "--resume-from", str(run), "--set", "output.save_every_steps=1"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "step 2 of 8" in out and "written by micro 2 x accumulation 1 x 2 ranks" in out
    assert "DeepSpeed loads its own shards" in out and "output.save_every_steps: None -> 1" in out


def test_another_world_with_the_same_global_batch_is_resharded(tmp_path, capsys):
    spec_path, run = _run_with_checkpoint(tmp_path, 2)
    assert main(["validate", str(spec_path), "--num-gpus", "1", "--resume-from", str(run)]) == 0
    assert "continues on 1 rank with the same global batch of 4" in capsys.readouterr().out


def test_a_changed_global_batch_or_seed_is_refused_with_the_options(tmp_path, capsys):
    spec_path, run = _run_with_checkpoint(tmp_path, 2)
    assert (
        main(
            [
                "validate",
                str(spec_path),
                "--num-gpus",
                "1",
                "--resume-from",
                str(run),
                "--set",
                "train.global_batch_size=2",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "refused:" in out and "--set train.global_batch_size=4" in out and "--allow-batch-change" in out
    # One verdict, last, and it is the refusal: never "valid:" above a refusal.
    assert "valid:" not in out and out.strip().splitlines()[-1].startswith("resume refused (above: what to change)")
    assert out.index("refused:") < out.index("resume refused")
    assert (
        main(["validate", str(spec_path), "--num-gpus", "2", "--resume-from", str(run), "--set", "train.seed=8"]) == 1
    )
    assert "train.seed: 7 -> 8" in capsys.readouterr().out


def test_an_sgd_checkpoint_of_another_world_is_refused_and_a_missing_run_is_named(tmp_path, capsys):
    SPEC["train"]["optimizer"] = {"type": "sgd", "lr": 0.1}
    try:
        spec_path, run = _run_with_checkpoint(tmp_path, 2, optimizer_files=True)
    finally:
        del SPEC["train"]["optimizer"]
    assert main(["validate", str(spec_path), "--num-gpus", "1", "--resume-from", str(run)]) == 1
    assert "Adam's state only" in capsys.readouterr().out
    assert main(["validate", str(spec_path), "--num-gpus", "2", "--resume-from", str(tmp_path / "nope")]) == 1
    assert f"--resume-from {tmp_path / 'nope'}: --resume latest: no complete checkpoint" in capsys.readouterr().out


def test_dstune_train_refuses_a_resume_before_launching_and_says_what_to_change(tmp_path, capsys):
    """The same offline checks before `dstune train --resume` starts anything: a refusal lists the options, never
    the refused command again."""
    spec_path, run = _run_with_checkpoint(tmp_path, 2)
    change = ["--set", f"output.dir={run}", "--set", "train.seed=8"]
    assert main(["train", str(spec_path), "--num-gpus", "2", "--resume", "latest", *change]) == 1
    captured = capsys.readouterr()
    assert "master port" not in captured.out + captured.err  # nothing was launched
    assert captured.err.startswith(f"dstune train: not launched: resume from checkpoint {run}/checkpoints/step-")
    assert "train.seed: 7 -> 8" in captured.err and "pass --allow-spec-changes" in captured.err
    assert "continue with: dstune train" not in captured.err
    batch = ["--set", f"output.dir={run}", "--set", "train.global_batch_size=2"]
    assert main(["train", str(spec_path), "--num-gpus", "1", "--resume", "latest", *batch]) == 1
    err = capsys.readouterr().err
    assert "--set train.global_batch_size=4" in err and "--allow-batch-change" in err
    assert (
        main(["train", str(spec_path), "--num-gpus", "2", "--resume", str(run / "nope"), "--set", f"output.dir={run}"])
        == 1
    )
    assert "not a complete dstune checkpoint folder" in capsys.readouterr().err
