"""Real 2-rank DeepSpeed training of Qwen-Image (builtin:tiny-qwen-image, the flow family's qwen_image recipe) on
CPU: full fine-tuning under ZeRO 2 from cached latents and text embeddings (trains, samples, resumes exactly,
exports a folder QwenImagePipeline loads and renders with) and LoRA under ZeRO 3 with gradient checkpointing (only
adapters train; the LoRA file loads with QwenImagePipeline.load_lora_weights and changes the image). Three launches
in all (helpers: flow_runs.py)."""

from __future__ import annotations

import pytest
import torch

from flow_runs import TRANSFORMER, check_full_export, check_lora_export, check_resume, check_trains, launch_cases

pytestmark = pytest.mark.dist

MODEL = "tiny-qwen-image"
CASES = {"qwen-zero2": (2, "full"), "qwen-lora-zero3": (3, "lora")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return launch_cases(tmp_path_factory, MODEL, CASES)


def _render(pipeline) -> torch.Tensor:
    return pipeline(prompt="a red circle", height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images.float()


@pytest.mark.parametrize("name", list(CASES))
def test_trains_checks_and_logs(runs, name):
    check_trains(runs[name][0], runs[name][2])


def test_full_export_loads_in_qwen_image_pipeline_and_renders(runs):
    from diffusers import QwenImagePipeline

    check_full_export(runs["qwen-zero2"][0], runs["qwen-zero2"][2], MODEL, QwenImagePipeline, _render)


def test_lora_trains_adapters_only_and_loads_with_load_lora_weights(runs):
    from diffusers import QwenImagePipeline

    check_lora_export(runs["qwen-lora-zero3"][0], runs["qwen-lora-zero3"][2], MODEL, QwenImagePipeline, _render)


def test_zero2_resume_continues_exactly(runs, tmp_path):
    check_resume(*runs["qwen-zero2"], tmp_path / "resumed", TRANSFORMER)
