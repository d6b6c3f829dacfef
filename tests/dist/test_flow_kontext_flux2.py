"""Real 2-rank DeepSpeed training of the models that edit a reference image: FLUX.1 Kontext (builtin:tiny-flux-kontext,
dstune.models.sd3_flux), FLUX.2 [klein] and [dev] image-to-image (builtin:tiny-flux2, tiny-flux2-dev,
dstune.models.flux2), each on a folder of (reference, target) pairs (data.control_dir). Per model, two launches:
full fine-tuning under ZeRO 2 from the cache (target and reference latents side by side, and the text), and LoRA
under ZeRO 3 with gradient checkpointing, encoding the references at each step; both sample from a reference
(sample.control_images). The full export renders in the model's own pipeline from a reference, and another
reference gives another image; the LoRA file loads with the pipeline's load_lora_weights and changes the image; the
LoRA run resumes from step 2 exactly (a third launch). These runs are FLUX.2's 2-rank rows (its text-to-image
path is the same class without the references' tokens: tests/unit/models/flux2, test_sequence_parallel.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flow_runs import (STEPS, TRANSFORMER, base_folder, check_lora_export, check_memory_phases, check_resume,
                       check_trains, launch_cases, on_pairs, render_edit, write_pairs)
from harness import explain

pytestmark = pytest.mark.dist

PAIRS, SIDE = 8, 64  # 8 px per latent: 8x8 latents; FLUX.2's pipelines take references of 64 px and up
CASES = {"zero2": (2, "full"), "lora-zero3": (3, "lora")}


@dataclass(frozen=True)
class EditRow:
    pipeline_class: str  # the diffusers pipeline its export and LoRA load in
    render: dict  # the pipeline's arguments besides the reference and prompt
    guidance: float  # sample.guidance during training


ROWS = {
    "tiny-flux-kontext": EditRow("FluxKontextPipeline", dict(max_area=SIDE * SIDE, guidance_scale=3.5), 3.5),
    "tiny-flux2": EditRow("Flux2KleinPipeline", dict(guidance_scale=1.0), 1.0),  # 1.0: no classifier-free pass
    "tiny-flux2-dev": EditRow("Flux2Pipeline", dict(guidance_scale=4.0), 4.0),  # the guidance embedding's value
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """(model, case) -> (run dir, spec path, finished launch)."""
    pairs = tmp_path_factory.mktemp("pairs")
    write_pairs(pairs, PAIRS, SIDE)
    out = {}
    for model, row in ROWS.items():
        adjust = on_pairs(pairs, SIDE, guidance=row.guidance)
        cases = launch_cases(tmp_path_factory, model, {f"{model}-{c}": v for c, v in CASES.items()}, adjust)
        out.update({(model, name.removeprefix(f"{model}-")): run for name, run in cases.items()})
    return out


def _pipeline(model: str, folder: Path):
    import diffusers

    return getattr(diffusers, ROWS[model].pipeline_class).from_pretrained(folder)


def _render(model: str, source: int = 105):
    return lambda pipeline: render_edit(pipeline, source, SIDE, **ROWS[model].render)


@pytest.mark.parametrize("model, case", [(m, c) for m in ROWS for c in CASES])
def test_trains_from_pairs_checks_logs_and_samples_from_a_reference(runs, model, case):
    run_dir, _, proc = runs[model, case]
    check_trains(run_dir, proc)
    assert all((run_dir / "samples" / f"step-{step:06d}.png").is_file() for step in (0, STEPS))


@pytest.mark.parametrize("model", list(ROWS))
def test_full_run_from_the_cache_exports_a_folder_its_pipeline_renders_from_a_reference(runs, model):
    run_dir, _, proc = runs[model, "zero2"]
    assert proc.returncode == 0, explain(proc)
    entries = 2 * PAIRS + PAIRS + 1  # target and reference latents, each caption's text and the sample prompt's
    assert f"{entries} entries, built now {entries}" in proc.stdout
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(model) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    pipeline = _pipeline(model, export)
    image = _render(model)(pipeline)
    assert image.shape == (1, 3, SIDE, SIDE) and torch.isfinite(image).all()
    # the reference conditions the export: seeded, the same reference renders the same image, another one another
    assert torch.equal(_render(model)(pipeline), image) and not torch.equal(_render(model, 102)(pipeline), image)


@pytest.mark.parametrize("model", list(ROWS))
def test_full_runs_cache_and_sample_phases_are_within_the_plan(runs, model):
    """The plan counts the references' latents and tokens: what the ranks measured stays within it."""
    run_dir, _, proc = runs[model, "zero2"]
    check_memory_phases(run_dir, proc)


@pytest.mark.parametrize("model", list(ROWS))
def test_lora_trains_adapters_only_and_loads_with_load_lora_weights(runs, model):
    import diffusers

    run_dir, _, proc = runs[model, "lora-zero3"]
    assert "entries, built now" not in proc.stdout  # no cache: the references are encoded at each step
    check_lora_export(run_dir, proc, model, getattr(diffusers, ROWS[model].pipeline_class), _render(model))


@pytest.mark.parametrize("model", list(ROWS))
def test_lora_zero3_with_checkpointing_resumes_exactly(runs, model, tmp_path):
    check_resume(*runs[model, "lora-zero3"], tmp_path / "resumed", Path("pytorch_lora_weights.safetensors"))
