"""Real 2-rank DeepSpeed training of the flow family's image models, one table row per model (ROWS in
flow_runs.py): for each, full fine-tuning under ZeRO 2 from cached latents and text embeddings (trains, samples,
exports a folder its diffusers pipeline loads and renders with) and LoRA under ZeRO 3 with gradient checkpointing
(only adapters train; the LoRA file loads with the pipeline's load_lora_weights and changes the image); the rows
that name a resume case also resume from step 2 and continue exactly. The table is split over two modules
(test_flow_models_a.py, _b.py) so that `make test`'s two workers run them side by side."""

from __future__ import annotations

import pytest

from flow_runs import (ROWS, check_full_export, check_lora_export, check_lora_samples_from, check_memory_phases,
                       check_resume, check_trains, launch_cases, resumed_file)

pytestmark = pytest.mark.dist

MODELS = ("tiny-z-image", "tiny-krea2", "tiny-qwen-image-21")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """(model, case) -> (run dir, spec path, finished launch), every case of every model of this module."""
    out = {}
    for model in MODELS:
        cases = launch_cases(tmp_path_factory, model, ROWS[model].cases, ROWS[model].adjust)
        out.update({(model, name): run for name, run in cases.items()})
    return out


@pytest.mark.parametrize("model, name", [(m, n) for m in MODELS for n in ROWS[m].cases])
def test_trains_checks_and_logs(runs, model, name):
    check_trains(runs[model, name][0], runs[model, name][2])


@pytest.mark.parametrize("model", MODELS)
def test_full_export_loads_in_its_pipeline_and_renders(runs, model):
    row = ROWS[model]
    run_dir, _, proc = runs[model, row.full_case]
    check_full_export(run_dir, proc, model, row.pipeline(), row.render)


@pytest.mark.parametrize("model", MODELS)
def test_full_runs_cache_and_sample_phases_are_within_the_plan(runs, model):
    """The full run builds both caches and renders samples: the plan's cache phase (an encoder pass over a chunk
    beside the loaded parts) and sample phase (the decode or a sampling forward) hold what the ranks measured."""
    run_dir, _, proc = runs[model, ROWS[model].full_case]
    check_memory_phases(run_dir, proc)


@pytest.mark.parametrize("model", MODELS)
def test_lora_trains_adapters_only_and_loads_with_load_lora_weights(runs, model):
    row = ROWS[model]
    run_dir, _, proc = runs[model, row.lora_case]
    check_lora_export(run_dir, proc, model, row.pipeline(), row.render)


@pytest.mark.parametrize("model", [m for m in MODELS if ROWS[m].resume_case])
def test_resume_continues_exactly(runs, model, tmp_path):
    row = ROWS[model]
    check_resume(*runs[model, row.resume_case], tmp_path / "resumed", resumed_file(ROWS[model], row.resume_case))


@pytest.mark.parametrize("model", [m for m in MODELS if ROWS[m].sample_pretrained])
def test_lora_samples_come_from_sample_pretrained(runs, model):
    row = ROWS[model]
    run_dir, _, proc = runs[model, row.lora_case]
    check_lora_samples_from(run_dir, proc, row.sample_pretrained)

