"""FLUX.2 [klein] in the flow family (recipe dstune.families.flow_flux2) on builtin:tiny-flux2's real components.

The loss-parity test re-computes the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_flux2_klein.py
with diffusers' own pieces: Flux2KleinPipeline.encode_prompt's embeddings and text ids, the posterior's mode
patchified (_patchify_latents) and normalised with the VAE's batch-norm statistics, _prepare_latent_ids,
_pack_latents, the scheduler copy's tables, timestep / 1000, the output cut to the image tokens and unpacked with
_unpack_latents_with_ids, compute_loss_weighting_for_sd3. The noise and u are dstune's per-sample draws.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dstune import builtin as tiny
from dstune.builtin.common import to_tensor
from dstune.data.synthetic import render_shape
from dstune.families import flow
from dstune.families.base import per_sample_randn
from dstune.pretrained import build_model
from dstune.spec.models import FlowModel, SampleSpec

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
SEED, STEP, INDICES = 9, 6, [2, 12, 4]
CASES = {  # (dstune settings, the example's flags): its defaults (uniform u: --weighting_scheme none), then others
    "script-defaults": (dict(timestep_sampling="uniform"), dict(weighting_scheme="none")),
    "logit-normal": (dict(timestep_sampling="logit_normal"), dict(weighting_scheme="logit_normal")),
}


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModel(family="flow", pretrained="builtin:tiny-flux2"), CACHE_DIR, "cpu")


def _batch(indices=INDICES) -> dict:
    images = [render_shape(i, 32) for i in indices]
    return {"pixel_values": to_tensor([image for image, _ in images]),
            "caption": [caption for _, caption in images], "index": torch.tensor(indices, dtype=torch.long)}


def test_builtin_is_a_flux2_klein_pipeline_folder(built):
    folder = tiny.ensure_builtin_model("tiny-flux2", CACHE_DIR)
    assert flow.detect_kind(folder) == "flux2_klein" and built.kind == "flux2_klein"
    assert type(built.text_encoders["text_encoder"]).__name__ == "Qwen3ForCausalLM"


def _script_loss(built, pixels: torch.Tensor, captions: list[str], flags: dict, u: torch.Tensor) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(built.folder / "scheduler")
    vae = built.vae
    bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
    bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    with torch.no_grad():
        model_input = vae.encode(pixels).latent_dist.mode()
        prompt_embeds, text_ids = flow._pipeline(built).encode_prompt(prompt=list(captions), max_sequence_length=512)
    model_input = (Flux2KleinPipeline._patchify_latents(model_input) - bn_mean) / bn_std
    model_input_ids = Flux2KleinPipeline._prepare_latent_ids(model_input)
    noise = per_sample_randn(model_input.shape[1:], SEED, STEP, INDICES, "noise")
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    positions = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[positions].flatten().view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    packed = Flux2KleinPipeline._pack_latents(noisy)
    with torch.no_grad():
        model_pred = built.trainable(hidden_states=packed, timestep=timesteps / 1000, guidance=None,
                                     encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=model_input_ids,
                                     return_dict=False)[0]
    model_pred = Flux2KleinPipeline._unpack_latents_with_ids(model_pred[:, :packed.size(1):], model_input_ids)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=flags["weighting_scheme"], sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(len(captions), -1), 1)
    return loss.mean()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_flux2_klein_script(built, case):
    settings, flags = CASES[case]
    model = replace(built, settings=FlowModel(family="flow", pretrained="builtin:tiny-flux2", **settings))
    batch = _batch()
    u = flow.timestep_density(model.settings, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = flow.loss(model, model.trainable, flow.encode_batch(model, batch), SEED, STEP)
    reference = _script_loss(model, batch["pixel_values"], batch["caption"], flags, u)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_cached_text_trains_like_encoded_text(built):
    batch = _batch([4, 7])
    cached = {**batch, **flow.cache_text_tensors(built, batch["caption"])}
    assert cached["encoder_hidden_states"].shape == (2, 512, 96)
    with torch.no_grad():
        encoded = flow.loss(built, built.trainable, flow.encode_batch(built, batch), 0, 1)
        from_cache = flow.loss(built, built.trainable, flow.encode_batch(built, cached), 0, 1)
    assert from_cache.item() == encoded.item()


def test_sample_and_export_reload_with_flux2_klein_pipeline(built, tmp_path):
    from diffusers import Flux2KleinPipeline

    images = flow.sample(built, built.trainable, ["a red circle"], SampleSpec(prompts=["x"], steps=2, guidance=1.0), 32)
    assert [image.size for image in images] == [(32, 32)]
    state = {k: v + 0.01 for k, v in built.trainable.state_dict().items()}
    reloaded = Flux2KleinPipeline.from_pretrained(flow.export(built, state, tmp_path / "export"))
    name = next(iter(state))
    assert torch.equal(reloaded.transformer.state_dict()[name], state[name])
    assert reloaded(prompt="a red circle", height=32, width=32, num_inference_steps=2).images[0].size == (32, 32)
