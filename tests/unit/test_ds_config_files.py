"""Real-world DeepSpeed JSON files (tests/data/deepspeed_configs, sources in its README.md) given as deepspeed.config
beside a minimal spec: each one is compiled, with its own values wherever the spec is silent, or refused naming
one of its own keys; and the plan says where every DeepSpeed value came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dstune.cli import main
from dstune.ds_json.fill_spec import merged_spec
from dstune.ds_json.merge import flatten
from dstune.report import plan_text
from dstune.spec.load import SpecError, json_key_line, load_spec
from dstune.validate import load_and_validate
from dstune.world import world_from_flags

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_configs"
FILES = sorted(DATA.glob("*.json"))
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu")

# File -> the key of its own that the refusal names, and why dstune cannot honour it.
REFUSED = {
    "axolotl__zero1_torch_compile.json": "compile.backend",  # DeepSpeed 0.19.8's compile block has no backend
    "deepspeed__sdma_allgather_ds_config_zero3_nosdma.json": "zero_optimization.sdma_allgather",  # newer DeepSpeed
    "deepspeedexamples__cifar_ds_config.json": "zero_optimization.cpu_offload",  # removed DeepSpeed key
    "deepspeedexamples__expert_parallel_ds_autoep_zero1_qwen3_5_moe.json": "expert_parallel.autoep_size",
    "deepspeedexamples__megatron_ds_zero2_config.json": "activation_checkpointing.partition_activations",
    "deepspeedexamples__megatron_v115_ds_zero_stage_3_config.json": "zero_optimization.stage3_param_persitence_threshold",  # a typo DeepSpeed refuses
    "deepspeedexamples__tensor_parallel_ds_config.json": "tensor_parallel.autotp_size",  # model parallelism
    "llamafactory__ds_z2_autotp_config.json": "tensor_parallel.autotp_size",
    "transformers__tests_deepspeed_ds_config_zero3.json": "zero_optimization.reduce_bucket_size",  # 0: must be > 0
}
# Keys dstune writes under another name than some files use.
RENAMED = {
    "bfloat16": "bf16",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
}


def minimal_spec(tmp_path: Path, config: Path) -> Path:
    """The README's example spec without its deepspeed section and its optimizer values; its batch numbers only when
    the file gives none (a spec must get them from somewhere)."""
    user = json.loads(config.read_text())
    train = {"epochs": 8}
    if not any(isinstance(user.get(key), (int, float)) for key in BATCH_KEYS):
        train = {"micro_batch_size": 4, "global_batch_size": 8, **train}
    spec = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": {"path": "builtin:shapes"},
        "train": train,
        "deepspeed": {"config": str(config)},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def validate(spec_path: Path):
    # fp16 files are planned for the GPUs they are written for (DeepSpeed's CPU accelerator has no fp16)
    return load_and_validate(spec_path, world=lambda: world_from_flags(num_gpus=2), accelerator="cuda")


def _written(key: str) -> str:
    return ".".join(RENAMED.get(part, part) for part in key.split("."))


def test_the_collection():
    assert len(FILES) >= 18
    assert set(REFUSED) <= {path.name for path in FILES}
    assert len(FILES) - len(REFUSED) >= 0.7 * len(FILES)  # at least 70 % validate beside a minimal spec
    readme = (DATA / "README.md").read_text()
    for path in FILES:
        assert f"`{path.name}`" in readme, f"{path.name}: no source in {DATA / 'README.md'}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_file_is_compiled_with_its_values_or_refused_naming_its_key(tmp_path, path):
    user = json.loads(path.read_text())
    spec_path = minimal_spec(tmp_path, path)
    if path.name in REFUSED:
        with pytest.raises(SpecError) as caught:
            validate(spec_path)
        by_key = {issue.key: issue for issue in caught.value.issues}
        issue = by_key.get(REFUSED[path.name])
        assert issue is not None, f"expected {REFUSED[path.name]} among {list(by_key)}"
        assert issue.where == f"{path}:{json_key_line(path.read_text(), issue.key)}" and "\n" not in str(issue)
        return
    resolved = validate(spec_path)
    merged = flatten(resolved.ds_config)
    for key, value in flatten(user).items():
        if value == "auto" or key.split(".")[0] in ("optimizer", "scheduler"):
            continue
        assert merged[_written(key)] == value, key  # the file's own value, where the spec is silent
    train = resolved.spec.train
    params = user.get("optimizer", {}).get("params", {})
    for name in ("lr", "eps", "weight_decay", "betas"):  # dstune builds the optimizer: from the file's values
        if params.get(name, "auto") != "auto":
            assert (
                list(getattr(train.optimizer, name)) == params[name]
                if name == "betas"
                else getattr(train.optimizer, name) == params[name]
            ), name
    if "scheduler" in user:
        assert "scheduler" not in resolved.ds_config  # dstune steps its own schedule
    assert all(source for source in resolved.ds_sources.values()) and set(resolved.ds_sources) == set(merged)


# ------------------------------------------------------------------------------------------------ provenance

PROVENANCE_FILE = """{
  "train_micro_batch_size_per_gpu": "auto",
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": true
  },
  "bf16": {"enabled": true},
  "gradient_clipping": 0.5
}
"""
PROVENANCE_SPEC = """model:
  family: sd
  pretrained: builtin:tiny-sd
data:
  path: builtin:shapes
train:
  micro_batch_size: 2
  global_batch_size: 8
  epochs: 1
deepspeed:
  reduce_bucket_size: 1000000
  config: ds.json
"""


def test_the_plan_says_where_each_deepspeed_value_came_from(tmp_path, capsys):
    (tmp_path / "ds.json").write_text(PROVENANCE_FILE)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(PROVENANCE_SPEC)
    resolved = validate(spec_path)
    ds_json, spec_file = tmp_path / "ds.json", str(spec_path)
    sources = resolved.ds_sources
    assert sources["zero_optimization.stage"] == f"{ds_json}:4"  # the file's value
    assert sources["zero_optimization.overlap_comm"] == f"{ds_json}:5"
    assert sources["bf16.enabled"] == f"{ds_json}:7" and resolved.spec.train.precision == "bf16"
    assert sources["gradient_clipping"] == f"{ds_json}:8" and resolved.ds_config["gradient_clipping"] == 0.5
    assert sources["train_micro_batch_size_per_gpu"] == f"auto at {ds_json}:2 -> {spec_file}:7"
    assert sources["train_batch_size"] == f"{spec_file}:8"  # the spec's value
    assert sources["zero_optimization.reduce_bucket_size"] == f"{spec_file}:11"
    assert sources["gradient_accumulation_steps"] == "plan"  # derived: 8 / (2 x 2 ranks)
    assert sources["zero_optimization.stage3_prefetch_bucket_size"] == "default"  # dstune's rule (0.9 x reduce)
    assert sources["steps_per_print"] == "default"
    text = plan_text(resolved, width=300)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.strip()}
    assert rows["zero_optimization.stage"] == ["3", "<-", f"{ds_json}:4"]
    assert rows["bf16.enabled"] == ["true", "<-", f"{ds_json}:7"]
    assert rows["gradient_accumulation_steps"] == ["2", "<-", "plan"]
    assert "stage 3:" in text and "dstune's own: adamw from train.optimizer" in text
    code = main(["validate", str(spec_path), "--num-gpus", "2", "--accelerator", "cuda", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ds_config_sources"] == sources


def test_a_key_written_in_both_places_names_both_lines(tmp_path):
    (tmp_path / "ds.json").write_text(PROVENANCE_FILE)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(PROVENANCE_SPEC.replace("deepspeed:\n", "deepspeed:\n  zero_stage: 2\n"))
    with pytest.raises(SpecError) as caught:
        validate(spec_path)
    [issue] = caught.value.issues
    assert issue.key == "zero_optimization.stage" and issue.where == f"{tmp_path / 'ds.json'}:4"
    assert f"the spec sets deepspeed.zero_stage: 2 at {spec_path}:11" in issue.message


def test_defaults_yield_to_the_file_and_auto_takes_the_spec_or_default(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                "gradient_clipping": "auto",
                "train_batch_size": 16,
                "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "adam_w_mode": False}},
                "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}},
            }
        )
    )
    spec_path = tmp_path / "spec.yaml"  # no batch numbers, no ZeRO settings
    spec_path.write_text(
        PROVENANCE_SPEC.replace("  micro_batch_size: 2\n  global_batch_size: 8\n", "").replace(
            "  reduce_bucket_size: 1000000\n", ""
        )
    )
    resolved = validate(spec_path)
    spec = resolved.spec
    assert spec.deepspeed.zero_stage == 3 and spec.deepspeed.offload_param.device == "cpu"  # not the default 2
    assert spec.train.global_batch_size == 16 and resolved.plan.micro_batch_size == 8  # 16 / 2 ranks
    assert resolved.ds_config["gradient_clipping"] == 1.0 and resolved.ds_sources["gradient_clipping"].endswith(
        "-> default"
    )  # "auto" with the spec silent: dstune's default
    assert (spec.train.optimizer.type, spec.train.optimizer.lr) == ("adam", 3e-4)
    assert (spec.train.scheduler.type, spec.train.scheduler.warmup_steps) == ("cosine", 5)
    # The file's schedule is the run's: never reported "dropped", and the plan says where it came from.
    assert not [w for w in resolved.warnings if w.key == "scheduler"], resolved.warnings
    from dstune.report import Outcome, plan_text

    row = next(line for line in plan_text(resolved).splitlines() if "optimizer, schedule" in line)
    assert f"the cosine schedule from train.scheduler = the file's scheduler block ({config}:1)" in row
    assert "dropped" not in plan_text(resolved) and Outcome.of(resolved).source is resolved.source


def test_a_filled_value_the_spec_refuses_is_named_at_the_file(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text('{\n  "zero_optimization": {\n    "stage": 2,\n    "allgather_bucket_size": -1\n  }\n}\n')
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(PROVENANCE_SPEC)
    with pytest.raises(SpecError) as caught:
        validate(spec_path)
    [issue] = caught.value.issues
    assert issue.key == "zero_optimization.allgather_bucket_size" and issue.where == f"{config}:4"
    assert "greater than 0" in issue.message and "deepspeed.allgather_bucket_size" in issue.message


def test_an_unreadable_file_is_reported_with_the_spec_errors(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2,}}')
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(PROVENANCE_SPEC.replace("builtin:shapes", str(tmp_path / "no-such-data")))
    with pytest.raises(SpecError) as caught:
        validate(spec_path)
    assert [issue.where for issue in caught.value.issues] == [f"{tmp_path / 'ds.json'}:1", f"{spec_path}:5"]


def test_training_refuses_a_conflict_before_any_process_group(tmp_path):
    (tmp_path / "ds.json").write_text(PROVENANCE_FILE)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(PROVENANCE_SPEC.replace("deepspeed:\n", "deepspeed:\n  zero_stage: 2\n"))
    with pytest.raises(SpecError) as caught:
        merged_spec(*load_spec(spec_path))  # what train.py and `dstune cache` load
    assert [issue.key for issue in caught.value.issues] == ["zero_optimization.stage"]
    spec, source = merged_spec(*load_spec(tmp_path / "spec.yaml", ["deepspeed.zero_stage=3"]))
    assert spec.deepspeed.zero_stage == 3 and spec.train.precision == "bf16"
    assert source.where("train.precision") == f"{tmp_path / 'ds.json'}:7"
