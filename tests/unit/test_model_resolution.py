"""data.resolution left out of a spec: the model's native size from its folder's configs (as its diffusers pipeline
computes its default), printed by validate with where it came from; images smaller than data.resolution are
counted and warned about unless data.allow_upscaling accepts them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dstune.report import plan_text
from dstune.validate import load_and_validate
from dstune.world import world_from_flags

STORED = Path(__file__).resolve().parents[2] / "dstune" / "model_configs" / "hub"


def _images(folder: Path, sizes: list[tuple[int, int]]) -> Path:
    from PIL import Image

    folder.mkdir(parents=True)
    for number, size in enumerate(sizes):
        Image.new("RGB", size, (number * 40, 90, 200)).save(folder / f"img{number}.png")
        (folder / f"img{number}.txt").write_text("a blue square")
    return folder


def _model_folder(tmp_path: Path, hub_id: str) -> Path:
    """A local model folder holding only the configs of a real model (those stored with dstune)."""
    folder = tmp_path / hub_id.split("/")[-1]
    shutil.copytree(STORED / hub_id, folder)
    return folder


def _validate(tmp_path: Path, model: str, data: str):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: {model}\ndata: {data}\ntrain: {{micro_batch_size: 1, max_steps: 2}}\n")
    return load_and_validate(str(spec), world=world_from_flags(world_size=1), cross_check=False)


@pytest.mark.parametrize(
    "hub_id, family, size, how",
    [
        ("Qwen/Qwen-Image", "flow", 1024, "QwenImagePipeline's default: 128 latent pixels x the VAE's 8x"),
        ("stable-diffusion-v1-5/stable-diffusion-v1-5", "sd", 512, "the denoiser's sample_size 64 x the VAE's 8x"),
        ("stabilityai/stable-diffusion-xl-base-1.0", "sdxl", 1024, "the denoiser's sample_size 128 x the VAE's 8x"),
    ],
)
def test_an_unset_resolution_is_the_models_native_size(tmp_path, hub_id, family, size, how):
    folder = _model_folder(tmp_path, hub_id)
    images = _images(tmp_path / "images", [(2048, 2048)] * 2)
    resolved = _validate(tmp_path, f"{{family: {family}, pretrained: '{folder}'}}", f"{{path: '{images}'}}")
    assert resolved.spec.data.resolution == size
    assert how in resolved.resolution_origin and "not set in the spec" in resolved.resolution_origin
    assert f"{size} px ({folder}'s native size: {how}" in plan_text(resolved, width=400)
    assert not resolved.warnings


def test_built_in_models_keep_32_px_and_a_set_resolution_is_kept(tmp_path):
    resolved = _validate(tmp_path, "{family: flow, pretrained: 'builtin:tiny-qwen-image'}", "{path: 'builtin:shapes'}")
    assert (
        resolved.spec.data.resolution == 32
        and "builtin:tiny-qwen-image is built for 32 px" in resolved.resolution_origin
    )
    folder = _model_folder(tmp_path, "Qwen/Qwen-Image")
    resolved = _validate(
        tmp_path, f"{{family: flow, pretrained: '{folder}'}}", "{path: 'builtin:shapes', resolution: 64}"
    )
    assert resolved.spec.data.resolution == 64 and resolved.resolution_origin == "set in the spec"


def test_small_images_at_a_large_resolution_are_counted_and_warned_about(tmp_path):
    """3 of 4 images are below 1024 (64 px: 16x); data.allow_upscaling: true accepts them; buckets count the
    bucket each image is cropped to."""
    folder = _model_folder(tmp_path, "Qwen/Qwen-Image")
    images = _images(tmp_path / "images", [(64, 64), (64, 96), (512, 768), (1024, 1536)])
    model = f"{{family: flow, pretrained: '{folder}'}}"
    warned = [str(w) for w in _validate(tmp_path, model, f"{{path: '{images}'}}").warnings]
    assert len(warned) == 1 and "data.resolution" in warned[0]
    assert (
        "3 of 4 images are smaller than data.resolution 1024 and will be upscaled (up to 16.0x, e.g. img0.png (64x64))"
        in warned[0]
        and "data.allow_upscaling: true" in warned[0]
    )
    assert not _validate(tmp_path, model, f"{{path: '{images}', allow_upscaling: true}}").warnings
    assert not _validate(tmp_path, model, f"{{path: '{images}', resolution: 64}}").warnings
    bucketed = [
        str(w) for w in _validate(tmp_path, model, f"{{path: '{images}', buckets: {{enabled: true}}}}").warnings
    ]
    assert any("3 of 4 images are smaller than their buckets" in w for w in bucketed)


@pytest.mark.parametrize(
    "hub_id, family, guidance, pipeline",
    [
        ("Qwen/Qwen-Image", "flow", 4.0, "QwenImagePipeline"),
        ("stable-diffusion-v1-5/stable-diffusion-v1-5", "sd", 7.5, "StableDiffusionPipeline"),
    ],
)
def test_an_unset_sample_guidance_is_the_pipelines_default(tmp_path, hub_id, family, guidance, pipeline):
    """sample.guidance left out: the model's own pipeline's __call__ default, shown by validate; a set one stays."""
    folder = _model_folder(tmp_path, hub_id)
    model = f"{{family: {family}, pretrained: '{folder}'}}"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model: {model}\ndata: {{path: 'builtin:shapes', resolution: 32}}\n"
        "train: {micro_batch_size: 1, max_steps: 2}\nsample: {prompts: [a red circle]}\n"
    )
    resolved = load_and_validate(str(spec), world=world_from_flags(world_size=1), cross_check=False)
    assert resolved.spec.sample.guidance == guidance
    assert f"guidance           {guidance:g} ({pipeline}'s default; not set in the spec)" in plan_text(resolved, 400)
    spec.write_text(spec.read_text().replace("prompts: [a red circle]", "prompts: [a red circle], guidance: 2.5"))
    resolved = load_and_validate(str(spec), world=world_from_flags(world_size=1), cross_check=False)
    assert resolved.spec.sample.guidance == 2.5 and resolved.guidance_origin == "set in the spec"
