"""Wan 2.1 text-to-video (its card and class, dstune.models.wan; model.family video) on builtin:tiny-wan's real
components and builtin:moving-shapes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dstune import builtin as tiny
from dstune.data.synthetic import moving_shape
from dstune.families import card_of, load_model
from dstune.families.flow_model import noisy_at, normalised_latents
from dstune.families.randomness import per_sample_randn
from dstune.memory.counts import STORE
from dstune.models.wan.card import WAN_CARD
from dstune.models.wan.model import Wan, train_tables
from dstune.pretrained import build_model
from dstune.spec.models import SampleSpec, VideoModelSpec
from dstune.spec.video_models import expert_problems, expert_range_text
from loaded_models import CACHE_DIR, with_settings
from tiny_batches import clip_batch


def test_builtin_tiny_wan_is_a_wan_pipeline_that_renders_frames():
    from diffusers import UniPCMultistepScheduler, WanPipeline

    folder = tiny.ensure_builtin_model("builtin:tiny-wan", CACHE_DIR)
    pipeline = WanPipeline.from_pretrained(folder)
    assert isinstance(pipeline.scheduler, UniPCMultistepScheduler) and pipeline.scheduler.config.flow_shift == 3.0
    assert (pipeline.vae.config.scale_factor_spatial, pipeline.vae.config.scale_factor_temporal) == (8, 4)
    frames = pipeline(
        "a red circle moving left",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).frames
    assert frames.shape == (1, 5, 32, 32, 3) and np.isfinite(frames).all() and frames.std() > 0
    for config in sorted((STORE / "builtin" / "tiny-wan-v1").rglob("*.json")):  # what validate plans with
        relative = config.relative_to(STORE / "builtin" / "tiny-wan-v1")
        assert json.loads((folder / relative).read_text()) == json.loads(config.read_text()), relative


# ------------------------------------------------------------------------------------------- the Wan class

SEED, STEP, INDICES = 5, 2, [1, 8, 13]


@pytest.fixture(scope="module")
def built():
    return build_model(VideoModelSpec(family="video", gradient_checkpointing=True), CACHE_DIR, "cpu")


def _batch(indices=INDICES, frames=5) -> dict:
    return clip_batch(indices, SEED, frames)


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


def test_noisy_latent_is_what_the_scheduler_defines(built):
    """x_t at a table position equals FlowMatchEulerDiscreteScheduler(shift=flow_shift).scale_noise on the same
    latents, timestep and noise, with sigmas shaped for the clip's 5-D latents (the core's noisy_at)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    assert built.scheduler.config.flow_shift == 3.0
    reference = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    latents = per_sample_randn((16, 2, 4, 4), SEED, STEP, INDICES, "latents")
    noise = per_sample_randn((16, 2, 4, 4), SEED, STEP, INDICES, "noise")
    positions = torch.tensor([0, 417, 999])
    timesteps = built.train_timesteps[positions]
    sigmas, noisy = noisy_at(latents, noise, built.train_sigmas[positions])
    expected = torch.cat(
        [
            reference.scale_noise(latents[i : i + 1], reference.timesteps[p : p + 1], noise[i : i + 1])
            for i, p in enumerate(positions.tolist())
        ]
    )
    assert torch.equal(timesteps, reference.timesteps[positions].float())
    assert sigmas.shape == (3, 1, 1, 1, 1) and torch.allclose(noisy, expected, atol=1e-6)
    shifted = train_tables({"shift": 5.0, "num_train_timesteps": 1000}, None)
    assert shifted[2] == 5.0 and torch.allclose(shifted[1], FlowMatchEulerDiscreteScheduler(shift=5.0).sigmas)


def test_loss_normalises_latents_with_the_vae_config_and_trains(built):
    batch = _batch()
    encoded = built.encode_batch(batch)
    assert encoded["latent_mean"].shape == (3, 16, 2, 4, 4)
    assert encoded["encoder_hidden_states"].shape == (3, built.max_sequence_length, 32)
    value = built.loss(built.trainable, encoded, SEED, STEP)
    assert value.ndim == 0 and torch.isfinite(value)
    assert torch.equal(value, built.loss(built.trainable, encoded, SEED, STEP))  # per-sample draws only
    value.backward()
    grads = [p.grad for p in built.trainable.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    built.trainable.zero_grad(set_to_none=True)
    mean = torch.tensor(built.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(built.vae.config.latents_std).view(1, -1, 1, 1, 1)
    assert torch.allclose(
        normalised_latents(built.vae.config, encoded["latent_mean"]), (encoded["latent_mean"] - mean) / std
    )


def test_latents_of_images_or_of_sides_the_patch_does_not_divide_are_refused_with_the_fix(built):
    """The core checks a batch's latents before any encoder runs: Wan trains on clips (5-D latents), and the
    transformer's 2x2 patch needs even latent sides (16 px multiples); the message names both numbers and the key."""
    cached = {"index": torch.tensor([1]), "caption": ["a red circle"]}
    image = {**cached, "latent_mean": torch.zeros(1, 16, 4, 4), "latent_std": torch.ones(1, 16, 4, 4)}
    with pytest.raises(
        ValueError,
        match=r"model.family video trains on clips \(B, 3, frames, H, W\); the batch's latents are "
        r"\(1, 16, 4, 4\)",
    ):
        built.encode_batch(image)
    odd = {**cached, "latent_mean": torch.zeros(1, 16, 2, 4, 5), "latent_std": torch.ones(1, 16, 2, 4, 5)}
    with pytest.raises(
        ValueError,
        match=r"takes 2x2 latent patches, so clip heights must be multiples of 16 px and "
        r"widths of 16 px; got 40x32 \(width x height\)\. Change data.resolution",
    ):
        built.encode_batch(odd)


def test_samples_are_animated_webp_and_mp4_clips(built, tmp_path):
    """A step's clips: an animated WebP grid (what the samples page shows) and an H.264 MP4 of the same frames that
    PyAV decodes back; the page links the MP4 under the WebP."""
    import av
    from PIL import Image

    from dstune.families.samples import save_clip_grid, write_contact_sheet

    clips = built.sample(built.trainable, ["a red circle moving left"], SampleSpec(steps=2), 32)
    assert len(clips) == 1 and len(clips[0]) == 5 and clips[0][0].size == (32, 32)
    path = save_clip_grid(clips, ["a red circle moving left"], tmp_path / "step-000001.png")
    assert path.name == "step-000001.webp"
    with Image.open(path) as image:
        assert image.format == "WEBP" and image.is_animated and image.n_frames == 5
        image.seek(4)
        last = np.asarray(image.convert("RGB"))
    with av.open(str(tmp_path / "step-000001.mp4")) as container:
        stream = container.streams.video[0]
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    assert stream.codec_context.name == "h264" and len(decoded) == 5
    assert np.abs(decoded[4][: last.shape[0], : last.shape[1]].astype(int) - last).mean() < 12  # lossy, same picture
    page = write_contact_sheet(tmp_path, ["a red circle moving left"], "trained").read_text()
    assert '<img src="step-000001.webp"' in page and '<a href="step-000001.mp4">MP4</a>' in page


def _load(spec: VideoModelSpec, folder):
    """The model of a local folder as start-up loads it: its card (by the folder's classes), then the class."""
    return load_model(card_of("video", folder), spec, {"pretrained": folder}, "cpu", torch.float32)


def test_builtin_is_a_wan_pipeline_folder_and_loads_as_wan(built):
    folder = tiny.ensure_builtin_model("tiny-wan", CACHE_DIR)
    assert card_of("video", folder) is WAN_CARD and built.card is WAN_CARD and type(built) is Wan


def test_folders_of_other_wan_pipelines_are_refused_with_the_reason(tmp_path):
    folder = tiny.ensure_builtin_model("tiny-wan", CACHE_DIR)
    copy = tmp_path / "i2v"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]  # listed, but no folder
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="no transformer_2/ subfolder"):
        _load(VideoModelSpec(family="video", expert="high_noise"), copy)
    del index["transformer_2"]
    index["image_encoder"] = ["transformers", "CLIPVisionModel"]  # an image encoder nothing reads
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="has an image_encoder but the transformer has no image_dim"):
        _load(VideoModelSpec(family="video"), copy)


# ------------------------------------------------------------------------- two experts (Wan 2.2 A14B layout)


@pytest.fixture(scope="module")
def low_noise():
    return build_model(
        VideoModelSpec(family="video", pretrained="builtin:tiny-wan-a14b", expert="low_noise"), CACHE_DIR, "cpu"
    )


def test_two_expert_folders_need_model_expert_and_one_expert_folders_refuse_it():
    with pytest.raises(ValueError, match="set model.expert to high_noise .* or low_noise"):
        build_model(VideoModelSpec(family="video", pretrained="builtin:tiny-wan-a14b"), CACHE_DIR, "cpu")
    with pytest.raises(ValueError, match="model.expert high_noise applies to two-expert folders"):
        build_model(VideoModelSpec(family="video", expert="high_noise"), CACHE_DIR, "cpu")


def test_an_expert_trains_its_own_component_on_its_own_timesteps(low_noise):
    """low_noise trains transformer_2 on the table's timesteps below boundary_ratio x 1000 (WanPipeline runs it
    there), high_noise transformer on the rest; the loss only draws positions from the expert's range."""
    from safetensors.torch import load_file

    assert low_noise.trained_component() == "transformer_2" and low_noise.model_index["boundary_ratio"] == 0.875
    weights = load_file(low_noise.folder / "transformer_2" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(weights[name], p) for name, p in low_noise.trainable.state_dict().items())
    first, count = low_noise.positions
    assert first + count == len(low_noise.train_timesteps) and count > 0
    assert (low_noise.train_timesteps[first:] < 875).all() and (low_noise.train_timesteps[:first] >= 875).all()
    assert with_settings(low_noise, expert="high_noise").training_positions() == (0, first)
    seen = []
    encoded = low_noise.encode_batch(_batch())

    def forward(**inputs):
        seen.extend(inputs["timestep"].tolist())
        return low_noise.trainable(**inputs)

    for step in range(5):
        low_noise.loss(forward, encoded, SEED, step)
    assert len(seen) == 15 and max(seen) < 875


def test_timestep_range_narrows_the_expert_and_must_stay_on_its_side_of_the_boundary(low_noise):
    """model.timestep_range: the loss draws only timesteps in [min, max]; a range across the folder's boundary is
    refused naming the boundary and the fix; the low-noise side never includes t == boundary (WanPipeline runs the
    high-noise expert there)."""
    index = {"boundary_ratio": 0.875, "transformer_2": ["diffusers", "WanTransformer3DModel"]}
    assert {k: low_noise.model_index[k] for k in index} == index
    table = low_noise.train_timesteps
    first, count = with_settings(low_noise, timestep_range=(200, 600)).training_positions()
    picked = table[first : first + count]
    assert count > 0 and picked.min() >= 200 and picked.max() <= 600
    assert ((table >= 200) & (table <= 600)).sum() == count
    whole = with_settings(low_noise, timestep_range=(0, 875)).training_positions()
    assert whole == low_noise.positions  # max == boundary: still only t < 875
    problems = expert_problems(index, "low_noise", (500, 900))
    assert problems and "above the boundary 875" in problems[0] and "lower max to 875" in problems[0]
    problems = expert_problems(index, "high_noise", (800, 1000))
    assert problems and "below the boundary 875" in problems[0] and "raise min to 875" in problems[0]
    with pytest.raises(ValueError, match="timestep_range .* above the boundary 875"):
        build_model(
            VideoModelSpec(
                family="video", pretrained="builtin:tiny-wan-a14b", expert="low_noise", timestep_range=(100, 900)
            ),
            CACHE_DIR,
            "cpu",
        )
    with pytest.raises(ValueError, match="0 <= min < max"):
        VideoModelSpec(family="video", timestep_range=(600, 200))
    assert "low_noise (transformer_2) trains timesteps 200 to 600 of 1000" in expert_range_text(
        index, "low_noise", (200, 600)
    )
    assert "trains timesteps 0 to < 875 of 1000" in expert_range_text(index, "low_noise")


def test_low_noise_expert_exports_and_its_lora_loads_into_transformer_2(low_noise, tmp_path):
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from dstune.families.lora import apply_train_mode, export_lora

    state = {name: value + 0.01 for name, value in low_noise.trainable.state_dict().items()}
    out = low_noise.export(state, tmp_path / "full")
    trained = load_file(out / "transformer_2" / "diffusion_pytorch_model.safetensors")
    kept = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    start = load_file(low_noise.folder / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(trained[k], state[k]) for k in state) and all(torch.equal(kept[k], start[k]) for k in start)

    spec = VideoModelSpec(family="video", pretrained="builtin:tiny-wan-a14b", expert="low_noise", train="lora")
    model = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(model, spec, seed=0)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:  # B starts at zero: "train" it
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    lora = export_lora(
        model, {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}, tmp_path / "lora", spec
    )
    encoded = model.encode_batch(_batch([1]))
    pipeline = WanPipeline.from_pretrained(model.folder)
    with torch.no_grad():
        base_loss = model.loss(pipeline.transformer_2, encoded, 0, 1)
    pipeline.load_lora_weights(lora, load_into_transformer_2=True)
    with torch.no_grad():
        trained_loss, loaded = (
            model.loss(module, encoded, 0, 1) for module in (model.trainable, pipeline.transformer_2)
        )
    assert loaded.item() == pytest.approx(trained_loss.item(), rel=1e-6) and loaded.item() != base_loss.item()
    from diffusers import WanTransformer3DModel

    # samples run both experts, each on its side of the boundary; the other one exists only while they render
    assert model.other_expert is None
    calls = {"trained": 0, "other": 0}

    def count(module, *_):
        if isinstance(module, WanTransformer3DModel):
            calls["trained" if module is model.trainable else "other"] += 1

    hook = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        clips = model.sample(model.trainable, ["a red circle moving left"], SampleSpec(steps=4), 32)
    finally:
        hook.remove()
    assert len(clips[0]) == 5 and calls["trained"] > 0 and calls["other"] > 0, calls
    assert model.other_expert is None


def test_each_video_model_says_its_own_text_length_default_everywhere():
    """The spec reference's model table says each video model's max_sequence_length default (its card's spec_notes)
    and its card's default_text_tokens is what validate's memory plan counts and training pads to: the two agree for
    every video card, and each of its built-ins is a folder of that card, so that editing one cannot leave the other
    saying another number."""
    import re

    from dstune import registry
    from dstune.reference import model_table

    table = "\n".join(model_table())
    for card in registry.family_cards("video"):
        note = card.spec_notes["model.max_sequence_length"]
        assert f"`model.max_sequence_length` {note}" in table, card.name
        noted = int(re.match(r"\d+", note).group())
        assert card.default_text_tokens == noted, card.name
        for name in card.builtins:
            folder = tiny.ensure_builtin_model(name, CACHE_DIR)
            assert card_of("video", folder) is card, (card.name, name)


def test_vae_latents_mean_trains_on_the_posterior_mean_and_the_default_samples_it(built):
    """model.vae_latents: mean trains on the posterior's mean (musubi-tuner's and DiffSynth-Studio's Wan latents):
    the same loss as the default's with a zero std; Wan's default draws from the posterior, so with the real std
    it differs. Nothing else moves: the noise and timestep draws are the same either way."""
    encoded = built.encode_batch(_batch())
    assert built.posterior_mean() is False  # Wan's default: a draw (dstune's reference: diffusers' draws)
    with torch.no_grad():
        default = built.loss(built.trainable, encoded, SEED, STEP)
        without_std = built.loss(
            built.trainable, {**encoded, "latent_std": torch.zeros_like(encoded["latent_std"])}, SEED, STEP
        )
        on_mean = with_settings(built, vae_latents="mean")
        assert on_mean.posterior_mean() is True
        mean_loss = on_mean.loss(built.trainable, encoded, SEED, STEP)
    assert torch.equal(mean_loss, without_std)
    assert not torch.equal(mean_loss, default)
    explicit = with_settings(built, vae_latents="sample")
    with torch.no_grad():
        assert torch.equal(explicit.loss(built.trainable, encoded, SEED, STEP), default)


def test_the_comfyui_lora_of_wan_has_the_original_layer_names_and_diffusers_reads_it_back(tmp_path, capsys):
    """output.lora_format comfyui on Wan: the original checkpoint's layer names (`diffusion_model.blocks.N.
    self_attn.q`, what ComfyUI's Wan loader maps) with alpha; diffusers' own reading of such files gives back the
    trained adapters (the pipeline's transformer reproduces the trained loss). A layer without an original name is
    refused before training, and a video model without such names (LTX-2) is refused by validate."""
    import yaml
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from dstune.cli import main
    from dstune.families.base import FamilyError
    from dstune.families.lora import apply_train_mode, export_lora

    spec = VideoModelSpec(family="video", pretrained="builtin:tiny-wan", train="lora", lora={"rank": 4, "alpha": 8})
    model = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(model, spec, seed=0, lora_format="comfyui")
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:  # B starts at zero: "train" it
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    state = {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}
    out = export_lora(model, state, tmp_path / "lora", spec, lora_format="comfyui")
    tensors = load_file(out / "pytorch_lora_weights.safetensors")
    assert all(k.startswith("diffusion_model.blocks.") for k in tensors), sorted(tensors)[:4]
    assert {k.split(".")[3] for k in tensors} == {"self_attn", "cross_attn"}  # the attention projections' names
    assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in tensors
    assert tensors["diffusion_model.blocks.1.cross_attn.o.alpha"].item() == 8.0
    assert json.loads((out / "dstune_lora.json").read_text())["format"] == "comfyui"
    encoded = model.encode_batch(_batch([1]))
    pipeline = WanPipeline.from_pretrained(model.folder)
    with torch.no_grad():
        base_loss = model.loss(pipeline.transformer, encoded, 0, 1)
    pipeline.load_lora_weights(out)
    with torch.no_grad():
        trained, loaded = (model.loss(module, encoded, 0, 1) for module in (model.trainable, pipeline.transformer))
    assert loaded.item() == pytest.approx(trained.item(), rel=1e-6) and loaded.item() != base_loss.item()

    other = VideoModelSpec(
        family="video", pretrained="builtin:tiny-wan", train="lora", lora={"target_modules": ["proj_out"]}
    )
    with pytest.raises(FamilyError, match="no name in the model's original checkpoints"):
        apply_train_mode(build_model(other, CACHE_DIR, "cpu"), other, 0, lora_format="comfyui")

    spec_file = tmp_path / "ltx2.yaml"
    spec_file.write_text(
        yaml.safe_dump(
            {
                "model": {"family": "video", "pretrained": "builtin:tiny-ltx2", "train": "lora"},
                "data": {"path": "builtin:moving-shapes-av", "resolution": 32, "video": {"frames": 9}},
                "train": {"micro_batch_size": 1, "max_steps": 1},
                "output": {"lora_format": "comfyui"},
            }
        )
    )
    assert main(["validate", str(spec_file)]) == 1
    assert "dstune has no ComfyUI format for LTX-2" in capsys.readouterr().out
