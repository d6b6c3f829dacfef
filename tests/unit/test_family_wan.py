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


# ------------------------------------------------------------------------------------------- family wan
import pytest  # noqa: E402

from dstune.data.synthetic import moving_shape  # noqa: E402
from dstune.data.video import VideoCaptionDataset, collate_video  # noqa: E402
from dstune.families import wan  # noqa: E402
from dstune.families.base import per_sample_randn  # noqa: E402
from dstune.pretrained import build_model  # noqa: E402
from dstune.spec.models import DataSpec, SampleSpec, WanModel  # noqa: E402

SEED, STEP, INDICES = 5, 2, [1, 8, 13]


@pytest.fixture(scope="module")
def built():
    return build_model(WanModel(family="wan", gradient_checkpointing=True), CACHE_DIR, "cpu")


def _batch(indices=INDICES, frames=5) -> dict:
    data = DataSpec(path="builtin:moving-shapes", video={"frames": frames})
    from dstune.data.index import list_samples

    dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED)
    return collate_video([dataset[i] for i in indices])


def test_moving_shapes_clips_move_and_their_captions_say_where():
    batch = _batch([0, 18, 36, 54], frames=9)
    assert batch["pixel_values"].shape == (4, 3, 9, 32, 32)
    assert [moving_shape(i).direction for i in (0, 18, 36, 54)] == ["left", "right", "up", "down"]
    assert batch["caption"][0] == "a red circle moving left"
    for clip, axis, sign in zip(batch["pixel_values"], (1, 1, 0, 0), (-1, 1, -1, 1)):  # axis 1: x, 0: y
        centres = []
        for frame in clip.unbind(dim=1):  # (3, H, W); the corner shows the background
            shape_pixels = ((frame - frame[:, :1, :1]).abs().sum(dim=0) > 0.3).nonzero().float()
            centres.append(shape_pixels[:, axis].mean())
        moves = torch.stack(centres).diff()
        assert (moves * sign > 0).all(), (axis, sign, moves)


def test_noisy_latent_and_target_are_what_the_scheduler_defines(built):
    """x_t and the target at a table position equal FlowMatchEulerDiscreteScheduler(shift=flow_shift).scale_noise
    on the same latents, timestep and noise, and noise - x0 (the velocity diffusers' flow scripts regress)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    assert built.scheduler.config.flow_shift == 3.0
    reference = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    latents = per_sample_randn((16, 2, 4, 4), SEED, STEP, INDICES, "latents")
    noise = per_sample_randn((16, 2, 4, 4), SEED, STEP, INDICES, "noise")
    positions = torch.tensor([0, 417, 999])
    timesteps, sigmas, noisy, target = wan.noisy_and_target(built, latents, noise, positions)
    expected = torch.cat([reference.scale_noise(latents[i:i + 1], reference.timesteps[p:p + 1], noise[i:i + 1])
                          for i, p in enumerate(positions.tolist())])
    assert torch.equal(timesteps, reference.timesteps[positions].float())
    assert torch.allclose(noisy, expected, atol=1e-6) and torch.allclose(target, noise - latents, atol=1e-6)
    shifted = wan.train_tables({"shift": 5.0, "num_train_timesteps": 1000}, None)
    assert shifted[2] == 5.0 and torch.allclose(shifted[1], FlowMatchEulerDiscreteScheduler(shift=5.0).sigmas)


def test_loss_normalises_latents_with_the_vae_config_and_trains(built):
    batch = _batch()
    encoded = wan.encode_batch(built, batch)
    assert encoded["latent_mean"].shape == (3, 16, 2, 4, 4)
    assert encoded["encoder_hidden_states"].shape == (3, built.max_sequence_length, 32)
    value = wan.loss(built, built.trainable, encoded, SEED, STEP)
    assert value.ndim == 0 and torch.isfinite(value)
    assert torch.equal(value, wan.loss(built, built.trainable, encoded, SEED, STEP))  # per-sample draws only
    value.backward()
    grads = [p.grad for p in built.trainable.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    built.trainable.zero_grad(set_to_none=True)
    mean = torch.tensor(built.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(built.vae.config.latents_std).view(1, -1, 1, 1, 1)
    from dstune.families.flow_recipe import normalised_latents

    assert torch.allclose(normalised_latents(built.vae.config, encoded["latent_mean"]),
                          (encoded["latent_mean"] - mean) / std)


def test_samples_are_animated_pngs(built, tmp_path):
    from PIL import Image

    from dstune.families.samples import save_clip_grid

    clips = wan.sample(built, built.trainable, ["a red circle moving left"], SampleSpec(steps=2), 32)
    assert len(clips) == 1 and len(clips[0]) == 5 and clips[0][0].size == (32, 32)
    path = save_clip_grid(clips, ["a red circle moving left"], tmp_path / "step-000001.png")
    with Image.open(path) as image:
        assert image.is_animated and image.n_frames == 5


def test_folders_of_other_wan_pipelines_are_refused_with_the_reason(tmp_path):
    folder = tiny.ensure_builtin_model("tiny-wan", CACHE_DIR)
    copy = tmp_path / "a14b"
    import shutil

    shutil.copytree(folder, copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="two experts"):
        wan.build(WanModel(family="wan"), {"pretrained": copy}, "cpu")


def test_cache_on_disk_is_what_the_cache_stores_per_clip(built):
    """validate's "cache on disk" for one 9-frame 32 px clip under fp32 equals the bytes the cache writes: the
    posterior's mean and std of its 3 latent frames and the caption's UMT5 embedding."""
    from dstune.families.diffusion import vae_posterior
    from dstune.model_sizes import count_model
    from dstune.spec.models import Spec

    spec = Spec.model_validate({"model": {"family": "wan", "max_sequence_length": 32},
                                "data": {"path": "builtin:moving-shapes", "video": {"frames": 9},
                                         "cache": {"latents": True, "text_embeddings": True}},
                                "train": {"global_batch_size": 1, "max_steps": 1, "precision": "fp32"}})
    mean, std = vae_posterior(built.vae, torch.zeros(1, 3, 9, 32, 32))
    assert mean.shape == (1, 16, 3, 4, 4)
    text = wan.encode_captions(built, ["a red circle moving left"])["encoder_hidden_states"]
    assert count_model(spec, 1).cache_bytes == 4 * (mean.numel() + std.numel()) + text.numel() * text.element_size()


def test_the_14b_launch_example_is_planned_from_the_stored_configs(capsys):
    """Wan2.1-T2V-14B's stored configs count as published (14.3 B transformer, 5.68 B UMT5-XXL encoder, 127 M VAE);
    rank-32 adapters on the four attention projections of both attentions of 40 blocks of width 5120."""
    from dstune.cli import main

    spec = str(REPO / "launch" / "wan21-t2v-14b-lora-zero3-8gpu.yaml")
    assert main(["validate", spec, "--num-gpus", "8", "--num-samples", "2000", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)["memory"]["parameters"]
    assert 14.2e9 < counts["module_params"] < 14.4e9 and 5.6e9 < counts["companions"]["text_encoder"] < 5.75e9
    assert 120e6 < counts["companions"]["vae"] < 130e6
    assert counts["trainable_params"] == 40 * 2 * 4 * 32 * (5120 + 5120)
