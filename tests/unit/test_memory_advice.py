"""`dstune validate --gpu-memory` on a run that does not fit: the settings that would make it fit (dstune.memory_advice).

Every launch spec and every `dstune init --model` preset, at 24, 48 and 80 GB on 8 GPUs: either it fits, or validate
suggests at least one combination, and each suggestion, applied with its --set lines, validates as fitting with the
figure it printed and the same global batch, and sets nothing the spec already has; "more GPUs" only where the
re-planned world's peak is lower and fits (at 8 and at 64 GPUs). The planning runs in-process (load_and_validate,
plan_memory, advise: what `dstune validate` calls), offline on the configs stored with dstune.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dstune import registry
from dstune.cli import main
from dstune.memory_advice import LEVERS, Search, advise
from dstune.reference import model_spec
from dstune.validate import ResolveError, load_and_validate, plan_memory
from dstune.world import world_from_flags

REPO = Path(__file__).resolve().parents[2]
GPU_SIZES = (24e9, 48e9, 80e9)


def _launch_specs() -> list:
    found = []
    for path in sorted((REPO / "launch").glob("*.yaml")):
        flags = path.read_text().splitlines()[0].split()[4:]
        samples = int(flags[flags.index("--num-samples") + 1]) if "--num-samples" in flags else 1000
        gpus = int(flags[flags.index("--num-gpus") + 1]) if "--num-gpus" in flags else 8
        found.append(pytest.param(path.stem, None, samples, 8 if gpus >= 8 else gpus, id=path.stem))
    return found


SPECS = [pytest.param(p.name, p.name, 1000, 8, id=p.name) for p in registry.presets()] + _launch_specs()


def _spec_file(tmp_path, name: str, preset) -> Path:
    if preset is None:
        return REPO / "launch" / f"{name}.yaml"
    path = tmp_path / f"{name}.yaml"
    path.write_text(model_spec(preset, path.name))
    return path


def _planned(path, sets, world, samples, gpu_bytes):
    resolved = load_and_validate(path, sets, world=world, num_samples=samples, accelerator="cuda", check_files=False)
    return resolved, plan_memory(resolved.spec, resolved.plan, resolved.ds_config, gpu_bytes, "cuda", resolved.clips)


def _value_at(dump: dict, key: str):
    node = dump
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node.get("device") if isinstance(node, dict) and "device" in node else node


@pytest.mark.parametrize(("name", "preset", "samples", "gpus"), SPECS)
def test_a_run_fits_or_every_suggestion_fits_as_printed(name, preset, samples, gpus, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))  # the configs stored with dstune
    path, world = _spec_file(tmp_path, name, preset), world_from_flags(num_gpus=gpus)
    for gpu_bytes in GPU_SIZES:
        resolved, memory = _planned(path, [], world, samples, gpu_bytes)
        if memory["per_gpu"] is None or memory["fits"]:
            continue
        advice = advise(path, [], world, samples, "cuda", gpu_bytes)
        assert advice["suggestions"], (name, gpu_bytes, advice["nothing_fits"])
        dump = resolved.spec.model_dump(mode="json")
        for item in advice["suggestions"]:
            again, after = _planned(path, item["set"], world, samples, gpu_bytes)
            assert after["fits"] is True, (name, gpu_bytes, item)
            assert after["peak_per_gpu_bytes"] == item["per_gpu_total_bytes"]  # the plan's own figure
            assert again.plan.global_batch_size == resolved.plan.global_batch_size, item  # the same global batch
            for line in item["set"]:  # each line changes something the spec has not set that way
                key, _, value = line.partition("=")
                assert _value_at(dump, key) != yaml.safe_load(value), (name, line)
            assert len(item["costs"]) >= 1 and item["relieves"] == memory["peak_phase"]
        _check_more_gpus(advice, memory, path, samples, gpu_bytes)
        if gpus == 8:  # at 64 GPUs too: "more GPUs" only where 128, 256 or 512 fit with a lower peak
            many = world_from_flags(world_size=64, num_nodes=8)
            try:
                _, wide = _planned(path, [], many, samples, gpu_bytes)
            except ResolveError:  # a global batch that 64 ranks do not divide
                continue
            if wide["per_gpu"] is not None and wide["fits"] is False:
                _check_more_gpus(advise(path, [], many, samples, "cuda", gpu_bytes), wide, path, samples, gpu_bytes)


def _check_more_gpus(advice: dict, memory: dict, path, samples: int, gpu_bytes: float) -> None:
    more = advice["more_gpus"]
    if more is None:
        return
    nodes = more["num_gpus"] // 8
    _, there = _planned(path, [], world_from_flags(world_size=more["num_gpus"], num_nodes=nodes), samples, gpu_bytes)
    assert there["peak_per_gpu_bytes"] == more["per_gpu_total_bytes"] < memory["peak_per_gpu_bytes"]
    assert there["fits"] is True


def _preset_file(tmp_path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(model_spec(name, path.name))
    return path


@pytest.mark.parametrize(
    ("preset", "phase", "gpu_bytes"),
    [
        ("qwen-image", "sample", 24e9),
        ("wan21", "step", 24e9),
        ("hunyuan-video15", "step", 24e9),
        ("ltx2", "step", 24e9),
        ("ltx2-3", "step", 24e9),
        ("flux2-dev", "step", 24e9),
        ("flux2-dev", "step", 48e9),
    ],
)
def test_the_big_presets_on_24gb_get_a_working_suggestion(preset, phase, gpu_bytes, tmp_path, monkeypatch):
    """The issue's cases: validate said "no change dstune knows of"; the text cache, ZeRO-3, sequence parallelism,
    activation offload and VAE tiling make them fit. Wan 2.1 at 8 x 24 GB is not helped by more GPUs: its ZeRO-2 LoRA replicates the
    frozen base (58.5 GB per GPU at 64 GPUs against 59.1 at 8). LTX-2 (Gemma 3 12B, 24.4 GB) and FLUX.2 dev (Mistral
    Small 24B, 48 GB) fit only with their text encoders in host memory while the text cache is built: whole on one
    GPU, the encoder alone is more than the GPU."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    path, world = _preset_file(tmp_path, preset), world_from_flags(num_gpus=8)
    advice = advise(path, [], world, 1000, "cuda", gpu_bytes)
    assert advice["suggestions"] and all(s["relieves"] == phase for s in advice["suggestions"])
    if preset.startswith(("ltx2", "flux2")):
        assert all("model.text_encoder_offload=cpu" in item["set"] for item in advice["suggestions"]), advice
    if preset == "wan21":
        assert advice["more_gpus"] is None
        changes = [item["change"] for item in advice["suggestions"]]
        assert any("data.cache.text_embeddings=true" in change for change in changes)
        # a route without the text cache too: sequence parallelism or the block inputs in host memory
        assert any(
            "data.cache.text_embeddings" not in change
            and ("deepspeed.sequence_parallel_size=4" in change or "model.activation_offload=cpu" in change)
            for change in changes
        )


def test_the_search_names_every_lever_once_and_its_cost():
    names = [lever.name for lever in LEVERS]
    assert len(names) == len(set(names)) and all(lever.cost for lever in LEVERS)
    assert names[-3:] == ["frames", "resolution", "clip length"]  # what changes the training data: last


def test_a_refused_combination_is_never_planned(tmp_path, monkeypatch):
    """A setting the spec's rules refuse (an nf4 base under ZeRO-3, sequence parallelism over ranks it does not
    divide) re-plans to nothing, so it is never suggested; an int8 base under ZeRO-3 runs, and is planned."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    search = Search(_preset_file(tmp_path, "flux"), [], world_from_flags(num_gpus=8), 1000, "cuda", 24e9)
    assert search.plan({}) is not None
    assert search.plan({"deepspeed.zero_stage": "3", "model.train": "lora", "model.base_precision": "nf4"}) is None
    assert search.plan({"deepspeed.zero_stage": "3", "model.train": "lora", "model.base_precision": "int8"}) is not None
    assert search.plan({"deepspeed.sequence_parallel_size": "3"}) is None


def test_validate_prints_the_set_lines_their_costs_and_why_nothing_fits(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    flags = ["--num-gpus", "8", "--num-samples", "1000", "--gpu-memory", "24GB"]
    assert main(["validate", str(_preset_file(tmp_path, "wan21")), *flags]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "24 GB: DOES NOT FIT would fit with --set data.cache.text_embeddings=true --set deepspeed.zero_stage=3" in out
    )
    assert "costs text cache: captions encoded once before training" in out
    # LTX-2 on 6 GB: with its text encoders offloaded, the VAE's encode of a chunk beside the frozen parts is more
    assert main(["validate", str(_preset_file(tmp_path, "ltx2")), *flags[:-1], "6GB"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "nothing fits with every setting that lowers the peak (text cache, text encoder offload," in out
    assert "the cache phase still needs" in out and "(vae 1.22 B parameters, audio_vae" in out
    assert "text_encoder 12.2 B parameters" not in out  # in host memory: not what fills the GPU
