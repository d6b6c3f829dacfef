"""Real 2-rank DeepSpeed training of FLUX.2 [klein] (builtin:tiny-flux2, the flow family's flux2_klein recipe) on
CPU: full fine-tuning under ZeRO 2 from cached latents and text embeddings (trains, samples, exports a folder
Flux2KleinPipeline loads and renders with) and LoRA under ZeRO 3 with gradient checkpointing (only adapters train,
the LoRA file loads with Flux2KleinPipeline.load_lora_weights and changes the image, and a resume from step 2
continues exactly). Three launches in all (helpers: flow_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flow_runs import check_full_export, check_lora_export, check_resume, check_trains, launch_cases

pytestmark = pytest.mark.dist

MODEL = "tiny-flux2"
CASES = {"flux2-zero2": (2, "full"), "flux2-lora-zero3": (3, "lora")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return launch_cases(tmp_path_factory, MODEL, CASES)


def _render(pipeline) -> torch.Tensor:
    return pipeline(prompt="a red circle", height=32, width=32, num_inference_steps=2, guidance_scale=1.0,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images.float()


@pytest.mark.parametrize("name", list(CASES))
def test_trains_checks_and_logs(runs, name):
    check_trains(runs[name][0], runs[name][2])


def test_full_export_loads_in_flux2_klein_pipeline_and_renders(runs):
    from diffusers import Flux2KleinPipeline

    check_full_export(runs["flux2-zero2"][0], runs["flux2-zero2"][2], MODEL, Flux2KleinPipeline, _render)


def test_lora_trains_adapters_only_and_loads_with_load_lora_weights(runs):
    from diffusers import Flux2KleinPipeline

    check_lora_export(runs["flux2-lora-zero3"][0], runs["flux2-lora-zero3"][2], MODEL, Flux2KleinPipeline, _render)


def test_zero3_lora_resume_continues_exactly(runs, tmp_path):
    check_resume(*runs["flux2-lora-zero3"], tmp_path / "resumed", Path("pytorch_lora_weights.safetensors"))
