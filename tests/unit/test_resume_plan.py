"""Resuming on another world: the decision (keep the global batch or refuse with options that work), the arithmetic
of --allow-batch-change, which checkpoints need re-partitioning, and the refusal before any process group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dstune.plan import make_plan, resolve_batch
from dstune.checkpoints.resume_plan import (
    ALLOW_FLAG,
    SavedRun,
    batch_refusal,
    is_partitioned,
    keep_batch_options,
    rebatched,
    reshard_refusal,
    resume_kind,
)
from dstune.spec.load import SpecSource, load_spec
from dstune.spec.models import TrainSpec
from dstune.world import World

SOURCE = SpecSource("spec.yaml")
# A checkpoint of 2 ranks x micro 2 x accumulation 1 (global 4), 64 steps per epoch, saved after step 70.
SAVED = SavedRun(
    world_size=2,
    micro_batch_size=2,
    gradient_accumulation_steps=1,
    global_batch_size=4,
    steps_per_epoch=64,
    total_steps=200,
    global_step=70,
    epoch=1,
    step_in_epoch=6,
    samples_seen=280,
)


def _world(n: int) -> World:
    return World(world_size=n, num_nodes=1, ranks_per_node=(n,), hosts=("localhost",), source="test")


def _train(**batch) -> TrainSpec:
    return TrainSpec(max_steps=200, **batch)


def test_a_spec_giving_the_global_batch_keeps_it_on_any_world_that_divides_it():
    train = _train(global_batch_size=4, micro_batch_size=1)
    for world in (1, 2, 4):
        assert batch_refusal(train, world, SAVED, SOURCE, "ckpt", allow_change=False) is None
        assert resume_kind(SAVED, world, resolve_batch(train, world, SOURCE)[2]) == (
            "same" if world == 2 else "reshard"
        )


def test_a_changed_global_batch_is_refused_with_options_that_really_keep_it(tmp_path):
    train = _train(micro_batch_size=2, gradient_accumulation_steps=1)  # global = 2 x 1 x world: 2 on one rank
    message = batch_refusal(train, 1, SAVED, SOURCE, "checkpoint RUN/checkpoints/step-00000070", allow_change=False)
    assert "global batch of 4 (micro 2 x accumulation 1 x 2 ranks)" in message
    assert "would train with a global batch of 2 (micro 2 x accumulation 1 x 1 rank)" in message
    assert "launch 2 ranks, as the checkpoint was written" in message and ALLOW_FLAG in message
    options = keep_batch_options(train, 1, 4, SOURCE)
    assert options[0].startswith("--set train.gradient_accumulation_steps=2 ")  # the spec's micro batch first
    assert len(options) == 3 and all(option in message for option in options)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
                "data": {"path": "builtin:shapes"},
                "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 200},
            }
        )
    )
    for option in options:  # every option, given as printed, makes the spec plan the checkpoint's global batch
        overrides = option.split("(")[0].replace("--set ", "").split()
        spec, source = load_spec(str(spec_file), overrides)
        assert resolve_batch(spec.train, 1, source)[2] == 4


def test_a_spec_that_names_another_global_batch_is_told_to_set_it_back():
    message = batch_refusal(_train(global_batch_size=8, micro_batch_size=2), 1, SAVED, SOURCE, "ckpt", False)
    assert "--set train.global_batch_size=4   (micro 2 x accumulation 2 x 1 rank)" in message
    assert "launch 2 ranks" not in message  # this spec gives 8 on 2 ranks too


def test_a_world_that_cannot_split_the_global_batch_lists_the_rank_counts_that_can():
    message = batch_refusal(_train(micro_batch_size=2), 3, SAVED, SOURCE, "ckpt", False)
    assert "4 samples cannot be split evenly over 3 ranks" in message and "(1, 2, 4)" in message


def test_the_flag_allows_another_global_batch_and_nothing_else_is_refused():
    train = _train(micro_batch_size=2)
    assert batch_refusal(train, 1, SAVED, SOURCE, "ckpt", allow_change=True) is None
    assert batch_refusal(_train(global_batch_size=6), 4, SAVED, SOURCE, "ckpt", False) is None  # validate's error


def test_a_batch_change_continues_at_the_same_sample_and_states_the_new_schedule():
    train = _train(micro_batch_size=2)  # global 2 on one rank: 128 steps per epoch of 256 samples
    plan = make_plan(train, _world(1), 256, SOURCE)
    changed = rebatched(SAVED, plan, train)
    assert (changed.epoch, changed.step_in_epoch) == (1, 12)  # 6 steps of 4 = 24 samples = 12 steps of 2
    assert changed.plan.total_steps == 200  # train.max_steps counts optimizer steps, whatever their size
    assert changed.plan.samples_seen == 280 + 130 * 2
    assert "global batch 4 -> 2" in changed.text and "steps per epoch 64 -> 128" in changed.text
    by_epochs = TrainSpec(epochs=3, micro_batch_size=2)
    changed = rebatched(SAVED, make_plan(by_epochs, _world(1), 256, SOURCE), by_epochs)
    assert changed.plan.total_steps == 70 + (3 - 1) * 128 - 12  # ends where the third epoch ends
    odd = TrainSpec(max_steps=200, micro_batch_size=5)  # 24 samples done: 4 whole batches of 5, 4 samples again
    assert rebatched(SAVED, make_plan(odd, _world(1), 256, SOURCE), odd).step_in_epoch == 4


def _checkpoint(root: Path, world: int, optimizer: str, partitioned: bool, global_batch: int = 4) -> Path:
    folder = root / "checkpoints" / "step-00000002"
    folder.mkdir(parents=True)
    if partitioned:
        for rank in range(world):
            (folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    plan = {
        "micro_batch_size": 2,
        "gradient_accumulation_steps": global_batch // (2 * world),
        "global_batch_size": global_batch,
        "steps_per_epoch": 64,
        "total_steps": 4,
    }
    state = {"global_step": 2, "epoch": 0, "step_in_epoch": 2, "samples_seen": 8}
    (folder / "dstune_state.json").write_text(
        json.dumps(
            {"state": state, "world_size": world, "plan": plan, "spec": {"train": {"optimizer": {"type": optimizer}}}}
        )
    )
    (root / "checkpoints" / "latest").write_text(folder.name)
    return folder


def test_only_partitioned_non_adam_state_cannot_move_to_another_world(tmp_path):
    zero2 = _checkpoint(tmp_path / "a", 2, "sgd", partitioned=True)
    assert is_partitioned(zero2)
    message = reshard_refusal(zero2, "sgd", 2, 1)
    assert "carries Adam's state only" in message and "Relaunch with 2 ranks" in message
    assert reshard_refusal(zero2, "adamw", 2, 1) is None and reshard_refusal(zero2, "sgd", 2, 2) is None
    zero0 = _checkpoint(tmp_path / "b", 2, "sgd", partitioned=False)  # whole optimizer state: any world
    assert not is_partitioned(zero0) and reshard_refusal(zero0, "sgd", 2, 1) is None


@pytest.mark.parametrize("world", ["1", "4"])
def test_train_refuses_a_changed_global_batch_before_any_process_group(tmp_path, monkeypatch, capsys, world):
    import torch.distributed as dist

    from dstune.train import main

    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 2, "adamw", partitioned=True)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
                "data": {"path": "builtin:shapes"},
                "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4},
                "output": {"dir": str(run_dir)},
            }
        )
    )
    monkeypatch.setenv("WORLD_SIZE", world)  # as the launcher sets it on each rank
    monkeypatch.setenv("RANK", "0")
    assert main([str(spec), "--resume", "latest"]) == 1
    err = capsys.readouterr().err
    assert "cannot resume:" in err and "global batch of 4" in err and ALLOW_FLAG in err
    assert ("--set train.gradient_accumulation_steps=2" if world == "1" else "--set train.micro_batch_size=1") in err
    assert not dist.is_initialized()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-00000002"]


def test_a_batch_change_puts_the_new_schedule_in_place_from_the_step_reached():
    """Loading a checkpoint restores the old LambdaLR multiplier and base LRs; follow_plan_schedule replaces both, and
    the LR of the next step is the new schedule's at the step the checkpoint reached."""
    import math
    from types import SimpleNamespace

    import torch

    from dstune.engine import LrMultiplier, follow_plan_schedule

    old = TrainSpec(max_steps=4, micro_batch_size=2)
    new = TrainSpec(max_steps=8, micro_batch_size=2, scheduler={"type": "cosine"}, optimizer={"lr": 0.002})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.001)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LrMultiplier(old.scheduler, 4))
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    follow_plan_schedule(SimpleNamespace(lr_scheduler=scheduler), new, make_plan(new, _world(1), 256, SOURCE))
    cosine = [0.002 * 0.5 * (1 + math.cos(math.pi * step / 8)) for step in range(9)]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cosine[2])
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cosine[3]) and scheduler.get_last_lr()[0] == pytest.approx(
        cosine[3]
    )


def test_a_resume_puts_the_specs_optimizer_settings_back_over_the_checkpoints():
    """Loading a checkpoint puts its param groups back (LR, weight decay, betas); follow_plan_schedule with the
    schedule's saved length makes them the spec's, and with the same spec leaves every value as loaded."""
    from types import SimpleNamespace

    import torch

    from dstune.engine import LrMultiplier, follow_plan_schedule

    old = TrainSpec(max_steps=4, micro_batch_size=2, scheduler={"type": "linear"})
    new = TrainSpec(
        max_steps=8,
        micro_batch_size=2,
        scheduler={"type": "linear"},
        optimizer={"lr": 0.01, "weight_decay": 0.5, "betas": (0.8, 0.9)},
    )
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LrMultiplier(old.scheduler, 4))
    optimizer.step()
    scheduler.step()
    loaded = dict(optimizer.param_groups[0])
    engine = SimpleNamespace(lr_scheduler=scheduler)
    follow_plan_schedule(engine, old, make_plan(old, _world(1), 256, SOURCE), 4)
    assert {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} == {
        k: v for k, v in loaded.items() if k != "params"
    }
    follow_plan_schedule(engine, new, make_plan(new, _world(1), 256, SOURCE), 4)  # the length the run started with
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.01 * 3 / 4) and group["weight_decay"] == 0.5 and group["betas"] == (0.8, 0.9)


def test_the_resume_decision_reads_the_checkpoint_without_torch(tmp_path):
    """`dstune validate --resume-from` decides from the checkpoint's files alone: finding it, reading its state and
    the re-partitioning refusal import no torch (dstune.checkpoints.layout and resume_plan stay torch-free)."""
    _checkpoint(tmp_path, 2, "sgd", partitioned=True)
    script = (
        "import sys; from pathlib import Path; "
        "from dstune.checkpoints.layout import read_state, resolve_resume; "
        "from dstune.checkpoints.resume_plan import reshard_refusal; "
        f"root, tag = resolve_resume(Path({str(tmp_path)!r}), 'latest'); saved = read_state(root, tag); "
        "optimizer = saved['spec']['train']['optimizer']['type']; "
        "print(reshard_refusal(root / tag, optimizer, saved['world_size'], 1)); "
        "assert 'torch' not in sys.modules, 'the resume decision imported torch'"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "written by 2 ranks; this run has 1" in done.stdout and "carries Adam's state only" in done.stdout
