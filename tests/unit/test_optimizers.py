"""The optimizers people bring from other trainers (prodigy, adamw_schedulefree, adamw8bit, muon) and DeepSpeed's bf16
optimizer states: dstune's Prodigy against the authors' package, what each puts in the DeepSpeed JSON, the memory
plan's bytes per parameter, validate's optimizer row, and the combinations refused with their reason. The 2-rank
runs (training, exact resume, measured state sizes) are tests/dist/test_optimizers_two_ranks.py."""

from __future__ import annotations

import copy

import pytest
import torch

from dstune.ds_json.blocks import ONE_SUB_GROUP, compile_ds_config
from dstune.memory.plan import state_bytes_per_param
from dstune.optimizers import Prodigy
from dstune.spec.load import SpecError
from test_ds_config import build, compiled


def _train_both(reference, ours, steps=12):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    optimizers = (reference(model.parameters()), ours(twin.parameters()))
    for _ in range(steps):
        x = torch.randn(5, 8)
        for module, optimizer in zip((model, twin), optimizers):
            optimizer.zero_grad()
            module(x).pow(2).mean().backward()
            optimizer.step()
    return model, twin, optimizers


@pytest.mark.parametrize("settings", [{}, {"weight_decay": 0.01, "d_coef": 2.0}, {"lr": 0.5, "betas": (0.8, 0.99)}])
def test_our_prodigy_takes_the_authors_steps(settings):
    from prodigyopt import Prodigy as Authors

    model, twin, (theirs, ours) = _train_both(
        lambda p: Authors(p, **{"lr": 1.0, **settings}), lambda p: Prodigy(p, **{"lr": 1.0, **settings})
    )
    # the same update; only the float64 accumulation of the estimate's sums differs (below float32's rounding)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert ours.param_groups[0]["d"] == pytest.approx(theirs.param_groups[0]["d"], rel=1e-5)
    assert ours.param_groups[0]["d"] > 1e-5  # the estimate moved off d0 (1e-6)


def test_prodigy_defaults_to_lr_1_and_refuses_batch_scaling_at_its_line():
    train, *_ = build({"optimizer": {"type": "prodigy"}})
    assert train.optimizer.lr == 1.0
    with pytest.raises(SpecError) as err:
        compiled({"optimizer": {"type": "prodigy"}, "lr_scaling": "sqrt", "reference_batch_size": 8})
    assert "train.lr_scaling" in str(err.value) and "estimates its own step size" in str(err.value)


def test_prodigy_with_an_adam_learning_rate_is_warned():
    _, issues, _, _ = compiled({"optimizer": {"type": "prodigy", "lr": 1e-4}})
    assert any(i.key == "train.optimizer.lr" and "Prodigy's lr is 1.0" in i.message for i in issues)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_schedule_free_refuses_a_decay_schedule(schedule):
    with pytest.raises(SpecError) as err:
        compiled({"optimizer": {"type": "adamw_schedulefree"}, "scheduler": {"type": schedule}})
    assert "train.scheduler.type" in str(err.value) and "replaces the decay schedule" in str(err.value)
    compiled(
        {"optimizer": {"type": "adamw_schedulefree"}, "scheduler": {"type": "constant_with_warmup", "warmup_steps": 2}}
    )


@pytest.mark.parametrize("optimizer", ["prodigy", "adamw_schedulefree"])
def test_zero3_keeps_one_sub_group_for_the_optimizers_that_count_steps(optimizer):
    config, *_ = compiled({"optimizer": {"type": optimizer}}, {"zero_stage": 3})
    assert config["zero_optimization"]["sub_group_size"] == ONE_SUB_GROUP
    assert "sub_group_size" not in compiled(None, {"zero_stage": 3})[0]["zero_optimization"]


def test_muon_is_deepspeeds_own_with_both_learning_rates_scaled():
    config, _, plan, _ = compiled(
        {
            "optimizer": {"type": "muon", "lr": 3e-4, "muon_lr": 0.01, "muon_momentum": 0.9},
            "lr_scaling": "linear",
            "reference_batch_size": 4,
            "micro_batch_size": 4,
        },
        {"zero_stage": 3},
    )
    assert plan.lr_scale == 2.0
    assert config["optimizer"]["type"] == "Muon"
    params = config["optimizer"]["params"]
    assert (params["adam_lr"], params["muon_lr"], params["momentum"]) == (6e-4, 0.02, 0.9)
    assert config["zero_optimization"]["reduce_scatter"] is False  # stage3.py refuses Muon with reduce scatter


def test_bf16_optimizer_states_compile_to_deepspeeds_bf16_block():
    config, *_ = compiled(
        {"precision": "bf16"}, {"zero_stage": 2, "offload_optimizer": "cpu", "bf16_optimizer_states": True}
    )
    assert config["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert config["optimizer"]["type"] == "AdamW"  # DeepSpeed's CPU Adam, which keeps the moments in bf16


@pytest.mark.parametrize(
    "train,deepspeed,missing",
    [
        ({}, {"offload_optimizer": "cpu"}, "train.precision bf16"),
        ({"precision": "bf16"}, {}, "offload_optimizer cpu"),
        ({"precision": "bf16", "optimizer": {"type": "lion"}}, {"offload_optimizer": "cpu"}, "optimizer adam or adamw"),
    ],
)
def test_bf16_optimizer_states_refuse_what_deepspeed_cannot_run(train, deepspeed, missing):
    with pytest.raises(SpecError) as err:
        compiled(train, {"zero_stage": 2, "bf16_optimizer_states": True, **deepspeed})
    assert "deepspeed.bf16_optimizer_states" in str(err.value) and missing in str(err.value)


@pytest.mark.parametrize(
    "optimizer,precision,expected",
    [
        ("prodigy", "fp32", 16.0),
        ("adamw_schedulefree", "fp32", 8.0),
        ("adamw8bit", "fp32", 2.03125),
        ("muon", "fp32", 4.0),
        ("prodigy", "bf16", 20.0),  # with the fp32 master copy
    ],
)
def test_the_memory_plan_counts_each_optimizers_state(optimizer, precision, expected):
    assert state_bytes_per_param(optimizer, precision, 2) == expected
    assert state_bytes_per_param("adamw", "bf16", 2, bf16_states=True) == 6.0


def test_every_new_optimizer_compiles_to_a_config_deepspeed_accepts_at_every_stage():
    from dstune.ds_json.cross_check import cross_check

    for optimizer in ("prodigy", "adamw_schedulefree", "adamw8bit", "muon"):
        for stage in range(4):
            train, deepspeed, plan, source = build({"optimizer": {"type": optimizer}}, {"zero_stage": stage})
            config, _ = compile_ds_config(train, deepspeed, plan, source)
            assert cross_check(config, plan, source) == [], (optimizer, stage)
