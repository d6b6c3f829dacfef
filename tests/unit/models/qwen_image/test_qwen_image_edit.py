"""Qwen-Image-Edit (its card QWEN_IMAGE_EDIT_CARD and class QwenImageEdit, dstune.models.qwen_image) on
builtin:tiny-qwen-image-edit's real components.

diffusers has no Qwen-Image-Edit training example, so the reference is the pipeline's own conditioning plus the loss
lines of examples/dreambooth/train_dreambooth_lora_qwen_image.py: QwenImageEditPipeline.encode_prompt with the
source images (the processor puts them into the prompt as vision tokens), the source latents from the pipeline's
_encode_vae_image (posterior mode, normalised), both packed with _pack_latents and concatenated along the tokens with
img_shapes listing both, the output cut back to the target tokens (as the pipeline's denoising loop does) and
unpacked with _unpack_latents, then the Qwen-Image script's noise, sigma tables, target and weighting. The draws
(posterior, noise, u) are dstune's per-sample ones, taken by both sides.
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.data.synthetic import render_shape
from dstune.families import card_of
from dstune.families.base import FamilyError
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.qwen_image.card import QWEN_IMAGE_EDIT_CARD
from dstune.models.qwen_image.model import QwenImageEdit, control_images, load_processor
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from edit_script import check_source_conditions_the_loss, pairs_batch, script_loss, script_timesteps
from loaded_models import CACHE_DIR, with_settings

MODEL = "builtin:tiny-qwen-image-edit"
SEED, STEP, INDICES = 3, 4, [5, 0, 9]
SIDE = 64  # 8 px per latent: 8x8 latents, 16 target tokens
CASES = {
    "script-defaults": (dict(timestep_sampling="uniform"), dict(weighting_scheme="none")),
    "logit-normal": (dict(timestep_sampling="logit_normal"), dict(weighting_scheme="logit_normal")),
    "cosmap": (dict(timestep_sampling="uniform", loss_weighting="cosmap"), dict(weighting_scheme="cosmap")),
}


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained=MODEL), CACHE_DIR, "cpu")


def _edit_pipeline(built):
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline(
        scheduler=built.scheduler,
        vae=built.vae,
        transformer=built.trainable,
        **built.text_encoders,
        **built.tokenizers,
        **built.parts,
    )


def test_builtin_is_a_qwen_image_edit_pipeline_folder(built):
    from diffusers import QwenImageEditPipeline

    folder = tiny.ensure_builtin_model("tiny-qwen-image-edit", CACHE_DIR)
    assert card_of("flow", folder) is QWEN_IMAGE_EDIT_CARD and built.card is QWEN_IMAGE_EDIT_CARD
    assert type(built) is QwenImageEdit
    pipeline = QwenImageEditPipeline.from_pretrained(folder, processor=load_processor(folder))
    assert pipeline.vae_scale_factor == 8 and pipeline.processor.image_processor.merge_size == 2
    # the image-only processor is only a stand-in for the folder's Qwen2VLProcessor where torchvision is missing
    assert (folder / "processor" / "processor_config.json").read_text().count('"Qwen2VLProcessor"') == 1
    assert "(caption, image) pair" in card_of("flow", folder).text_cache_refusal(folder)
    plain = tiny.ensure_builtin_model("tiny-qwen-image", CACHE_DIR)
    assert card_of("flow", plain).text_cache_refusal(plain) is None


def _reference_loss(built, batch: dict, flags: dict, u: torch.Tensor) -> torch.Tensor:
    from diffusers import QwenImageEditPipeline

    pipeline = _edit_pipeline(built)
    vae = built.vae
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    with torch.no_grad():
        posterior = vae.encode(batch["pixel_values"].unsqueeze(2)).latent_dist
    draw = lambda purpose: per_sample_randn(posterior.mean.shape[1:], SEED, STEP, INDICES, purpose)  # noqa: E731
    model_input = (posterior.mean + posterior.std * draw("vae_posterior") - latents_mean) * latents_std
    noise = draw("noise")
    timesteps, sigmas = script_timesteps(built.folder, u, model_input.ndim)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    batch_size, channels, _, height, width = model_input.shape
    packed = QwenImageEditPipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), batch_size, channels, height, width)
    sources = control_images(batch["control_values"])
    with torch.no_grad():
        embeds, mask = pipeline.encode_prompt(batch["caption"], image=sources, device="cpu")
        # the pipeline's source path: its image processor's tensor of the PIL source, then _encode_vae_image
        source_pixels = pipeline.image_processor.preprocess(sources, SIDE, SIDE).unsqueeze(2)
        source_latents = pipeline._encode_vae_image(source_pixels, generator=None)
        packed_sources = QwenImageEditPipeline._pack_latents(source_latents, batch_size, channels, height, width)
        img_shapes = [[(1, height // 2, width // 2), (1, height // 2, width // 2)]] * batch_size
        model_pred = built.trainable(
            hidden_states=torch.cat([packed, packed_sources], dim=1),
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=timesteps / 1000,
            img_shapes=img_shapes,
            return_dict=False,
        )[0]
    model_pred = model_pred[:, : packed.size(1)]
    model_pred = QwenImageEditPipeline._unpack_latents(model_pred, SIDE, SIDE, pipeline.vae_scale_factor)
    return script_loss(model_pred, noise, model_input, sigmas, flags["weighting_scheme"])


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_edit_pipelines_conditioning_with_the_qwen_image_script_loss(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    batch = pairs_batch(INDICES, SIDE)
    encoded = model.encode_batch(batch)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, encoded, SEED, STEP)
    reference = _reference_loss(model, batch, flags, u)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_the_source_image_conditions_the_loss_and_cached_source_latents_train_alike(built):
    check_source_conditions_the_loss(built, lambda indices: pairs_batch(indices, SIDE))


def test_a_batch_without_sources_is_refused_with_the_fix(built):
    batch = pairs_batch([1], SIDE)
    del batch["control_values"]
    with pytest.raises(ValueError, match="data.control_dir"):
        built.encode_batch(batch)
    with pytest.raises(FamilyError, match="sample.control_images"):
        built.sample(built.trainable, ["x"], SampleSpec(prompts=["x"], steps=1), SIDE)


def test_samples_edit_their_source_images(built, tmp_path):
    sources = []
    for number in (3, 4):
        sources.append(str(tmp_path / f"{number}.png"))
        render_shape(number, SIDE)[0].save(sources[-1])
    spec = SampleSpec(prompts=["make it red", "make it red"], control_images=sources, steps=2, guidance=1.0, seed=1)
    images = built.sample(built.trainable, spec.prompts, spec, SIDE)
    assert [image.size for image in images] == [(SIDE, SIDE)] * 2
    assert images[0].tobytes() != images[1].tobytes()  # same prompt, other source (and noise)


def test_validate_plans_an_edit_sample_as_two_images_and_the_source_in_the_text(tmp_path, capsys):
    """At real size (configs stored with dstune), an edit sample holds the target's and the source's latent tokens,
    the source's vision tokens in the text, and caches two latents: more activations and twice the latent cache of
    Qwen-Image on the same data."""
    import re

    import yaml

    from dstune.cli import main

    found = {}
    for model in ("Qwen/Qwen-Image", "Qwen/Qwen-Image-Edit"):
        spec = {
            "model": {"family": "flow", "pretrained": model, "train": "lora", "gradient_checkpointing": True},
            "data": {"path": "/data/not-here", "resolution": 1024, "cache": {"latents": True}},
            "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "epochs": 1, "precision": "bf16"},
            "deepspeed": {"zero_stage": 3},
        }
        path = tmp_path / f"{model.replace('/', '-')}.yaml"
        path.write_text(yaml.safe_dump(spec))
        assert main(["validate", str(path), "--num-gpus", "8", "--num-samples", "1000"]) == 0
        out = capsys.readouterr().out
        numbers = {
            key: float(re.search(rf"{key}\s+([\d.]+) GB", out).group(1)) for key in ("activations", "cache on disk")
        }
        found[model] = numbers
    plain, edit = found["Qwen/Qwen-Image"], found["Qwen/Qwen-Image-Edit"]
    assert edit["cache on disk"] == pytest.approx(2 * plain["cache on disk"], rel=0.02)
    assert edit["activations"] > 1.5 * plain["activations"]


def test_a_qwen_transformer_in_another_pipeline_is_refused_not_trained_as_text_to_image(tmp_path):
    import json
    import shutil

    folder = tiny.ensure_builtin_model("tiny-qwen-image-edit", CACHE_DIR)
    copy = tmp_path / "layered"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImageLayeredPipeline"}))
    with pytest.raises(
        FamilyError,
        match="QwenImageLayeredPipeline around a QwenImageTransformer2DModel is not "
        "supported.*QwenImagePipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline",
    ):
        card_of("flow", copy)
