"""Real 2-rank DeepSpeed training of FLUX.2 [dev] (builtin:tiny-flux2-dev, the flow family's flux2_dev recipe: a
tiny Mistral3 and the stand-in fast tokenizer in a Flux2Pipeline folder) on CPU: LoRA under ZeRO 3 with gradient
checkpointing (only adapters train; the LoRA file loads with Flux2Pipeline.load_lora_weights and changes the image)
and full fine-tuning under ZeRO 2 from cached latents and text embeddings (samples, and an export that
Flux2Pipeline.from_pretrained loads and renders with), which resumes exactly from step 2 with its cached Mistral3
text (klein's module resumes a ZeRO-3 LoRA run). Three launches (helpers: flow_runs.py)."""

from __future__ import annotations

import pytest
import torch

from flow_runs import TRANSFORMER, check_full_export, check_lora_export, check_resume, check_trains, launch_cases

pytestmark = pytest.mark.dist

MODEL = "tiny-flux2-dev"
CASES = {"flux2-dev-lora-zero3": (3, "lora"), "flux2-dev-zero2": (2, "full")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return launch_cases(tmp_path_factory, MODEL, CASES)


def _render(pipeline) -> torch.Tensor:
    """Flux2Pipeline feeds guidance_scale to the guidance embedding (no classifier-free pass)."""
    return pipeline(prompt="a red circle", height=32, width=32, num_inference_steps=2, guidance_scale=4.0,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images.float()


@pytest.mark.parametrize("name", list(CASES))
def test_trains_checks_and_logs(runs, name):
    check_trains(runs[name][0], runs[name][2])


def test_lora_trains_adapters_only_and_loads_with_load_lora_weights(runs):
    from diffusers import Flux2Pipeline

    check_lora_export(runs["flux2-dev-lora-zero3"][0], runs["flux2-dev-lora-zero3"][2], MODEL, Flux2Pipeline,
                      _render)


def test_full_export_loads_in_flux2_pipeline_and_renders(runs):
    from diffusers import Flux2Pipeline

    check_full_export(runs["flux2-dev-zero2"][0], runs["flux2-dev-zero2"][2], MODEL, Flux2Pipeline, _render)


def test_zero2_full_resume_continues_exactly(runs, tmp_path):
    check_resume(*runs["flux2-dev-zero2"], tmp_path / "resumed", TRANSFORMER)
