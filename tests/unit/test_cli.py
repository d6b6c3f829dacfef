"""The `dstune` command surface: validate, compile, schema, init; exit codes 0/1/2; --json; --set.

Most cases run in-process through `dstune.cli.main` (DeepSpeed is imported once per test session); a few run
`python3 -m dstune` as a subprocess, where what matters is the real process: exit status, a clean stdout, imports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dstune.cli import main

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "launch" / "sd-tiny-demo.yaml"


def call(capsys, *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def run_dstune(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dstune", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def write_spec(tmp_path: Path, train: dict, name: str = "spec.yaml", **sections) -> Path:
    spec = {"model": {"family": "sd"}, "train": train, **sections}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# --------------------------------------------------------------------------------------------------- validate


def test_validate_demo_as_a_process_prints_the_plan_and_a_verdict():
    proc = run_dstune("validate", DEMO, "--num-gpus", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    for expected in (
        "World",
        "ranks",
        "2 data-parallel",
        "--num-gpus 2",
        "global batch",
        "8 samples per optimizer step = 4 x 1 x 2 ranks",
        "steps per epoch",
        "32 optimizer steps",
        "samples seen",
        "effective lr",
        "ZeRO",
        "stage 2",
        "gradient clipping",
        "agreed by DeepSpeed",
    ):
        assert expected in text, f"{expected!r} missing from:\n{text}"
    assert text.rstrip().splitlines()[-1].startswith("valid: 2 ranks x micro 4 x accumulation 1 = global batch 8")
    assert "Traceback" not in proc.stderr


def test_validate_without_world_flags_says_the_world_is_assumed(capsys):
    code, out, _ = call(capsys, "validate", DEMO)
    assert code == 0
    assert "ASSUMED" in out and "--num-gpus N" in out


def test_validate_json_is_one_object_with_plan_config_warnings_errors(capsys):
    code, out, _ = call(capsys, "validate", DEMO, "--world-size", "4", "--set", "train.global_batch_size=16", "--json")
    assert code == 0
    report = json.loads(out)
    assert set(report) == {"plan", "ds_config", "ds_config_sources", "warnings", "errors", "memory", "clips"}
    assert report["errors"] == [] and report["clips"] is None  # clips: video families' (tests/unit/test_data_clips)
    assert report["ds_config_sources"]["train_batch_size"] == "--set"  # where each DeepSpeed value came from
    plan, ds_config = report["plan"], report["ds_config"]
    assert plan["world_size"] == 4
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"], plan["global_batch_size"]) == (4, 1, 16)
    assert plan["total_steps"] == 16 * (256 // 16)  # the demo trains 16 epochs
    assert (
        ds_config["train_batch_size"],
        ds_config["train_micro_batch_size_per_gpu"],
        ds_config["gradient_accumulation_steps"],
    ) == (16, 4, 1)


def test_json_of_an_invalid_spec_keeps_stdout_clean_after_deepspeed_ran(tmp_path):
    """A key DeepSpeed itself refuses is found by its config code; its logging must not reach stdout."""
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "no_such_knob": 1}}))
    spec = write_spec(tmp_path, {"micro_batch_size": 2, "max_steps": 5}, deepspeed={"config": "ds.json"})
    proc = run_dstune("validate", spec, "--world-size", "2", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)  # the whole of stdout is the one object
    assert report["ds_config"] is None
    assert report["plan"]["global_batch_size"] == 4  # the plan was worked out before DeepSpeed refused the JSON
    assert any("no_such_knob" in e for e in report["errors"]), report["errors"]
    assert "Traceback" not in proc.stderr


def test_set_overrides_any_key_and_is_repeatable(capsys):
    code, out, _ = call(
        capsys,
        "validate",
        DEMO,
        "--world-size",
        "2",
        "--json",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "deepspeed.zero_stage=3",
    )
    assert code == 0
    report = json.loads(out)
    assert report["plan"]["micro_batch_size"] == 2
    assert report["plan"]["gradient_accumulation_steps"] == 2  # global 8 stays: 2 x 2 x 2
    assert report["ds_config"]["zero_optimization"]["stage"] == 3


def test_an_override_error_points_at_set(capsys):
    code, out, _ = call(capsys, "validate", DEMO, "--world-size", "2", "--set", "train.micro_batch_size=0")
    assert code == 1
    assert "error: --set: train.micro_batch_size:" in out


@pytest.mark.parametrize(
    "args",
    [
        ["--no-such-flag"],
        ["--set", "train.micro_batch_size"],  # no '='
        ["--num-gpus", "2", "--include", "localhost:0"],
        ["--world-size", "2", "--hostfile", "hosts"],
        ["--include", "a", "--exclude", "b", "--hostfile", "hosts"],
        ["--num-nodes", "2"],  # no hostfile: DeepSpeed launches on this machine only
        ["--num-samples", "0"],
        ["--accelerator", "tpu"],
    ],
)
def test_usage_errors_exit_2_before_anything_is_read(capsys, args):
    code, out, err = call(capsys, "validate", DEMO, *args)
    assert code == 2
    assert "error:" in err and out == ""


def test_no_subcommand_is_a_usage_error(capsys):
    code, _, err = call(capsys)
    assert code == 2 and "validate" in err


# deepspeed/tests/unit/runtime/test_ds_config_dict.py TestBatchConfig: world 2, (train, micro, accum, success).
BATCH_CASES = [(32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False), (32, 18, 1, False)]


@pytest.mark.parametrize("given", ["all", "global+micro"])
@pytest.mark.parametrize("global_batch,micro,accum,ok", BATCH_CASES)
def test_deepspeed_batch_config_cases_through_validate(capsys, tmp_path, global_batch, micro, accum, ok, given):
    train = {"global_batch_size": global_batch, "micro_batch_size": micro, "max_steps": 10}
    if given == "all":
        train["gradient_accumulation_steps"] = accum
    spec = write_spec(tmp_path, train, data={"path": "builtin:shapes"})
    code, out, _ = call(capsys, "validate", spec, "--world-size", "2", "--json")
    report = json.loads(out)
    assert (code == 0) == ok, report["errors"]
    if ok:
        assert report["ds_config"]["train_batch_size"] == global_batch
        assert report["ds_config"]["train_micro_batch_size_per_gpu"] == micro
        assert report["ds_config"]["gradient_accumulation_steps"] == accum
    else:
        assert report["ds_config"] is None
        assert any("train.global_batch_size" in e or "train.micro_batch_size" in e for e in report["errors"])


# ---------------------------------------------------------------------------------------------------- compile


def test_compile_writes_the_same_config_validate_reports(capsys, tmp_path):
    _, out, _ = call(capsys, "validate", DEMO, "--num-gpus", "2", "--json")
    expected = json.loads(out)["ds_config"]
    code, out, _ = call(capsys, "compile", DEMO, "--num-gpus", "2")
    assert code == 0 and json.loads(out) == expected
    target = tmp_path / "out" / "ds.json"
    code, out, err = call(capsys, "compile", DEMO, "--num-gpus", "2", "-o", target)
    assert code == 0 and out.startswith(f"wrote {target}: the DeepSpeed JSON of {DEMO} for 2 ranks (train_batch_size ")
    assert json.loads(target.read_text()) == expected
    assert "auto" not in target.read_text()


def test_compile_of_an_invalid_spec_writes_nothing(capsys, tmp_path):
    spec = write_spec(tmp_path, {"micro_batch_size": 3, "global_batch_size": 8, "max_steps": 5})
    target = tmp_path / "ds.json"
    code, out, err = call(capsys, "compile", spec, "--world-size", "2", "-o", target)
    assert code == 1 and out == ""
    assert "train.micro_batch_size" in err and not target.exists()


# ------------------------------------------------------------------------------------------------ schema, init


def test_schema_is_the_spec_json_schema(capsys):
    code, out, _ = call(capsys, "schema")
    schema = json.loads(out)
    assert code == 0
    assert {"model", "data", "train", "deepspeed", "output", "sample"} <= set(schema["properties"])
    assert set(schema["required"]) == {"model", "train"}


def test_init_prints_a_spec_that_validates_as_printed(capsys, tmp_path):
    code, text, _ = call(capsys, "init")
    assert code == 0
    assert "builtin:tiny-sd" in text and "builtin:shapes" in text
    for section in ("model:", "data:", "train:", "deepspeed:", "output:", "sample:"):
        assert f"\n{section}" in text
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    for world in ("1", "2", "3"):
        code, out, _ = call(capsys, "validate", spec, "--world-size", world, "--json")
        assert code == 0, json.loads(out)["errors"]


def test_init_refuses_to_overwrite_without_force(capsys, tmp_path):
    target = tmp_path / "spec.yaml"
    target.write_text("mine\n")
    code, _, err = call(capsys, "init", "-o", target)
    assert code == 2 and "--force" in err
    assert target.read_text() == "mine\n"
    code, _, _ = call(capsys, "init", "-o", target, "--force")
    assert code == 0 and target.read_text().startswith("# A dstune spec")


# -------------------------------------------------------------------------------------------------- imports


def test_spec_errors_and_schema_never_import_torch_or_deepspeed(tmp_path):
    spec = write_spec(tmp_path, {"micro_batch_siz": 4, "max_steps": 5})
    code = (
        "import sys\n"
        "from dstune.cli import main\n"
        f"codes = [main(['validate', {str(spec)!r}]), main(['schema']), main(['init'])]\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed') if m in sys.modules)\n"
        "print('RESULT', codes, heavy, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "RESULT [1, 0, 0] []" in proc.stderr, proc.stderr
    assert "did you mean 'micro_batch_size'" in proc.stdout


# --------------------------------------------------------------------------------------------- worlds, resolve


def test_hostfile_world_and_include_through_validate(capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nworker-0 slots=4\nworker-1 slots=4\n")
    code, out, _ = call(capsys, "validate", DEMO, "--hostfile", hosts, "--set", "train.global_batch_size=32", "--json")
    report = json.loads(out)
    assert code == 0, report["errors"]
    plan = report["plan"]
    assert (plan["world_size"], plan["num_nodes"], plan["ranks_per_node"]) == (8, 2, [4, 4])
    assert report["ds_config"]["train_batch_size"] == 32
    code, out, _ = call(capsys, "validate", DEMO, "--hostfile", hosts, "--include", "worker-1:0,1", "--json")
    assert code == 0 and json.loads(out)["plan"]["world_size"] == 2


def test_an_unknown_include_host_in_a_hostfile_is_invalid_not_usage(capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\n")
    code, out, _ = call(capsys, "validate", DEMO, "--hostfile", hosts, "--include", "worker-9", "--json")
    report = json.loads(out)
    assert code == 1 and report["plan"] is None
    assert "worker-9" in report["errors"][0] and report["errors"][0].startswith("--hostfile: ")


def test_resolve_collects_errors_from_every_stage_that_can_run(tmp_path):
    from dstune.validate import ResolveError, load_and_validate as resolve
    from dstune.spec.load import SpecError
    from dstune.world import world_from_flags

    spec = write_spec(
        tmp_path,
        {"micro_batch_size": 3, "global_batch_size": 8, "max_steps": 5, "precision": "fp16"},
        data={"path": str(tmp_path / "missing")},
    )
    with pytest.raises(SpecError) as caught:
        resolve(spec, world=world_from_flags(world_size=2), accelerator="cpu")
    assert isinstance(caught.value, ResolveError)
    keys = sorted(issue.key for issue in caught.value.issues)
    assert keys == ["data.path", "train.micro_batch_size", "train.precision"]
    assert caught.value.world.world_size == 2 and caught.value.plan is None


def test_resolve_plans_offline_with_num_samples_and_plan_text_is_plain(tmp_path):
    from dstune.report import plan_text
    from dstune.validate import load_and_validate as resolve
    from dstune.world import world_from_flags

    spec = write_spec(
        tmp_path,
        {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "epochs": 3},
        data={"path": "/not/on/this/machine"},
    )
    resolved = resolve(spec, world=lambda: world_from_flags(num_gpus=4), num_samples=1000)
    plan = resolved.plan
    assert (plan.global_batch_size, plan.steps_per_epoch, plan.dropped_per_epoch) == (16, 62, 8)
    assert resolved.num_samples == 1000 and "--num-samples" in resolved.num_samples_origin
    assert [w.key for w in resolved.warnings] == ["train.global_batch_size"]  # 8 samples left out per epoch
    text = plan_text(resolved)
    assert "16 samples per optimizer step = 2 x 2 x 4 ranks" in text and "\x1b[" not in text
    assert "leaves out 8" in text and "warning:" in text


def test_validate_counts_a_real_folder_with_repeats_and_warns_about_missing_captions(capsys, tmp_path):
    from PIL import Image

    folder = tmp_path / "images" / "3_dog"
    folder.mkdir(parents=True)
    for i in range(4):
        Image.new("RGB", (8, 8)).save(folder / f"{i}.png")
        if i:
            (folder / f"{i}.txt").write_text("a dog")
    spec = write_spec(tmp_path, {"micro_batch_size": 2, "epochs": 1}, data={"path": str(tmp_path / "images")})
    code, out, _ = call(capsys, "validate", spec, "--world-size", "2", "--json")
    report = json.loads(out)
    assert code == 0, report["errors"]
    assert report["plan"]["num_samples"] == 12 and report["plan"]["steps_per_epoch"] == 3  # 4 images x 3 repeats
    assert any("data.path" in w and "1 of 4 images have no .txt caption" in w for w in report["warnings"])
