"""Stable Diffusion 1.x/2.x (its card and class, dstune.models.sd) and the built-in tiny model, on the real (tiny)
components: no mocks.

The built-in model is built once per session (~20 s); one more build checks determinism and the cache protocol.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dstune.pretrained import build_model
from dstune.data.synthetic import render_shape
from dstune import builtin as tiny
from dstune.builtin.common import shapes_images, to_tensor
from dstune.models.sd.card import SD_CARD
from dstune.families.unet_model import min_snr_weights
from dstune.models.sd.model import Sd
from dstune.families.base import FamilyError
from dstune.spec.models import SampleSpec
from dstune.models.sd.spec import SdModelSpec
from loaded_models import CACHE_DIR, with_settings

MARKER = tiny.BUILTIN_MARKER
FOLDER = tiny.BUILTIN_MODELS["tiny-sd"].folder_name  # "tiny-sd-vN"
# Measured 0.0100 (mean over the 256 shapes, pixels in [-1, 1]); a random VAE gives ~0.3.
VAE_RECONSTRUCTION_MSE_MAX = 0.02


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The test session's model cache (shared with the 2-rank tests: the built-in model is built once per
    session); test_builtin_build_is_deterministic_... makes an independent second build to compare with."""
    tiny.ensure_builtin_model("builtin:tiny-sd", CACHE_DIR)
    return CACHE_DIR


@pytest.fixture(scope="session")
def tiny_folder(cache_dir) -> Path:
    return tiny.ensure_builtin_model("tiny-sd", cache_dir)


@pytest.fixture(scope="session")
def built(cache_dir):
    return build_model(SdModelSpec(family="sd"), cache_dir, "cpu", torch.float32)


@pytest.fixture(scope="session")
def sd15_style_folder(tiny_folder, tmp_path_factory) -> Path:
    """The tiny model as a user's SD 1.5-style folder: epsilon, SD's own schedule (non-zero terminal SNR)."""
    folder = tmp_path_factory.mktemp("user") / "sd15-style"
    shutil.copytree(tiny_folder, folder)
    path = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text())
    config.update(prediction_type="epsilon", rescale_betas_zero_snr=False, timestep_spacing="leading")
    path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def eps_built(sd15_style_folder):
    return build_model(
        SdModelSpec(family="sd", pretrained=str(sd15_style_folder)), sd15_style_folder, "cpu", torch.float32
    )


def _batch(indices: list[int]) -> dict:
    images = [render_shape(i, 32) for i in indices]
    return {
        "pixel_values": to_tensor([image for image, _ in images]),
        "captions": [caption for _, caption in images],
        "sample_ids": [f"shapes/{i:06d}" for i in indices],
        "indices": torch.tensor(indices, dtype=torch.long),
    }


def _loss(built, indices, seed=0, step=3):
    return built.loss(built.trainable, built.encode_batch(_batch(indices), torch.float32), seed, step)


# ----------------------------------------------------------------------------------------------- built-in model


def _weights(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))}


def test_builtin_build_is_deterministic_and_never_uses_a_half_built_folder(tiny_folder, tmp_path):
    half_built = tmp_path / "builtin" / FOLDER
    shutil.copytree(tiny_folder, half_built)
    (half_built / MARKER).unlink()  # what a crash before the marker would leave
    (half_built / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"truncated")
    folder = tiny.ensure_builtin_model("builtin:tiny-sd", tmp_path)
    assert folder == half_built and (folder / MARKER).is_file()
    reference = _weights(tiny_folder)
    assert set(reference) == {
        "unet/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
    }
    assert _weights(folder) == reference  # byte-identical to the session's independent build
    assert sorted(p.name for p in (tmp_path / "builtin").iterdir()) == [f".{FOLDER}.lock", FOLDER]


def test_builtin_reuses_a_complete_folder_and_a_winner_of_the_race(tiny_folder, tmp_path, monkeypatch):
    model = tiny.BUILTIN_MODELS["tiny-sd"]

    def must_not_build(work, needs):
        raise AssertionError("rebuilt a complete built-in model")

    monkeypatch.setitem(
        tiny.BUILTIN_MODELS, "tiny-sd", dataclasses.replace(model, build=must_not_build, pinned_process=False)
    )
    assert tiny.ensure_builtin_model("tiny-sd", tiny_folder.parent.parent) == tiny_folder

    final = tmp_path / "builtin" / FOLDER

    def another_process_finishes_first(work, needs):
        shutil.copytree(tiny_folder, final)  # e.g. a node without working file locks
        (work / "ours.txt").write_text("ours")
        return {}

    racing = dataclasses.replace(model, build=another_process_finishes_first, pinned_process=False)
    monkeypatch.setitem(tiny.BUILTIN_MODELS, "tiny-sd", racing)
    assert tiny.ensure_builtin_model("tiny-sd", tmp_path) == final
    assert not (final / "ours.txt").exists()  # theirs is used, ours discarded
    assert sorted(p.name for p in (tmp_path / "builtin").iterdir()) == [f".{FOLDER}.lock", FOLDER]


def test_unknown_builtin_names_the_known_ones(tmp_path):
    with pytest.raises(tiny.BuiltinError, match=r"unknown built-in model 'builtin:tiny-xl'.*builtin:tiny-sd"):
        tiny.ensure_builtin_model("builtin:tiny-xl", tmp_path)
    assert not (tmp_path / "builtin").exists()


def test_builtin_folder_reloads_with_from_pretrained(tiny_folder):
    from diffusers import AutoencoderKL, DiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    unet = UNet2DConditionModel.from_pretrained(tiny_folder, subfolder="unet")
    assert 500_000 <= sum(p.numel() for p in unet.parameters()) <= 1_000_000
    assert CLIPTextModel.from_pretrained(tiny_folder, subfolder="text_encoder").config.hidden_size == 32
    assert len(CLIPTokenizer.from_pretrained(tiny_folder, subfolder="tokenizer")("a red circle").input_ids) > 3
    marker = json.loads((tiny_folder / MARKER).read_text())
    vae = AutoencoderKL.from_pretrained(tiny_folder, subfolder="vae")
    assert vae.config.scaling_factor == marker["vae_scaling_factor"]
    assert type(DiffusionPipeline.from_pretrained(tiny_folder)).__name__ == "StableDiffusionPipeline"


def test_builtin_vae_reconstructs_the_shapes_and_latents_have_unit_scale(tiny_folder):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_folder, subfolder="vae").eval()
    images = shapes_images(32)
    with torch.no_grad():
        means = vae.encode(images).latent_dist.mean
        error = torch.nn.functional.mse_loss(vae.decode(means).sample, images).item()
    assert error < VAE_RECONSTRUCTION_MSE_MAX
    assert 0.8 < (means * vae.config.scaling_factor).std().item() < 1.25


# ------------------------------------------------------------------------------------------------- the loss


def test_loss_is_finite_and_backpropagates(built):
    built.trainable.zero_grad(set_to_none=True)
    loss = _loss(built, [0, 1, 2, 3])
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in built.trainable.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    assert all(p.grad is None for part in built.frozen.values() for p in part.parameters())
    built.trainable.zero_grad(set_to_none=True)


def test_every_draw_is_per_sample_so_any_batch_split_gives_the_same_loss(built):
    torch.manual_seed(11)  # the global RNG must play no part
    whole = _loss(built, [5, 17, 40, 99]).item()
    torch.manual_seed(12)
    halves = (_loss(built, [5, 17]).item() + _loss(built, [40, 99]).item()) / 2
    assert abs(whole - halves) < 1e-6
    assert abs(_loss(built, [99, 40, 17, 5]).item() - whole) < 1e-6
    assert abs(_loss(built, [5, 17, 40, 99], step=4).item() - whole) > 1e-4  # a new step draws new noise
    assert abs(_loss(built, [5, 17, 40, 99], seed=1).item() - whole) > 1e-4


def test_prediction_type_override_and_min_snr(cache_dir, built, eps_built, sd15_style_folder):
    assert built.prediction_type == "v_prediction"  # the built-in model's scheduler (zero terminal SNR)
    with pytest.raises(FamilyError, match="zero terminal SNR.*v_prediction"):
        build_model(SdModelSpec(family="sd", prediction="epsilon"), cache_dir, "cpu", torch.float32)
    eps = eps_built
    assert eps.prediction_type == eps.noise_scheduler.config.prediction_type == "epsilon"
    v_override = build_model(
        SdModelSpec(family="sd", pretrained=str(sd15_style_folder), prediction="v_prediction"),
        cache_dir,
        "cpu",
        torch.float32,
    )
    assert v_override.noise_scheduler.config.prediction_type == "v_prediction"
    assert torch.isfinite(_loss(v_override, [0, 1]))
    assert torch.isfinite(_loss(eps, [0, 1, 2, 3]))
    timesteps, gamma = torch.tensor([0, 10, 500, 998]), torch.tensor(5.0)

    def snr(scheduler):
        alphas = scheduler.alphas_cumprod[timesteps]
        return alphas / (1 - alphas)

    snr_v, snr_eps = snr(built.noise_scheduler), snr(eps.noise_scheduler)
    weights_v = min_snr_weights(built.noise_scheduler, timesteps, 5.0, "v_prediction")
    assert torch.allclose(weights_v, torch.minimum(snr_v, gamma) / (snr_v + 1), rtol=1e-5)
    weights_eps = min_snr_weights(eps.noise_scheduler, timesteps, 5.0, "epsilon")
    assert torch.allclose(weights_eps, torch.minimum(snr_eps, gamma) / snr_eps, rtol=1e-5)
    # the last timestep has SNR exactly 0 here: epsilon's weight is its limit 1, not diffusers' 0/0 = NaN
    assert min_snr_weights(built.noise_scheduler, torch.tensor([999]), 5.0, "epsilon").tolist() == [1.0]
    with_min_snr = with_settings(built, min_snr_gamma=5.0)
    assert torch.isfinite(_loss(with_min_snr, [0, 1, 2, 3]))
    # epsilon with a gamma above every SNR weights every sample 1: exactly the plain loss
    plain = _loss(eps, [0, 1, 2, 3]).item()
    assert abs(_loss(with_settings(eps, min_snr_gamma=1e12), [0, 1, 2, 3]).item() - plain) < 1e-6
    assert abs(_loss(with_settings(eps, min_snr_gamma=1.0), [0, 1, 2, 3]).item() - plain) > 1e-4


def test_noise_offset_changes_the_noise(built):
    plain = _loss(built, [0, 1]).item()
    assert abs(_loss(with_settings(built, noise_offset=0.1), [0, 1]).item() - plain) > 1e-5


def test_gradient_checkpointing_gives_the_same_gradients_without_warnings(cache_dir, built):
    checkpointed = build_model(SdModelSpec(family="sd", gradient_checkpointing=True), cache_dir, "cpu", torch.float32)
    assert checkpointed.trainable.is_gradient_checkpointing and not built.trainable.is_gradient_checkpointing
    gradients = []
    for model in (built, checkpointed):
        model.trainable.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _loss(model, [3, 4, 5]).backward()
        assert not [w for w in caught if "reentrant" in str(w.message).lower()], [str(w.message) for w in caught]
        gradients.append({n: p.grad.clone() for n, p in model.trainable.named_parameters()})
        model.trainable.zero_grad(set_to_none=True)
    for name, grad in gradients[0].items():
        assert torch.allclose(grad, gradients[1][name], atol=1e-6, rtol=1e-5), name


# ------------------------------------------------------------------------------------------ sample and export


def test_sample_renders_one_image_per_prompt_and_restores_the_mode(built):
    spec = SampleSpec(prompts=["a red circle", "a blue square"], steps=4, guidance=3.0, seed=7)
    unet = built.trainable
    assert unet.training
    images = built.sample(unet, spec.prompts, spec, 32)
    assert [im.size for im in images] == [(32, 32), (32, 32)] and unet.training
    unet.eval()
    again = built.sample(unet, spec.prompts, spec, 32)
    unet.train()
    assert [im.tobytes() for im in images] == [im.tobytes() for im in again]  # seeded: comparable across steps


def test_export_writes_a_pipeline_that_diffusers_loads_and_runs(sd15_style_folder, tmp_path):
    from diffusers import DiffusionPipeline

    v_built = build_model(
        SdModelSpec(family="sd", pretrained=str(sd15_style_folder), prediction="v_prediction"),
        tmp_path,
        "cpu",
        torch.float32,
    )
    state = {k: v + 0.01 for k, v in v_built.trainable.state_dict().items()}  # "trained" weights
    out = tmp_path / "export"
    assert v_built.export(state, out) == out
    pipeline = DiffusionPipeline.from_pretrained(out)
    assert type(pipeline).__name__ == "StableDiffusionPipeline"
    assert pipeline.scheduler.config.prediction_type == "v_prediction"  # trained as v: inference must know
    for name, tensor in pipeline.unet.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline("a red circle", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()

    broken = dict(state)
    broken.pop(next(iter(broken)))
    with pytest.raises(FamilyError, match="1 missing"):
        v_built.export(broken, out)
    assert DiffusionPipeline.from_pretrained(out) is not None  # the good export is untouched
    v_built.export(state, out)  # exporting again replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


# -------------------------------------------------------------------------------------------- user folders


def test_a_user_folder_loads_through_the_same_path(tiny_folder, tmp_path):
    user = tmp_path / "my-model"
    shutil.copytree(tiny_folder, user)
    built = build_model(SdModelSpec(family="sd", pretrained=str(user)), tmp_path / "cache", "cpu", torch.float32)
    assert built.folder == user and not (tmp_path / "cache").exists()
    assert type(built) is Sd and built.card is SD_CARD


def test_user_folder_problems_are_named(tiny_folder, tmp_path):
    def broken(name: str, damage) -> str:
        folder = tmp_path / name
        shutil.copytree(tiny_folder, folder)
        damage(folder)
        return str(folder)

    def build(pretrained: str):
        return build_model(SdModelSpec(family="sd", pretrained=pretrained), tmp_path / "cache", "cpu", torch.float32)

    no_unet = broken("no-unet", lambda f: shutil.rmtree(f / "unet"))
    with pytest.raises(FamilyError, match=r"no-unet cannot be used .*\n  - missing subfolder unet/"):
        build(no_unet)
    with pytest.raises(FamilyError, match="no model_index.json"):
        build(broken("no-index", lambda f: (f / "model_index.json").unlink()))

    def make_sdxl(folder: Path):
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionXLPipeline"}))

    with pytest.raises(FamilyError, match=r"StableDiffusionXLPipeline \(Stable Diffusion XL: use model.family: sdxl\)"):
        build(broken("sdxl", make_sdxl))

    def wrong_text_encoder(folder: Path):
        index = json.loads((folder / "model_index.json").read_text())
        index["text_encoder"] = ["transformers", "T5EncoderModel"]
        (folder / "model_index.json").write_text(json.dumps(index))

    with pytest.raises(FamilyError, match="`text_encoder` is a T5EncoderModel; expected CLIPTextModel"):
        build(broken("t5", wrong_text_encoder))
    corrupt = broken("corrupt", lambda f: (f / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"junk"))
    with pytest.raises(FamilyError, match=r"corrupt/vae: cannot load it"):
        build(corrupt)
