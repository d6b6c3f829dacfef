"""The settings matrix in one process: every built-in model at the settings users pick (tests/unit/settings_matrix.py,
docs/testing.md).

For each built-in model, a pairwise design over its settings (micro batch 1 or 2, bf16 or fp32, full or LoRA,
gradient checkpointing, the caches, aspect-ratio buckets with non-square sizes, two clip lengths for video, two
durations for speech, and its own options: image-to-video, sound, experts, speakers): every pair of two settings'
values meets in at least one case. Each case starts as a rank of `python dstune/train.py` does, without DeepSpeed
(settings_matrix.run_case), and must give a finite loss, a gradient on every trainable parameter (or one the model
itself leaves out, LEFT_OUT, with its reason), no warning from dstune's validate or code, and no traceback. The
cases run in one child process (its printed output and warnings are the case's own); what needs DeepSpeed and two
ranks (ZeRO stages, accumulation, caches built by ranks) is tests/dist/test_settings_matrix_two_ranks.py.

A setting a model cannot take is not in its design: `dstune validate` refuses it, with the reason (REFUSALS)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import covering_array
import settings_matrix as matrix
from dstune.builtin import BUILTIN_MODELS

REPO = matrix.REPO
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
MODELS = sorted(BUILTIN_MODELS)


def test_the_covering_array_meets_every_pair_of_mixed_settings_and_keeps_to_allowed():
    settings = {"a": (0, 1, 2), "b": ("x", "y"), "c": (False, True), "d": (1, 2, 3, 4), "e": ("p", "q")}
    rows = covering_array.pairwise(settings)
    assert not covering_array.uncovered_pairs(settings, rows)
    assert 12 <= len(rows) < 3 * 2 * 2 * 4 * 2  # at least 4 x 3 (the two widest settings), far below all 96
    assert rows == covering_array.pairwise(settings)  # the same cases on every run

    def no_y_with_4(row):
        return not (row.get("b") == "y" and row.get("d") == 4)

    constrained = covering_array.pairwise(settings, no_y_with_4)
    assert all(no_y_with_4(row) for row in constrained)
    assert not covering_array.uncovered_pairs(settings, constrained, no_y_with_4)
    for number in range(len(rows)):  # no row kept whose every pair another row holds
        assert covering_array.uncovered_pairs(settings, rows[:number] + rows[number + 1 :])


@pytest.mark.parametrize("name", MODELS)
def test_every_pair_of_a_models_settings_meets_in_a_case(name):
    settings = matrix.factors(name)
    rows = covering_array.pairwise(settings)
    assert not covering_array.uncovered_pairs(settings, rows)
    assert {"micro_batch_size", "precision"} <= set(settings)
    every = 1
    for values in settings.values():
        every *= len(values)
    assert len(rows) < every


# ------------------------------------------------------------------------------------------------ the cases


@functools.cache
def every_case() -> list[tuple[str, str, dict]]:
    """(model, case id, row) of every case of every built-in model, in a fixed order."""
    return [
        (name, matrix.case_id(name, row), row)
        for name in MODELS
        for row in covering_array.pairwise(matrix.factors(name))
    ]


_results: dict[str, dict] = {}


def _selected_models(session) -> set[str]:
    """The models whose case test this session runs (all of them, or those `-k` keeps)."""
    return {
        item.callspec.params["name"]
        for item in session.items
        if getattr(item, "originalname", "") == TRAINS_TEST and hasattr(item, "callspec")
    }


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[str, dict]:
    """case id -> its result: the cases of the models this session tests, run once in one child process
    (settings_matrix.run_cases)."""
    if _results:
        return _results
    root = tmp_path_factory.mktemp("settings-matrix")
    folders = matrix.write_datasets(root / "data")
    todo, selected = [], _selected_models(request.session)
    for number, (name, case, row) in enumerate(every_case()):
        if name not in selected:
            continue
        run_dir = root / "cases" / f"{number:03d}" / "run"
        run_dir.parent.mkdir(parents=True)
        spec = run_dir.parent / "spec.yaml"
        spec.write_text(yaml.safe_dump(matrix.case_spec(name, row, folders, run_dir, CACHE_DIR), sort_keys=False))
        todo.append((case, str(spec)))
    (root / "cases.json").write_text(json.dumps(todo))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)])}
    code = "import json, sys, settings_matrix; settings_matrix.run_cases(json.load(open(sys.argv[1])))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(root / "cases.json")], env=env, capture_output=True, text=True, cwd=REPO
    )
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            _results[result["case"]] = result
    if done.returncode:  # the first case without a result ended the process: it gets the process's own output
        ended = next((case for case, _ in todo if case not in _results), None)
        _results[ended] = {"died": done.returncode, "printed": done.stderr[-4000:]}
    return _results


def _problems(name: str, row: dict, result: dict) -> list[str]:
    if "died" in result:
        return [f"the process running the cases ended (exit {result['died']}):\n{result['printed']}"]
    if "traceback" in result:
        return [f"traceback:\n{result['traceback']}"]
    if "stopped" in result:
        return [f"stopped (exit {result['stopped']}):\n{result['printed']}"]
    problems = []
    if not result["finite"]:
        problems.append(f"loss {result['loss']}")
    if result["batch"] != row.get("micro_batch_size", 2):
        problems.append(f"a batch of {result['batch']} samples")
    printed = result["printed"].splitlines()
    expected = matrix.expected_warnings(name, row)
    problems += [
        f"printed: {line}"
        for line in printed
        if (line.lower().startswith("warning") and not any(text in line for text in expected)) or "Traceback" in line
    ]
    unexpected, missing = matrix.unexpected_warnings(name, row, result["warnings"])
    problems += [f"validate warned: {w}" for w in unexpected]
    problems += [f"validate did not warn: ...{text}..." for text in missing]
    problems += [f"dstune warned: {w}" for w in result["dstune_warnings"]]
    problems += [f"{what}: {names}" for what, names in matrix.unexplained(name, row, result["grads"]).items()]
    return problems


TRAINS_TEST = "test_every_case_trains_a_step_with_a_gradient_on_every_trainable_parameter"


@pytest.mark.parametrize("name", MODELS)
def test_every_case_trains_a_step_with_a_gradient_on_every_trainable_parameter(results, name):
    failed = []
    for model, case, row in every_case():
        if model == name:
            result = results.get(case, {"died": "?", "printed": "no result (an earlier case ended the process)"})
            failed += [f"{case}: {problem}" for problem in _problems(name, row, result)]
    assert not failed, "\n".join(failed)


# ------------------------------------------------------------------------------------------------- refusals

# A setting a model cannot take, as a user would write it on one of the matrix's cases: (id, model, the case's row,
# {dotted key: value, None removes it}, the key validate names, what its reason says)
REFUSALS = [
    ("two-experts-without-expert", "tiny-wan-a14b", {"frames": 5}, {"model.expert": None},
     "model.expert", "it has two experts: set model.expert to high_noise"),
    ("expert-on-one-expert-folder", "tiny-wan", {"frames": 5}, {"model.expert": "low_noise"},
     "model.expert", "applies to two-expert folders (transformer_2); this one has one"),
    ("text-to-video-on-i2v-folder", "tiny-wan-i2v", {"frames": 5}, {"model.image_to_video": False},
     "model.image_to_video", "is false, but this is an image-to-video folder"),
    ("image-to-video-on-t2v-folder", "tiny-wan", {"frames": 5}, {"model.image_to_video": True},
     "model.image_to_video", "is true, but this is a text-to-video folder"),
    ("text-to-video-on-hunyuan-i2v", "tiny-hunyuan-video15-i2v", {"frames": 5}, {"model.image_to_video": False},
     "model.image_to_video", "transformer is the image-to-video one"),
    ("image-to-video-on-hunyuan-t2v", "tiny-hunyuan-video15", {"frames": 5}, {"model.image_to_video": True},
     "model.image_to_video", "HunyuanVideo15Pipeline is text-to-video"),
    ("wan-i2v-text-not-512", "tiny-wan-i2v", {"frames": 5}, {"model.max_sequence_length": 256},
     "model.max_sequence_length", "takes all but the last 512 context tokens as the image embedding's"),
    ("edit-text-cache", "tiny-qwen-image-edit", {}, {"data.cache": {"latents": True, "text_embeddings": True}},
     "data.cache.text_embeddings", "encodes each instruction together with its source image"),
    ("edit-without-sources", "tiny-qwen-image-edit", {}, {"data.control_dir": None},
     "data.control_dir", "trains on (source, target) pairs"),
    ("edit-bucket-step-8", "tiny-qwen-image-edit", {"buckets": True}, {"data.buckets.step": 8},
     "data.buckets.step", "8: Qwen-Image-Edit takes image sides in multiples of 16 px"),
    ("flow-resolution-40", "tiny-qwen-image-edit", {}, {"data.resolution": 40},
     "data.resolution", "40: Qwen-Image-Edit takes image sides in multiples of 16 px; use 32"),
    ("qwen-image-21-bucket-step-16", "tiny-qwen-image-21", {"buckets": True}, {"data.buckets.step": 16},
     "data.buckets.step", "16: Qwen-Image 2.1 takes image sides in multiples of 32 px"),
    ("image-default-step-at-32px", "tiny-flux", {}, {"data.resolution": None, "data.buckets": {"enabled": True}},
     "data.buckets.step", "64 is larger than data.resolution 32"),
    ("video-bucket-step-8", "tiny-wan", {"buckets": True, "frames": 5}, {"data.buckets.step": 8},
     "", "data.buckets.step 8: video buckets need sides that are multiples of 16 pixels"),
    ("ti2v-bucket-step-16", "tiny-wan22-ti2v", {"buckets": True, "frames": 5}, {"data.buckets.step": 16},
     "data.buckets.step", "takes clip sides in multiples of 32 px (its VAE's 16x, then 2x2 patches)"),
    ("ti2v-resolution-48", "tiny-wan22-ti2v", {"frames": 5}, {"data.resolution": 48},
     "data.resolution", "takes clip sides in multiples of 32 px"),
    ("video-frames-not-4k-plus-1", "tiny-ltx2", {"frames": 5}, {"data.video.frames": 6},
     "data.video.frames", "6 is not 4k+1"),
    ("dstune-layout-with-two-speakers", "tiny-tts-lm", {"speakers": True}, {},
     "data.path", "the data names 2 speakers (0, 1), but the 'dstune' token layout has no place for a speaker"),
    ("speech-with-image-buckets", "tiny-dia", {}, {"data.buckets": {"enabled": True}},
     "", "trains on speech: data.buckets, data.cache.latents and data.cache.text_embeddings are for images"),
    ("speecht5-codec-cache", "tiny-speecht5", {}, {"data.cache": {"codec_tokens": True}},
     "", "data.cache.codec_tokens is for the codec-token models"),
    ("speecht5-lora", "tiny-speecht5", {}, {"model.train": "lora"}, "model.train", "unknown key 'train'"),
    ("speecht5-checkpointing", "tiny-speecht5", {}, {"model.gradient_checkpointing": True},
     "model.gradient_checkpointing", "unknown key 'gradient_checkpointing'"),
]  # fmt: skip


def _edit(spec: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for key in path:
        spec = spec.setdefault(key, {})
    if value is None:
        spec.pop(last, None)
    else:
        spec[last] = value


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict:
    return matrix.write_datasets(tmp_path_factory.mktemp("refusal-data"))


@pytest.mark.parametrize("refusal", REFUSALS, ids=[refusal[0] for refusal in REFUSALS])
def test_a_setting_a_model_cannot_take_is_refused_by_validate_with_the_reason(refusal, datasets, tmp_path, capsys):
    from dstune.cli import main

    _, name, row, edits, key, reason = refusal
    spec = matrix.case_spec(name, {"micro_batch_size": 2, **row}, datasets, tmp_path / "run", CACHE_DIR)
    for dotted, value in edits.items():
        _edit(spec, dotted, value)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    code = main(["validate", str(path), "--num-gpus", "2"])
    out = capsys.readouterr()
    errors = [line for line in (out.out + out.err).splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in out.out + out.err, out.out + out.err
    assert any(f"{key}: " in line and reason in line for line in errors) if key else any(reason in e for e in errors), (
        errors
    )
