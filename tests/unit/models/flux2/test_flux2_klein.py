"""FLUX.2 [klein] (its card and class, dstune.models.flux2) on builtin:tiny-flux2's real components.

The loss-parity test re-computes the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_flux2_klein.py
with diffusers' own pieces: Flux2KleinPipeline.encode_prompt's embeddings and text ids, the posterior's mode
patchified (_patchify_latents) and normalised with the VAE's batch-norm statistics, _prepare_latent_ids,
_pack_latents, the scheduler copy's tables, timestep / 1000, the output cut to the image tokens and unpacked with
_unpack_latents_with_ids, compute_loss_weighting_for_sd3. The noise and u are dstune's per-sample draws.
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of
from dstune.families.flow_matching import timestep_density
from dstune.models.flux2.card import FLUX2_KLEIN_CARD
from dstune.models.flux2.model import Flux2
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec
from flux2_script import (
    CASES,
    DENOISER_INPUTS,
    check_cached_text_trains_like_encoded_text,
    check_reference_conditions_the_loss,
    check_sample_and_export_reload,
    flux2_script_loss,
    reference_batch,
    reference_times,
)
from edit_script import Recorder, check_same_denoiser_inputs
from loaded_models import CACHE_DIR, with_settings
from tiny_batches import shape_batch

SEED, STEP, INDICES = 9, 6, [2, 12, 4]


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained="builtin:tiny-flux2"), CACHE_DIR, "cpu")


def test_builtin_is_a_flux2_klein_pipeline_folder(built):
    folder = tiny.ensure_builtin_model("tiny-flux2", CACHE_DIR)
    assert card_of("flow", folder) is FLUX2_KLEIN_CARD and built.card is FLUX2_KLEIN_CARD
    assert type(built) is Flux2
    assert type(built.text_encoders["text_encoder"]).__name__ == "Qwen3ForCausalLM"


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_flux2_klein_script(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    from diffusers import Flux2KleinPipeline

    batch = shape_batch(INDICES)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, model.encode_batch(batch), SEED, STEP)
    reference = flux2_script_loss(
        model,
        Flux2KleinPipeline,
        model.pipeline(),
        {},
        batch["pixel_values"],
        batch["caption"],
        flags,
        u,
        (SEED, STEP, INDICES),
    )
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_image_to_image_loss_and_denoiser_inputs_equal_the_diffusers_klein_img2img_script(built, case):
    """A reference per target (data.control_dir): train_dreambooth_lora_flux2_klein_img2img.py's lines give the same
    loss, and the transformer the same inputs: the reference tokens after the target's with the same ids (time 10,
    its own grid), the same timesteps and text ids, no guidance."""
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    from diffusers import Flux2KleinPipeline

    batch = reference_batch(INDICES)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    ours, script = Recorder(model.trainable), Recorder(model.trainable)
    with torch.no_grad():
        loss = model.loss(ours, model.encode_batch(batch), SEED, STEP)
    reference = flux2_script_loss(
        model,
        Flux2KleinPipeline,
        model.pipeline(),
        {},
        batch["pixel_values"],
        batch["caption"],
        flags,
        u,
        (SEED, STEP, INDICES),
        batch["control_values"],
        denoiser=script,
    )
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    check_same_denoiser_inputs(ours.inputs, script.inputs, **DENOISER_INPUTS)
    assert ours.inputs["guidance"] is None and reference_times(ours.inputs["img_ids"]) == [{10}] * len(INDICES)


def test_the_reference_conditions_the_loss_and_cached_reference_latents_train_alike(built):
    check_reference_conditions_the_loss(built)


def test_cached_text_trains_like_encoded_text(built):
    check_cached_text_trains_like_encoded_text(built)


def test_sample_and_export_reload_with_flux2_klein_pipeline(built, tmp_path):
    from diffusers import Flux2KleinPipeline

    check_sample_and_export_reload(built, Flux2KleinPipeline, 1.0, tmp_path)


def test_image_to_image_samples_render_from_their_references(built, tmp_path):
    from dstune.data.synthetic import render_shape
    from dstune.spec.models import SampleSpec

    references = []
    for number in (3, 4):
        references.append(str(tmp_path / f"{number}.png"))
        render_shape(number, 64)[0].save(references[-1])  # Flux2Pipeline takes references of 64 px and up
    spec = SampleSpec(prompts=["make it red"] * 2, control_images=references, steps=2, guidance=1.0, seed=1)
    images = built.sample(built.trainable, spec.prompts, spec, 32)
    assert [image.size for image in images] == [(32, 32)] * 2
    again = SampleSpec(prompts=["make it red"] * 2, control_images=references[::-1], steps=2, guidance=1.0, seed=1)
    swapped = built.sample(built.trainable, again.prompts, again, 32)
    assert images[0].tobytes() != swapped[0].tobytes()  # the same prompt and noise, another reference
