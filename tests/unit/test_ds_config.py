"""compile_ds_config (spec + plan -> DeepSpeed dict) and cross_check (DeepSpeed's own config code as the judge)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstune.ds_json.blocks import STEPS_PER_PRINT, compile_ds_config, find_auto, uses_deepspeed_optimizer
from dstune.ds_json.cross_check import cross_check, deepspeed_resolve
from dstune.plan import make_plan
from dstune.spec.load import SpecError, SpecSource, validate_data
from dstune.spec.models import DeepSpeedSpec
from dstune.world import use_cpu_accelerator_if_no_cuda

NUM_SAMPLES = 100_000


def world(world_size: int):
    return types.SimpleNamespace(world_size=world_size, num_nodes=1, ranks_per_node=(world_size,))


def build(train: dict | None = None, deepspeed: dict | None = None, world_size: int = 2):
    """(train spec, deepspeed spec, plan, source) through the real spec validation, as `dstune validate` does."""
    source = SpecSource("spec.yaml")
    train = {"micro_batch_size": 4, "max_steps": 10, **(train or {})}
    spec = validate_data({"model": {"family": "sd"}, "train": train, "deepspeed": deepspeed or {}}, source)
    plan = make_plan(spec.train, world(world_size), NUM_SAMPLES, source)
    return spec.train, spec.deepspeed, plan, source


def compiled(train=None, deepspeed=None, world_size=2):
    t, d, plan, source = build(train, deepspeed, world_size)
    config, issues = compile_ds_config(t, d, plan, source)
    return config, issues, plan, source


# ------------------------------------------------------------------------------------------ the compiled dict

OPTIMIZERS = ("adamw", "adam", "adafactor", "lion", "sgd", "prodigy", "adamw_schedulefree", "adamw8bit", "muon")


def _deepspeed_variants():
    for stage in range(4):
        for opt_off, par_off in itertools.product(("none", "cpu"), ("none", "cpu")):
            if (opt_off != "none" and stage == 0) or (par_off != "none" and stage != 3):
                continue
            yield {"zero_stage": stage, "offload_optimizer": opt_off, "offload_param": par_off}


VARIANTS = [(o, p, d) for o in OPTIMIZERS for p in ("fp32", "bf16", "fp16") for d in _deepspeed_variants()]


@pytest.mark.parametrize("optimizer,precision,deepspeed", VARIANTS, ids=lambda v: str(v))
def test_every_variant_is_complete_without_auto_and_deepspeed_accepts_it(optimizer, precision, deepspeed):
    config, _, plan, source = compiled({"optimizer": {"type": optimizer}, "precision": precision}, deepspeed)
    assert find_auto(config) == []
    assert "scheduler" not in config  # dstune's LR schedule is always a client scheduler
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert type(config[key]) is int
    triad = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    assert tuple(config[k] for k in triad) == (
        plan.global_batch_size,
        plan.micro_batch_size,
        plan.gradient_accumulation_steps,
    )
    assert isinstance(config["gradient_clipping"], float)
    assert config["steps_per_print"] == STEPS_PER_PRINT and config["wall_clock_breakdown"] is False
    assert cross_check(config, plan, source) == []


def test_precision_blocks():
    bf16, *_ = compiled({"precision": "bf16"})
    assert bf16["bf16"] == {"enabled": True} and bf16["fp16"] == {"enabled": False}
    fp32, *_ = compiled({"precision": "fp32"})
    assert fp32["bf16"] == {"enabled": False} and fp32["fp16"] == {"enabled": False}
    fp16, *_ = compiled({"precision": "fp16"})
    assert fp16["bf16"] == {"enabled": False}
    assert fp16["fp16"]["enabled"] is True and fp16["fp16"]["loss_scale"] == 0  # 0 = dynamic loss scaling
    assert fp16["fp16"]["initial_scale_power"] == 16


@pytest.mark.parametrize(
    "train,expected",
    [
        ({"optimizer": {"type": "adamw"}}, 1.0),
        ({"optimizer": {"type": "sgd"}}, 1.0),
        ({"optimizer": {"type": "adafactor"}}, 0.0),
        ({"optimizer": {"type": "adamw"}, "gradient_clipping": 0.5}, 0.5),
        ({"optimizer": {"type": "adafactor"}, "gradient_clipping": 2.0, "allow_clipping_with_adafactor": True}, 2.0),
    ],
)
def test_gradient_clipping_is_always_explicit(train, expected):
    config, *_ = compiled(train)
    assert config["gradient_clipping"] == expected


def test_adafactor_under_zero2_gets_no_clipping_the_untested_flag_and_a_warning():
    config, issues, *_ = compiled({"optimizer": {"type": "adafactor"}}, {"zero_stage": 2})
    assert config["gradient_clipping"] == 0.0
    assert config["zero_allow_untested_optimizer"] is True
    assert "zero_force_ds_cpu_optimizer" not in config
    assert not uses_deepspeed_optimizer(config)
    [warning] = [i for i in issues if i.key == "train.optimizer.type"]
    assert warning.severity == "warning"
    assert "factored second moment" in warning.message and "per-partition" in warning.message


def test_adafactor_without_zero_needs_no_flag_and_no_warning():
    config, issues, *_ = compiled({"optimizer": {"type": "adafactor"}}, {"zero_stage": 0})
    assert "zero_allow_untested_optimizer" not in config
    assert issues == []


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_torch_adam_family_is_a_tested_zero_optimizer(optimizer):
    config, issues, *_ = compiled({"optimizer": {"type": optimizer}}, {"zero_stage": 3})
    assert "zero_allow_untested_optimizer" not in config and "optimizer" not in config
    assert issues == []


@pytest.mark.parametrize("optimizer,ds_type,decoupled", [("adamw", "AdamW", True), ("adam", "Adam", False)])
def test_offloaded_adam_uses_deepspeed_optimizer_block(optimizer, ds_type, decoupled):
    train = {
        "optimizer": {"type": optimizer, "lr": 1e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1},
        "global_batch_size": 64,
        "lr_scaling": "linear",
        "reference_batch_size": 32,
    }
    config, _, plan, _ = compiled(train, {"zero_stage": 2, "offload_optimizer": "cpu"})
    assert uses_deepspeed_optimizer(config)
    assert config["optimizer"] == {
        "type": ds_type,
        "params": {
            "lr": pytest.approx(2e-4),
            "betas": [0.8, 0.99],
            "eps": 1e-6,
            "weight_decay": 0.1,
            "adam_w_mode": decoupled,
        },
    }
    assert plan.effective_lr == pytest.approx(2e-4)
    assert "zero_force_ds_cpu_optimizer" not in config and "zero_allow_untested_optimizer" not in config
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize("optimizer", ["adafactor", "lion", "sgd"])
def test_offloaded_client_optimizer_gets_both_flags_and_a_speed_warning(optimizer):
    config, issues, *_ = compiled({"optimizer": {"type": optimizer}}, {"zero_stage": 1, "offload_optimizer": "cpu"})
    assert "optimizer" not in config
    assert config["zero_allow_untested_optimizer"] is True
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert any(i.key == "deepspeed.offload_optimizer" and i.severity == "warning" for i in issues)


def test_zero_blocks_by_stage():
    zero0, *_ = compiled(deepspeed={"zero_stage": 0})
    assert zero0["zero_optimization"] == {"stage": 0}
    zero2, *_ = compiled(
        deepspeed={"zero_stage": 2, "reduce_bucket_size": 1000, "allgather_bucket_size": 2000, "overlap_comm": True}
    )
    assert zero2["zero_optimization"] == {
        "stage": 2,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 1000,
        "allgather_bucket_size": 2000,
    }
    zero3, *_ = compiled(deepspeed={"zero_stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}})
    block = zero3["zero_optimization"]
    assert block["stage3_gather_16bit_weights_on_model_save"] is True  # export needs it
    assert block["stage3_prefetch_bucket_size"] == 45_000_000 and block["stage3_param_persistence_threshold"] == 70_710
    assert "allgather_bucket_size" not in block
    assert block["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}


def test_activation_checkpointing_block_only_when_deepspeed_features_are_asked_for():
    plain, *_ = compiled(deepspeed={"activation_checkpointing": {"contiguous_memory_optimization": True}})
    assert "activation_checkpointing" not in plain
    # The sd family refuses DeepSpeed's activation checkpointing (see Spec); the compiler itself still writes the
    # block for a deepspeed section that asks for it, as a future family will need.
    train, _, plan, source = build()
    deepspeed = DeepSpeedSpec(activation_checkpointing={"cpu_checkpointing": True, "number_checkpoints": 4})
    asked, _ = compile_ds_config(train, deepspeed, plan, source)
    assert asked["activation_checkpointing"] == {
        "partition_activations": False,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": False,
        "number_checkpoints": 4,
    }


def test_the_sd_family_refuses_deepspeed_activation_checkpointing():
    with pytest.raises(SpecError, match="not supported for model.family sd"):
        build(deepspeed={"activation_checkpointing": {"cpu_checkpointing": True}})


def test_compile_imports_neither_torch_nor_deepspeed():
    import subprocess
    import sys

    code = "import sys, dstune.ds_json; print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------ cross_check


def test_cross_check_names_both_triads_when_the_plan_disagrees():
    config, _, plan, source = compiled({"micro_batch_size": 4})
    wrong_plan = dataclasses.replace(plan, micro_batch_size=2, gradient_accumulation_steps=2)
    [issue] = cross_check(config, wrong_plan, source)
    assert issue.severity == "error" and "\n" not in str(issue)
    assert "8 = micro 4 x accumulation 1 x 2 ranks" in issue.message
    assert "8 = micro 2 x accumulation 2 x 2 ranks" in issue.message


def test_cross_check_resolves_for_the_plan_world_size_not_one():
    config, _, plan, source = compiled({"micro_batch_size": 4}, world_size=8)
    assert config["train_batch_size"] == 32
    assert deepspeed_resolve(config, 8).world_size == 8
    assert cross_check(config, plan, source) == []
    assert cross_check(config, dataclasses.replace(plan, world_size=4), source) != []


def test_cross_check_turns_deepspeed_rejections_into_one_line_issues():
    config, _, plan, source = compiled(deepspeed={"zero_stage": 2})
    typo = {**config, "zero_optimization": {**config["zero_optimization"], "reduce_bucket_sise": 10}}
    [issue] = cross_check(typo, plan, source)
    assert issue.key == "zero_optimization.reduce_bucket_sise" and "did you mean 'reduce_bucket_size'" in issue.message
    assert issue.where == "spec.yaml" and "\n" not in str(issue)
    zero = {**config, "zero_optimization": {**config["zero_optimization"], "reduce_bucket_size": 0}}
    [issue] = cross_check(zero, plan, source)
    assert issue.key == "zero_optimization.reduce_bucket_size" and "greater than 0" in issue.message
    removed = {**config, "amp": {"enabled": True}}
    [issue] = cross_check(removed, plan, source)
    assert "Apex AMP" in issue.message and "\n" not in str(issue)


def test_cross_check_restores_deepspeed_state():
    from deepspeed import comm
    from deepspeed.runtime import config as ds_config_module
    from deepspeed.utils import logger

    config, _, plan, source = compiled()
    level = logger.level
    cross_check({**config, "train_batch_size": 7}, plan, source)
    assert ds_config_module.dist is comm
    assert logger.level == level
    assert not comm.is_initialized()


# ------------------------------------------------------------- the batch triad: our verdict == DeepSpeed's


def deepspeed_verdict(world_size: int, batch, micro, gas):
    """DeepSpeed's own answer for raw numbers, computed the way its TestBatchConfig does: a DeepSpeedConfig whose
    world size and batch fields are set, then its _configure_train_batch_size(). None when it refuses."""
    use_cpu_accelerator_if_no_cuda()
    from deepspeed.runtime.config import DeepSpeedConfig

    ds_config = DeepSpeedConfig({"train_batch_size": 1})  # no process group here: DeepSpeed uses world size 1
    ds_config.world_size = world_size
    ds_config.train_batch_size, ds_config.train_micro_batch_size_per_gpu = batch, micro
    ds_config.gradient_accumulation_steps = gas
    try:
        ds_config._configure_train_batch_size()
    except AssertionError:
        return None
    return ds_config.train_batch_size, ds_config.train_micro_batch_size_per_gpu, ds_config.gradient_accumulation_steps


def dstune_verdict(world_size: int, batch, micro, gas):
    """The plan's triad after compile + cross_check, or None when dstune refuses (always with SpecError)."""
    train = {"max_steps": 1, "global_batch_size": batch, "micro_batch_size": micro, "gradient_accumulation_steps": gas}
    source = SpecSource("spec.yaml")
    try:
        spec = validate_data(
            {"model": {"family": "sd"}, "train": {k: v for k, v in train.items() if v is not None}}, source
        )
        plan = make_plan(spec.train, world(world_size), NUM_SAMPLES, source)
        config, _ = compile_ds_config(spec.train, spec.deepspeed, plan, source)
    except SpecError as err:
        assert err.issues and all("\n" not in str(issue) for issue in err.issues)
        return None
    assert cross_check(config, plan, source) == []
    return plan.global_batch_size, plan.micro_batch_size, plan.gradient_accumulation_steps


SUBSETS = [s for n in (3, 2, 1) for s in itertools.combinations(range(3), n)]


@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "+".join(("batch", "micro", "gas")[i] for i in s))
@pytest.mark.parametrize(
    "batch,micro,gas,success", [(32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False), (32, 18, 1, False)]
)
def test_deepspeed_batch_config_cases(batch, micro, gas, success, subset):
    """DeepSpeed's TestBatchConfig cases (tests/unit/runtime/test_ds_config_dict.py, world size 2), given all three
    numbers, each pair and each single one."""
    raw = [v if i in subset else None for i, v in enumerate((batch, micro, gas))]
    expected = deepspeed_verdict(2, *raw)
    assert dstune_verdict(2, *raw) == expected
    if subset == (0, 1, 2):
        assert (expected is not None) == success


@st.composite
def raw_triads(draw):
    """World size and raw numbers; half the time the batch is a whole multiple, so both verdicts are exercised."""
    world_size, micro, gas = draw(st.integers(1, 64)), draw(st.integers(1, 24)), draw(st.integers(1, 8))
    batch = world_size * micro * gas if draw(st.booleans()) else draw(st.integers(1, 300))
    subset = draw(st.sampled_from(SUBSETS + [()]))
    return world_size, [v if i in subset else None for i, v in enumerate((batch, micro, gas))]


@settings(
    max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(case=raw_triads())
def test_triad_verdict_and_numbers_equal_deepspeed(case):
    """Same verdict and same numbers as DeepSpeed on the raw numbers, for every subset of them.

    DeepSpeed floors (accumulation = batch // micro // world; micro = batch // world // gas) and then asserts
    batch == micro x gas x world with every number > 0, so a floor that lands on 0 or truncates is refused there
    too: within the triad dstune is exactly as strict as DeepSpeed, never stricter. (dstune is stricter only outside
    it: make_plan also refuses a global batch larger than the dataset, and the spec refuses a missing batch number
    with a spec error before any arithmetic; DeepSpeed refuses those cases too.)
    """
    world_size, raw = case
    assert dstune_verdict(world_size, *raw) == deepspeed_verdict(world_size, *raw)


def test_cross_check_is_quiet(caplog):
    config, _, plan, source = compiled()
    with caplog.at_level(logging.DEBUG):
        assert cross_check(config, plan, source) == []
    assert not [r for r in caplog.records if r.name == "DeepSpeed"]
