"""Wan 2.1 text-to-video (model.family wan) on builtin:tiny-wan's real components and builtin:moving-shapes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from dstune import builtin as tiny
from dstune.model_sizes import STORE

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))


def test_builtin_tiny_wan_is_a_wan_pipeline_that_renders_frames():
    from diffusers import UniPCMultistepScheduler, WanPipeline

    folder = tiny.ensure_builtin_model("builtin:tiny-wan", CACHE_DIR)
    pipeline = WanPipeline.from_pretrained(folder)
    assert isinstance(pipeline.scheduler, UniPCMultistepScheduler) and pipeline.scheduler.config.flow_shift == 3.0
    assert (pipeline.vae.config.scale_factor_spatial, pipeline.vae.config.scale_factor_temporal) == (8, 4)
    frames = pipeline("a red circle moving left", height=32, width=32, num_frames=5, num_inference_steps=2,
                      max_sequence_length=32, generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert frames.shape == (1, 5, 32, 32, 3) and np.isfinite(frames).all() and frames.std() > 0
    for config in sorted((STORE / "builtin" / "tiny-wan-v1").rglob("*.json")):  # what validate plans with
        relative = config.relative_to(STORE / "builtin" / "tiny-wan-v1")
        assert json.loads((folder / relative).read_text()) == json.loads(config.read_text()), relative
