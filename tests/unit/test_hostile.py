"""Hostile specs: each is a small file in tmp_path run through `python3 -m dstune validate` as a real process.

Every one must exit 1, name the key to fix (and the file:line where one applies), and never show a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

GOOD_TRAIN = "train:\n  micro_batch_size: 4\n  max_steps: 10\n"


@dataclass
class Case:
    spec: str  # YAML text; {tmp} is replaced by the test's folder
    expect: list[str]  # substrings the output must contain (keys, file:line, numbers)
    args: list[str] = field(default_factory=lambda: ["--world-size", "2"])
    files: dict[str, str] = field(default_factory=dict)  # extra files (relative to tmp): text
    images: dict[str, int] = field(default_factory=dict)  # folder (relative to tmp) -> number of tiny PNGs


CASES = {
    "malformed yaml": Case("model:\n  family: sd\ntrain: [1,\n  micro_batch_size: 4\n",
                           ["spec.yaml:5: not valid YAML", "expected ',' or ']'"]),
    "python tag": Case("model: !!python/object/apply:os.system ['touch {tmp}/pwned']\n" + GOOD_TRAIN,
                       ["spec.yaml:1", "Python tags"]),
    "typo key": Case("model:\n  family: sd\n" + GOOD_TRAIN + "  lerning_rate: 0.1\n",
                     ["spec.yaml:6: train.lerning_rate", "unknown key"]),
    "typo did you mean": Case("model:\n  family: sd\ntrain:\n  micro_batch_siz: 4\n  max_steps: 10\n",
                              ["spec.yaml:4: train.micro_batch_siz", "did you mean 'micro_batch_size'"]),
    "wrong family": Case("model:\n  family: sdd\n" + GOOD_TRAIN, ["spec.yaml:2: model.family", "did you mean 'sd'"]),
    "wrong types": Case("model:\n  family: sd\ntrain:\n  micro_batch_size: four\n  max_steps: [1]\n",
                        ["spec.yaml:4: train.micro_batch_size", "spec.yaml:5: train.max_steps"]),
    "zero and negative sizes": Case(
        "model:\n  family: sd\ntrain:\n  micro_batch_size: 0\n  global_batch_size: -8\n  max_steps: 10\n"
        "data:\n  resolution: -32\n",
        ["spec.yaml:4: train.micro_batch_size", "spec.yaml:5: train.global_batch_size",
         "spec.yaml:8: data.resolution"]),
    "indivisible batch": Case(
        "model:\n  family: sd\ntrain:\n  micro_batch_size: 6\n  global_batch_size: 32\n  max_steps: 10\n",
        ["spec.yaml:4: train.micro_batch_size", "micro 8 x accum 2", "global_batch_size 24 or 36"]),
    "global not divisible by ranks": Case(
        "model:\n  family: sd\ntrain:\n  global_batch_size: 33\n  max_steps: 10\n",
        ["spec.yaml:4: train.global_batch_size", "32 or 34"]),
    "zero stage 4": Case("model:\n  family: sd\n" + GOOD_TRAIN + "deepspeed:\n  zero_stage: 4\n",
                         ["spec.yaml:7: deepspeed.zero_stage", "less than or equal to 3"]),
    "nvme without path": Case(
        "model:\n  family: sd\n" + GOOD_TRAIN + "deepspeed:\n  zero_stage: 3\n  offload_param:\n    device: nvme\n",
        ["spec.yaml:8: deepspeed.offload_param", "nvme_path"]),
    "fp16 on cpu": Case("model:\n  family: sd\n" + GOOD_TRAIN + "  precision: fp16\n",
                        ["spec.yaml:6: train.precision", "bf16 or fp32"],
                        args=["--world-size", "2", "--accelerator", "cpu"]),
    "adafactor with clipping": Case(
        "model:\n  family: sd\n" + GOOD_TRAIN + "  optimizer:\n    type: adafactor\n  gradient_clipping: 1.0\n",
        ["spec.yaml:8: train.gradient_clipping", "1.0 with adafactor", "allow_clipping_with_adafactor"]),
    "epochs and max_steps": Case("model:\n  family: sd\n" + GOOD_TRAIN + "  epochs: 3\n",
                                 ["spec.yaml:5: train.max_steps", "exactly one of `epochs` or `max_steps`"]),
    "missing data path": Case("model:\n  family: sd\ndata:\n  path: {tmp}/no-such-folder\n" + GOOD_TRAIN,
                              ["spec.yaml:4: data.path", "does not exist", "--num-samples"]),
    "empty dataset folder": Case("model:\n  family: sd\ndata:\n  path: {tmp}/empty\n" + GOOD_TRAIN,
                                 ["spec.yaml:4: data.path", "no usable samples"], images={"empty": 0}),
    "dataset smaller than a global batch": Case(
        "model:\n  family: sd\ndata:\n  path: {tmp}/few\ntrain:\n  micro_batch_size: 4\n  max_steps: 10\n",
        ["train.global_batch_size", "8 is larger than the dataset (3 samples)"], images={"few": 3}),
    "bad hostfile line": Case("model:\n  family: sd\n" + GOOD_TRAIN, ["--hostfile", "hosts:2", "worker-1 slots=two"],
                              args=["--hostfile", "{tmp}/hosts"],
                              files={"hosts": "worker-0 slots=2\nworker-1 slots=two\n"}),
    "deepspeed config not json": Case(
        "model:\n  family: sd\n" + GOOD_TRAIN + "deepspeed:\n  config: ds.json\n",
        ["ds.json:1", "not valid JSON"], files={"ds.json": '{"zero_optimization": {"stage": 2,}}'}),
    "missing data and a key deepspeed refuses": Case(
        "model:\n  family: sd\ndata:\n  path: /no/such/data\n" + GOOD_TRAIN + "deepspeed:\n  config: ds.json\n",
        ["spec.yaml:4: data.path", "zero_optimization.no_such_knob", "2 errors"],
        files={"ds.json": json.dumps({"zero_optimization": {"stage": 2, "no_such_knob": 1}}, indent=2)}),
}


def _make_images(folder: Path, count: int) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"image {i}")


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_spec_exits_1_naming_the_key_without_traceback(tmp_path, name):
    case = CASES[name]
    for rel, text in case.files.items():
        (tmp_path / rel).write_text(text)
    for rel, count in case.images.items():
        _make_images(tmp_path / rel, count)
    spec = tmp_path / "spec.yaml"
    spec.write_text(case.spec.replace("{tmp}", str(tmp_path)))
    args = [a.replace("{tmp}", str(tmp_path)) for a in case.args]
    # Run from the dataset's folder (as a user would), with this checkout importable.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "dstune", "validate", "spec.yaml", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output and "internal error" not in output, output
    for expected in case.expect:
        assert expected in output, f"{expected!r} not in:\n{output}"
    assert not (tmp_path / "pwned").exists()
