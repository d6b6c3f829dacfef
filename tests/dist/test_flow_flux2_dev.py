"""Real 2-rank DeepSpeed training of FLUX.2 [dev] (builtin:tiny-flux2-dev, the flow family's flux2_dev recipe: a
tiny Mistral3 and the stand-in fast tokenizer in a Flux2Pipeline folder) on CPU: LoRA under ZeRO 3 with gradient
checkpointing (only adapters train; the LoRA file loads with Flux2Pipeline.load_lora_weights and changes the image)
and full fine-tuning under ZeRO 2 from cached latents and text embeddings (samples, and an export that
Flux2Pipeline.from_pretrained loads and renders with). Two launches (helpers: flow_runs.py); the transformer and
the loss are klein's, whose resume test (test_flow_flux2.py) is not repeated here."""

from __future__ import annotations

import pytest
import torch

from flow_runs import check_full_export, check_lora_export, check_trains, flow_spec
from harness import CACHE_DIR, launch, write_spec

pytestmark = pytest.mark.dist

MODEL = "tiny-flux2-dev"
CASES = {"flux2-dev-lora-zero3": (3, "lora"), "flux2-dev-zero2": (2, "full")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from dstune.builtin import ensure_builtin_model

    ensure_builtin_model(MODEL, CACHE_DIR)  # built once here, not by both launches' rank 0
    out = {}
    for name, (stage, train) in CASES.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"
        spec_path = write_spec(run_dir.parent / "spec.yaml", flow_spec(run_dir, MODEL, stage, train))
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
    return out


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
