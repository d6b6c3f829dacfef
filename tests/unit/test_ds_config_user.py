"""A user's own DeepSpeed JSON (`deepspeed.config`): its values fill what the spec leaves unset, "auto" filled,
conflicts named by key, DeepSpeed's refusals in one line. Runs the accelerate, transformers-tests and LLaMA-Factory
files of tests/data/deepspeed_configs (every file there: tests/unit/test_ds_config_files.py)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from dstune.ds_json.fill_spec import apply_ds_file
from dstune.ds_json.blocks import compile_ds_config, find_auto, uses_deepspeed_optimizer
from dstune.ds_json.cross_check import cross_check
from dstune.ds_json.merge import KNOWN_TOP_LEVEL_KEYS, OWNED, json_key_line
from dstune.plan import make_plan
from dstune.spec.load import SpecError, SpecSource, validate_data
from dstune.world import use_cpu_accelerator_if_no_cuda

SHARED_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "deepspeed_configs"
CONFIG_FILES = sorted(
    p for p in SHARED_CONFIGS.glob("*.json") if p.name.split("__")[0] in ("accelerate", "transformers", "llamafactory")
)
SCHEDULES = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def compile_with(tmp_path: Path, user: dict | str | Path, train=None, deepspeed=None, lines=None, world_size=2):
    """Write `user` next to a spec (unless it is a path already) and compile; returns (config, issues, plan, path)."""
    if isinstance(user, Path):
        path = user
    else:
        path = tmp_path / "ds.json"
        path.write_text(user if isinstance(user, str) else json.dumps(user, indent=2))
    source = SpecSource(str(tmp_path / "spec.yaml"), dict(lines or {}))
    data = {
        "model": {"family": "sd"},
        "train": {"micro_batch_size": 4, "max_steps": 100, **(train or {})},
        "deepspeed": {**(deepspeed or {}), "config": str(path)},
    }
    spec, source, conflicts = apply_ds_file(validate_data(data, source), source)  # as dstune.validate does
    plan = make_plan(
        spec.train,
        types.SimpleNamespace(world_size=world_size, num_nodes=1, ranks_per_node=(world_size,)),
        100_000,
        source,
    )
    try:
        config, issues = compile_ds_config(spec.train, spec.deepspeed, plan, source)
    except SpecError as err:  # a conflict is named by both stages; validate keeps the first (both places)
        first = {(i.key, i.where) for i in conflicts}
        raise SpecError(conflicts + [i for i in err.issues if (i.key, i.where) not in first]) from None
    if conflicts:
        raise SpecError(conflicts)
    return config, issues, plan, source, path


def errors_of(tmp_path, user, **kwargs) -> list:
    with pytest.raises(SpecError) as caught:
        compile_with(tmp_path, user, **kwargs)
    return caught.value.issues


def _concrete(value) -> bool:
    return value is not None and value != "auto"


def matching_spec(user: dict) -> tuple[dict, dict]:
    """(train, deepspeed) spec sections that agree with every concrete value the file sets."""
    zero = user.get("zero_optimization", {})
    deepspeed = {"zero_stage": zero.get("stage", 0)}
    for name in ("offload_optimizer", "offload_param"):
        if _concrete(zero.get(name, {}).get("device")):
            deepspeed[name] = zero[name]["device"]
    train = {}
    if _concrete(user.get("gradient_accumulation_steps")):
        train["gradient_accumulation_steps"] = user["gradient_accumulation_steps"]
    if user.get("fp16", {}).get("enabled") is True:
        train["precision"] = "fp16"
    params = user.get("optimizer", {}).get("params", {})
    optimizer = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if _concrete(params.get(k))}
    if optimizer:
        train["optimizer"] = optimizer
    if "scheduler" in user:
        train["scheduler"] = {"type": SCHEDULES[user["scheduler"]["type"]]}
        steps = user["scheduler"].get("params", {}).get("warmup_num_steps")
        if _concrete(steps):
            train["scheduler"]["warmup_steps"] = steps
            train["max_steps"] = 10 * steps
    return train, deepspeed


def flat(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, v in value.items():
        out.update(flat(v, f"{prefix}{key}.") if isinstance(v, dict) else {f"{prefix}{key}": v})
    return out


# ------------------------------------------------------------------------------------ the shared real files


def test_the_shared_folder_has_configs():
    assert len(CONFIG_FILES) >= 10, f"expected the DeepSpeed JSON collection in {SHARED_CONFIGS}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shared_file_with_a_mismatching_spec_lists_conflicts_by_key(tmp_path, path):
    user = json.loads(path.read_text())
    try:
        compile_with(tmp_path, path, train={"precision": "bf16"}, deepspeed={"zero_stage": 1})
    except SpecError as err:
        for issue in err.issues:
            assert "\n" not in str(issue)
            assert issue.where.startswith(str(path)), issue  # every conflict points into the file
            assert issue.key in flat(user) or any(k.startswith(issue.key + ".") for k in flat(user)), issue
    else:
        assert user["zero_optimization"]["stage"] == 1 or user["zero_optimization"]["stage"] == "auto"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shared_file_with_a_matching_spec_fills_every_auto_or_fails_in_one_line(tmp_path, path):
    user = json.loads(path.read_text())
    train, deepspeed = matching_spec(user)
    if "tensor_parallel" in user:  # LLaMA-Factory's autotp file: dstune is data-parallel only
        [issue] = errors_of(tmp_path, path, train=train, deepspeed=deepspeed)
        assert issue.key == "tensor_parallel.autotp_size" and issue.where.startswith(str(path))
        return
    if user.get("zero_optimization", {}).get("reduce_bucket_size") == 0:
        # transformers' old zero3 test file: the spec (and DeepSpeed 0.19.8) require reduce_bucket_size > 0
        [issue] = errors_of(tmp_path, path, train=train, deepspeed=deepspeed)
        assert issue.key == "zero_optimization.reduce_bucket_size" and "greater than 0" in issue.message
        assert issue.where == f"{path}:{json_key_line(path.read_text(), issue.key)}" and "\n" not in str(issue)
        return
    config, issues, plan, source, _ = compile_with(tmp_path, path, train=train, deepspeed=deepspeed)
    assert find_auto(config) == [] and "scheduler" not in config
    assert all(issue.severity == "warning" for issue in issues)
    assert cross_check(config, plan, source, str(path)) == []
    merged = flat(config)
    for key, value in flat(user).items():  # keys the spec does not decide are kept as written
        top = key.split(".")[0]
        if value != "auto" and key not in OWNED and top in ("zero_optimization", "fp16", "bf16", "steps_per_print"):
            assert merged.get(key.replace("fp16_weights", "16bit_weights")) == value, key


def test_auto_is_filled_from_the_spec_and_plan(tmp_path):
    user = json.loads((SHARED_CONFIGS / "accelerate__tests_ds_config_zero3.json").read_text())
    train = {
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "precision": "bf16",
        "gradient_clipping": 0.5,
        "optimizer": {"lr": 3e-4, "weight_decay": 0.05},
    }
    deepspeed = {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "reduce_bucket_size": 1_000_000}
    config, *_ = compile_with(tmp_path, user, train=train, deepspeed=deepspeed, world_size=4)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (8, 2)
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True} and config["fp16"]["enabled"] is False
    assert config["optimizer"]["params"]["lr"] == 3e-4 and config["optimizer"]["params"]["weight_decay"] == 0.05
    assert config["optimizer"]["params"]["torch_adam"] is True  # the file's extra params stay
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1_000_000
    assert zero["stage3_prefetch_bucket_size"] == 900_000 and zero["stage3_param_persistence_threshold"] == 10_000
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero["sub_group_size"] == 1e9  # not covered by the spec: as written


# ---------------------------------------------------------------------------------------------- conflicts


def test_every_conflict_is_reported_at_once_with_key_line_both_values_and_fix(tmp_path):
    """Only keys written in both places conflict; the file's other values fill the spec (and meet its rules)."""
    user = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    issues = errors_of(
        tmp_path,
        user,
        train={"optimizer": {"type": "adafactor"}},
        deepspeed={"zero_stage": 2},
        lines={"deepspeed.zero_stage": 7},
    )
    by_key = {issue.key: issue for issue in issues}
    assert set(by_key) == {"train_micro_batch_size_per_gpu", "zero_optimization.stage", "gradient_clipping"}
    text = (tmp_path / "ds.json").read_text()
    for key, issue in by_key.items():
        assert issue.where == f"{tmp_path / 'ds.json'}:{json_key_line(text, key)}" and "\n" not in str(issue)
    stage = by_key["zero_optimization.stage"]
    assert "3 in the file" in stage.message and "the spec sets deepspeed.zero_stage: 2 at" in stage.message
    assert "spec.yaml:7" in stage.message
    assert "train.micro_batch_size: 4" in by_key["train_micro_batch_size_per_gpu"].message
    # clipping is unset in the spec: the file's 1.0 fills it, and the adafactor rule refuses it at the file's line
    assert "adafactor" in by_key["gradient_clipping"].message
    assert (
        "fills train.gradient_clipping" in by_key["gradient_clipping"].message
        or "value for train.gradient_clipping" in by_key["gradient_clipping"].message
    )


def test_spec_defaults_yield_to_the_file_unless_the_spec_wrote_them(tmp_path):
    user = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True}}
    config, *_ = compile_with(tmp_path, user)
    assert config["zero_optimization"]["reduce_bucket_size"] == 5e8 and config["zero_optimization"]["overlap_comm"]
    [issue] = errors_of(
        tmp_path, user, deepspeed={"reduce_bucket_size": 1000}, lines={"deepspeed.reduce_bucket_size": 9}
    )
    assert issue.key == "zero_optimization.reduce_bucket_size" and "spec.yaml:9" in issue.message


@pytest.mark.parametrize(
    "user,train,deepspeed,key",
    [
        (
            {"zero_allow_untested_optimizer": False},
            {"optimizer": {"type": "lion"}},
            {"zero_stage": 2},
            "zero_allow_untested_optimizer",
        ),
        (
            {"zero_force_ds_cpu_optimizer": True},
            {"optimizer": {"type": "sgd"}},
            {"zero_stage": 2, "offload_optimizer": "cpu"},
            "zero_force_ds_cpu_optimizer",
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}},
            {},
            {"zero_stage": 3},
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        ),
        ({"gradient_clipping": None}, {}, {}, "gradient_clipping"),
        ({"tensor_parallel": {"autotp_size": 2}}, {}, {}, "tensor_parallel.autotp_size"),
        ({"sequence_parallel_size": 2}, {}, {}, "sequence_parallel_size"),
        ({"zero_optimization": {"cpu_offload": True}}, {}, {}, "zero_optimization.cpu_offload"),
        ({"zero_optimization": True}, {}, {}, "zero_optimization"),
        ({"fp16": True}, {}, {}, "fp16"),
        (
            {"zero_optimization": {"stage3_max_live_parameters": "auto"}},
            {},
            {},
            "zero_optimization.stage3_max_live_parameters",
        ),
    ],
)
def test_values_dstune_cannot_accept(tmp_path, user, train, deepspeed, key):
    issues = errors_of(tmp_path, user, train=train, deepspeed=deepspeed)
    assert [issue.key for issue in issues] == [key]


# -------------------------------------------------------------------------------------- optimizer, scheduler


def test_optimizer_block_without_offload_is_dropped_with_a_warning(tmp_path):
    user = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
    config, issues, *_ = compile_with(tmp_path, user)
    assert not uses_deepspeed_optimizer(config)
    [warning] = [i for i in issues if i.key == "optimizer"]
    assert warning.severity == "warning" and "torch_adam" in warning.message


def test_deepspeed_adam_is_adamw_unless_adam_w_mode_is_false(tmp_path):
    offload = {"zero_stage": 2, "offload_optimizer": "cpu"}
    [issue] = errors_of(
        tmp_path, {"optimizer": {"type": "Adam"}}, train={"optimizer": {"type": "adam"}}, deepspeed=offload
    )
    assert issue.key == "optimizer.type" and "adam_w_mode" in issue.message
    user = {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}
    config, *_ = compile_with(tmp_path, user, train={"optimizer": {"type": "adam"}}, deepspeed=offload)
    assert config["optimizer"]["type"] == "Adam" and config["optimizer"]["params"]["adam_w_mode"] is False
    config, *_ = compile_with(tmp_path, {"optimizer": {"type": "Adam"}}, deepspeed=offload)  # spec adamw
    assert config["optimizer"]["type"] == "AdamW"


def test_optimizer_conflicts(tmp_path):
    user = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "max_grad_norm": 1.0}}}
    train = {
        "optimizer": {"type": "sgd", "lr": 1e-4},
        "global_batch_size": 16,
        "micro_batch_size": 4,
        "lr_scaling": "sqrt",
        "reference_batch_size": 4,
    }
    issues = {i.key: i for i in errors_of(tmp_path, user, train=train)}
    assert set(issues) == {"optimizer.type", "optimizer.params.lr", "optimizer.params.max_grad_norm"}
    assert "lr_scaling 2" in issues["optimizer.params.lr"].message and "0.0002" in issues["optimizer.params.lr"].message


def test_a_scheduler_block_that_repeats_the_specs_schedule_is_pointed_at(tmp_path):
    """Both the spec and the file give the schedule: the run's schedule is the spec's (which the file's agrees
    with), stepped by dstune; the warning says so, never that anything was "dropped"."""
    user = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    lines = {"train.scheduler": 7, "train.scheduler.type": 8}
    train = {"scheduler": {"type": "cosine", "warmup_steps": 10}}
    config, issues, *_ = compile_with(tmp_path, user, train=train, lines=lines)
    assert "scheduler" not in config
    [warning] = issues
    assert warning.key == "scheduler" and warning.severity == "warning" and "dropped" not in warning.message
    assert warning.message.startswith(
        f"repeats train.scheduler ({tmp_path / 'spec.yaml'}:7)"
    ) and "the run's schedule is cosine (10 linear" in (warning.message)
    assert "keep it in one place" in warning.message


def test_scheduler_concrete_values_must_agree(tmp_path):
    user = {
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 50, "warmup_max_lr": 1e-4, "warmup_type": "log"},
        }
    }
    issues = errors_of(tmp_path, user, train={"scheduler": {"type": "cosine", "warmup_steps": 10}})
    assert sorted(i.key for i in issues) == [
        "scheduler.params.warmup_num_steps",
        "scheduler.params.warmup_type",
        "scheduler.type",
    ]
    # HF writes warmup_num_steps 1 for "no warmup" (DeepSpeed >= 0.19.6 refuses 0): the same schedule
    config, *_ = compile_with(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}})
    assert "scheduler" not in config


# ----------------------------------------------------------------------------- names, unknown keys, files


def test_unknown_top_level_keys_warn_with_did_you_mean(tmp_path):
    user = {"gradient_clip": 0.5, "_comment": "a note", "monitor_config": {}}
    config, issues, *_ = compile_with(tmp_path, user)
    warnings = {i.key: i for i in issues}
    assert set(warnings) == {"gradient_clip", "monitor_config"}
    assert "did you mean 'gradient_clipping'?" in warnings["gradient_clip"].message
    assert config["gradient_clipping"] == 1.0 and config["_comment"] == "a note"


def test_old_names_are_read_as_the_new_ones(tmp_path):
    user = {
        "bfloat16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "stage3_gather_fp16_weights_on_model_save": True,
            "prefetch_bucket_size": 1000,
        },
    }
    config, issues, plan, source, _ = compile_with(
        tmp_path, user, train={"precision": "bf16"}, deepspeed={"zero_stage": 3}
    )
    assert "bfloat16" not in config and config["bf16"] == {"enabled": True}
    zero = config["zero_optimization"]
    assert "stage3_gather_fp16_weights_on_model_save" not in zero and zero["stage3_prefetch_bucket_size"] == 1000
    assert {i.key for i in issues} == {"bfloat16", "zero_optimization.stage3_gather_fp16_weights_on_model_save"}
    assert cross_check(config, plan, source) == []


@pytest.mark.parametrize(
    "text,line", [('{\n  "train_batch_size": 8,\n  "fp16": {\n}', 4), ('{\n  "a": 1,\n  "b": 2,,\n}', 3)]
)
def test_invalid_json_names_file_and_line(tmp_path, text, line):
    [issue] = errors_of(tmp_path, text)
    assert issue.where == f"{tmp_path / 'ds.json'}:{line}" and "not valid JSON" in issue.message


def test_duplicate_keys_and_non_objects_are_refused(tmp_path):
    [issue] = errors_of(tmp_path, '{\n "fp16": {"enabled": true},\n "fp16": {"enabled": false}\n}')
    assert issue.key == "fp16" and issue.where.endswith("ds.json:3")
    [issue] = errors_of(tmp_path, "[1, 2]")
    assert "JSON object" in issue.message


def test_missing_file_names_the_path_relative_to_the_spec(tmp_path):
    source = SpecSource(str(tmp_path / "spec.yaml"), {"deepspeed.config": 12})
    spec = validate_data(
        {
            "model": {"family": "sd"},
            "train": {"micro_batch_size": 1, "max_steps": 1},
            "deepspeed": {"config": "configs/none.json"},
        },
        source,
    )
    plan = make_plan(spec.train, types.SimpleNamespace(world_size=1, num_nodes=1, ranks_per_node=(1,)), 10, source)
    with pytest.raises(SpecError) as caught:
        compile_ds_config(spec.train, spec.deepspeed, plan, source)
    [issue] = caught.value.issues
    assert issue.key == "deepspeed.config" and issue.where == f"{tmp_path / 'spec.yaml'}:12"
    assert str(tmp_path / "configs" / "none.json") in issue.message


@pytest.mark.parametrize(
    "user,key,expected",
    [
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_sise": 10}},
            "zero_optimization.reduce_bucket_sise",
            "did you mean 'reduce_bucket_size'?",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
            "zero_optimization.offload_optimizer.pin_memroy",
            "did you mean 'pin_memory'?",
        ),
        ({"fp16": {"enabled": "auto", "loss_scale": -1}}, "fp16.loss_scale", "loss_scale must be >= 0"),
        ({"amp": {"enabled": True}}, "", "Apex AMP integration has been removed"),
    ],
)
def test_keys_deepspeed_refuses_give_one_line_naming_key_and_file(tmp_path, user, key, expected):
    config, issues, plan, source, path = compile_with(
        tmp_path,
        user,
        deepspeed={
            "offload_optimizer": user.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
        },
    )
    [issue] = cross_check(config, plan, source, str(path))
    assert issue.key == key and expected in issue.message and "\n" not in str(issue)
    assert issue.where.startswith(str(path))


def test_known_top_level_keys_are_the_ones_deepspeed_reads():
    """DeepSpeed ignores unknown top-level keys, so dstune keeps its own list; record what DeepSpeedConfig reads."""
    use_cpu_accelerator_if_no_cuda()
    from deepspeed.runtime.config import DeepSpeedConfig

    read = set()

    class Keys(set):
        def __contains__(self, key):
            read.add(key)
            return set.__contains__(self, key)

    class Recording(dict):
        def get(self, key, *default):
            read.add(key)
            return dict.get(self, key, *default)

        def __contains__(self, key):
            read.add(key)
            return dict.__contains__(self, key)

        def __getitem__(self, key):
            read.add(key)
            return dict.__getitem__(self, key)

        def keys(self):
            return Keys(dict.keys(self))

        def __copy__(self):
            return self

    DeepSpeedConfig(Recording(train_micro_batch_size_per_gpu=1))
    assert read == KNOWN_TOP_LEVEL_KEYS - {"sequence_parallel_size", "data_parallel_size"}
