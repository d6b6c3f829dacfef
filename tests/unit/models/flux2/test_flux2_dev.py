"""FLUX.2 [dev] (its card FLUX2_DEV_CARD and class, dstune.models.flux2) on builtin:tiny-flux2-dev's real
components: a Flux2Pipeline folder whose Mistral3 text encoder is tiny and whose tokenizer is a byte-level fast
tokenizer with Mistral's chat template, standing where a real folder's PixtralProcessor (which needs torchvision)
goes.

The loss-parity test re-computes the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_flux2.py with
diffusers' own pieces: Flux2Pipeline.encode_prompt's embeddings and text ids at the script's defaults
(max_sequence_length 512, text_encoder_out_layers 10, 20, 30), the posterior's mode patchified and normalised with
the VAE's batch-norm statistics, _prepare_latent_ids, _pack_latents, the scheduler copy's tables, timestep / 1000,
the guidance embedding fed the script's --guidance_scale, the output cut to the image tokens and unpacked with
_unpack_latents_with_ids, compute_loss_weighting_for_sd3. The noise and u are dstune's per-sample draws.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of
from dstune.families.base import FamilyError
from dstune.families.flow_matching import timestep_density
from dstune.models.flux2.card import FLUX2_DEV_CARD, FLUX2_KLEIN_CARD
from dstune.models.flux2.model import Flux2
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec
from flux2_script import (
    CASES,
    DENOISER_INPUTS,
    check_cached_text_trains_like_encoded_text,
    check_sample_and_export_reload,
    flux2_script_loss,
    reference_batch,
    reference_times,
)
from edit_script import Recorder, check_same_denoiser_inputs
from loaded_models import CACHE_DIR, with_settings
from tiny_batches import shape_batch

MODEL = "builtin:tiny-flux2-dev"
SEED, STEP, INDICES = 9, 6, [2, 12, 4]


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained=MODEL), CACHE_DIR, "cpu")


def test_builtin_is_a_flux2_dev_pipeline_folder(built):
    folder = tiny.ensure_builtin_model("tiny-flux2-dev", CACHE_DIR)
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "Flux2Pipeline"
    assert card_of("flow", folder) is FLUX2_DEV_CARD and built.card is FLUX2_DEV_CARD
    assert type(built) is Flux2
    assert type(built.text_encoders["text_encoder"]).__name__ == "Mistral3ForConditionalGeneration"
    assert built.transformer_config["guidance_embeds"] and built.max_sequence_length == 512
    # the chat template puts FLUX.2's system message and the caption in Mistral's control tokens
    text = built.tokenizers["tokenizer"].apply_chat_template(
        [
            [
                {"role": "system", "content": [{"type": "text", "text": "S"}]},
                {"role": "user", "content": [{"type": "text", "text": "a red circle"}]},
            ]
        ],
        tokenize=False,
    )
    assert text == ["<s>[SYSTEM_PROMPT]S[/SYSTEM_PROMPT][INST]a red circle[/INST]"]


def test_klein_and_dev_folders_are_told_apart_and_misfits_refused(tmp_path):
    """Both share Flux2Transformer2DModel: the pipeline class picks the card, then every part is checked."""
    klein = tiny.ensure_builtin_model("tiny-flux2", CACHE_DIR)
    assert card_of("flow", klein) is FLUX2_KLEIN_CARD
    dev = tmp_path / "dev"
    shutil.copytree(tiny.ensure_builtin_model("tiny-flux2-dev", CACHE_DIR), dev)
    index = json.loads((dev / "model_index.json").read_text())
    (dev / "model_index.json").write_text(json.dumps({**index, "_class_name": "SomethingElse"}))
    assert card_of("flow", dev) is FLUX2_DEV_CARD  # no pipeline class match: the text encoder class decides
    shutil.rmtree(dev / "vae")
    (dev / "model_index.json").write_text(json.dumps({**index, "text_encoder": ["transformers", "Qwen3ForCausalLM"]}))
    with pytest.raises(
        FamilyError,
        match=r"FLUX.2 \[dev\] pipeline \(Flux2Pipeline, model.family flow\):\n  - `text_encoder` is a Qwen3ForCausalLM; expected "
        r"Mistral3ForConditionalGeneration\n  - missing subfolder vae/",
    ):
        build_model(FlowModelSpec(family="flow", pretrained=str(dev)), tmp_path, "cpu")


def test_mismatched_text_width_is_refused(tmp_path):
    dev = tmp_path / "dev"
    shutil.copytree(tiny.ensure_builtin_model("tiny-flux2-dev", CACHE_DIR), dev)
    path = dev / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "joint_attention_dim": 64}))
    with pytest.raises(FamilyError, match=r"joint_attention_dim 64 != 96"):
        build_model(FlowModelSpec(family="flow", pretrained=str(dev)), tmp_path, "cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_flux2_dev_script(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, guidance=4.0, **settings)
    from diffusers import Flux2Pipeline

    batch = shape_batch(INDICES)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, model.encode_batch(batch), SEED, STEP)
    # the script encodes through a Flux2Pipeline of the text parts, at its default text_encoder_out_layers
    prompts = Flux2Pipeline(
        scheduler=model.scheduler, vae=None, transformer=None, **model.text_encoders, **model.tokenizers
    )
    reference = flux2_script_loss(
        model,
        Flux2Pipeline,
        prompts,
        {"text_encoder_out_layers": [10, 20, 30]},
        batch["pixel_values"],
        batch["caption"],
        {**flags, "guidance_scale": 4.0},
        u,
        (SEED, STEP, INDICES),
    )
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    # the guidance embedding is live: another guidance value gives another loss
    other = with_settings(built, guidance=1.0, **settings)
    with torch.no_grad():
        assert other.loss(other.trainable, other.encode_batch(batch), SEED, STEP).item() != ours.item()


def _dev_img2img(built, indices: list[int]) -> tuple[float, float, Recorder, Recorder]:
    """(dstune's loss, the dev img2img script's, what each fed the transformer) on reference pairs of `indices`."""
    settings, flags = CASES["script-defaults"]
    model = with_settings(built, guidance=4.0, **settings)
    from diffusers import Flux2Pipeline

    batch = reference_batch(indices)
    u = timestep_density(model.model_spec, SEED, STEP, indices)
    ours, script = Recorder(model.trainable), Recorder(model.trainable)
    with torch.no_grad():
        loss = model.loss(ours, model.encode_batch(batch), SEED, STEP)
    prompts = Flux2Pipeline(
        scheduler=model.scheduler, vae=None, transformer=None, **model.text_encoders, **model.tokenizers
    )
    reference = flux2_script_loss(
        model,
        Flux2Pipeline,
        prompts,
        {"text_encoder_out_layers": [10, 20, 30]},
        batch["pixel_values"],
        batch["caption"],
        {**flags, "guidance_scale": 4.0},
        u,
        (SEED, STEP, indices),
        batch["control_values"],
        denoiser=script,
        reference_per_sample_time=True,
    )
    return loss.item(), reference.item(), ours, script


def test_image_to_image_loss_and_denoiser_inputs_equal_the_diffusers_flux2_img2img_script(built):
    """A reference per target (data.control_dir): train_dreambooth_lora_flux2_img2img.py's lines at its defaults, for
    one sample per micro batch: the same loss, and the transformer the same inputs (the reference tokens after the
    target's with ids of time 10 and its own grid, the timesteps, the guidance embedding's value, the text ids)."""
    loss, reference, ours, script = _dev_img2img(built, INDICES[:1])
    assert loss == pytest.approx(reference, rel=1e-5)
    check_same_denoiser_inputs(ours.inputs, script.inputs, **DENOISER_INPUTS)
    assert reference_times(ours.inputs["img_ids"]) == [{10}]
    assert ours.inputs["guidance"].tolist() == [4.0]


def test_image_to_image_batches_give_every_reference_the_pipelines_time_not_the_dev_scripts(built):
    """A documented difference (docs/family-flow.md): for a micro batch of B the dev script passes the batch's
    references to _prepare_image_ids as if they were B references of one image, so sample b's reference gets the
    time coordinate 10 * (b + 1); Flux2Pipeline gives a single reference time 10 at inference, and so does dstune
    for every sample (as the klein script does). Every other input is the script's."""
    _, _, ours, script = _dev_img2img(built, INDICES)
    mine, theirs = ours.inputs["img_ids"], script.inputs["img_ids"]
    assert reference_times(theirs) == [{10}, {20}, {30}] and reference_times(mine) == [{10}] * 3
    target = mine.shape[1] // 2  # the target's ids, and the reference's grid, are the script's
    assert torch.equal(mine[:, :, 1:], theirs[:, :, 1:]) and torch.equal(mine[:, :target], theirs[:, :target])
    same = dict(exact=("txt_ids", "timestep", "guidance", "return_dict"), close=DENOISER_INPUTS["close"])
    check_same_denoiser_inputs(
        {k: v for k, v in ours.inputs.items() if k != "img_ids"},
        {k: v for k, v in script.inputs.items() if k != "img_ids"},
        **same,
    )


def test_cached_text_trains_like_encoded_text(built):
    check_cached_text_trains_like_encoded_text(built)


def test_sample_and_export_reload_with_flux2_pipeline(built, tmp_path):
    from diffusers import Flux2Pipeline

    check_sample_and_export_reload(built, Flux2Pipeline, 4.0, tmp_path)
