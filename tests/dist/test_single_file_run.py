"""Training from a single checkpoint file: the tiny sd model written as one file in the original key layout
(model.diffusion_model.*, cond_stage_model.*; no VAE, which comes from model.base_pipeline) is converted, trained for
two steps on one rank (plain `python dstune/train.py spec`, the cheapest launch) and exported. The export is a
diffusers pipeline that loads, whose UNet moved away from the file's weights, and whose text encoder is the file's.

One launch, 1 rank (~30-60 s here): the single-file path is the same on every rank (rank 0 converts first, the others
read the converted folder from the cache), so 2 ranks would test nothing more."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from harness import CACHE_DIR, REPO, base_spec, explain, launch, metrics, write_spec

sys.path.insert(0, str(REPO / "tests" / "unit"))  # the fixture writer of the unit tests

from test_single_file import write_sd_single_file  # noqa: E402

pytestmark = pytest.mark.dist
STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from dstune import builtin as tiny

    root = tmp_path_factory.mktemp("single-file")
    checkpoint = root / "tiny-sd-original.safetensors"
    weights = write_sd_single_file(checkpoint)
    base = tiny.ensure_builtin_model("tiny-sd", CACHE_DIR)
    spec = base_spec(root / "run", model={"pretrained": str(checkpoint), "base_pipeline": str(base)},
                     train={"max_steps": STEPS, "optimizer": {"type": "adamw", "lr": 1e-2}},
                     output={"export": "diffusers", "cache_dir": str(root / "cache")})
    proc = launch(write_spec(root / "spec.yaml", spec), num_ranks=1)
    return root / "run", proc, weights, base


def test_a_model_trained_from_a_single_file_exports_a_pipeline_diffusers_loads(run):
    from diffusers import StableDiffusionPipeline

    run_dir, proc, weights, base = run
    assert proc.returncode == 0, explain(proc)
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, STEPS + 1))
    pipe = StableDiffusionPipeline.from_pretrained(run_dir / "export" / f"step-{STEPS:08d}", safety_checker=None)
    unet, text = pipe.unet.state_dict(), pipe.text_encoder.state_dict()
    moved = max((unet[k] - v).abs().max().item() for k, v in weights["unet"].items())
    assert moved > 1e-4  # trained away from the file's UNet
    shared = [k for k in weights["text_encoder"] if k in text]
    assert shared and all(torch.equal(text[k], weights["text_encoder"][k]) for k in shared)  # the file's
    reference = StableDiffusionPipeline.from_pretrained(base, safety_checker=None).vae.state_dict()
    assert all(torch.equal(pipe.vae.state_dict()[k], v) for k, v in reference.items())  # the base's VAE
    converted = next((run_dir.parent / "cache" / "single-file").iterdir())
    assert json.loads((converted / "dstune_single_file.json").read_text())["from_base"] == ["vae"]
