"""ERNIE-Image (its card and class, dstune.models.ernie_image) on builtin:tiny-ernie-image's real components.

No diffusers training example for ERNIE-Image exists and Baidu has released no trainer, so the reference is
kohya-ss/musubi-tuner's ernie_image_train_network.py (the first trainer with the model), its loss lines recomputed
here with diffusers' own pieces: ErnieImagePipeline.encode_prompt's per-caption hidden states padded to the batch's
longest caption with their lengths (musubi's call_dit; dstune pads to max_sequence_length instead, which the
transformer's text_lens mask makes invisible), the posterior's mode patchified with _patchify_latents and normalised
with the VAE's batch-norm statistics as the pipeline's decode undoes them, the scheduler copy's tables indexed by u
(musubi's weighting-scheme path: timestep = the table's sigma x 1000, no offset), x_t, the target noise - x0 and
compute_loss_weighting_for_sd3. Both sides take dstune's per-sample draws (u and the noise).
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of
from dstune.families.base import FamilyError
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.ernie_image.card import ERNIE_IMAGE_CARD
from dstune.models.ernie_image.model import ErnieImage
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_attributes, with_settings
from tiny_batches import shape_batch

SEED, STEP, INDICES = 7, 4, [3, 10, 5]
NAME = "builtin:tiny-ernie-image"
CASES = {  # (dstune settings, the trainer's flags)
    "uniform": (dict(timestep_sampling="uniform"), dict(weighting_scheme="none")),
    "logit-normal": (dict(timestep_sampling="logit_normal"), dict(weighting_scheme="logit_normal")),
}


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained=NAME), CACHE_DIR, "cpu")


def test_builtin_is_an_ernie_image_pipeline_folder(built):
    folder = tiny.ensure_builtin_model("tiny-ernie-image", CACHE_DIR)
    assert card_of("flow", folder) is ERNIE_IMAGE_CARD and built.card is ERNIE_IMAGE_CARD
    assert type(built) is ErnieImage
    assert type(built.text_encoders["text_encoder"]).__name__ == "Mistral3Model"
    assert built.max_sequence_length == 512


def _trainer_loss(built, pixels: torch.Tensor, captions: list[str], flags: dict) -> torch.Tensor:
    """musubi-tuner's ERNIE-Image training step (cached latents and text, call_dit) at dstune's draws."""
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(built.folder / "scheduler")
    vae = built.vae
    bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
    bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)  # the pipeline's decode constant
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mode()
        text_hiddens = built.pipeline().encode_prompt(list(captions), device="cpu")
    latents = (ErnieImagePipeline._patchify_latents(latents) - bn_mean) / bn_std
    lengths = [hidden.shape[0] for hidden in text_hiddens]
    text_bth = torch.stack(
        [torch.nn.functional.pad(hidden, (0, 0, 0, max(lengths) - hidden.shape[0])) for hidden in text_hiddens]
    )
    text_lens = torch.tensor(lengths, dtype=torch.long)
    noise = per_sample_randn(latents.shape[1:], SEED, STEP, INDICES, "noise")
    u = timestep_density(built.model_spec, SEED, STEP, INDICES)
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    positions = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[positions].flatten().view(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * latents + sigmas * noise
    with torch.no_grad():
        model_pred = built.trainable(
            hidden_states=noisy_model_input, timestep=timesteps, text_bth=text_bth, text_lens=text_lens
        ).sample
    target = noise - latents
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=flags["weighting_scheme"], sigmas=sigmas)
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(len(captions), -1), 1)
    return loss.mean()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_musubi_tuner_ernie_image_trainer(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    batch = shape_batch(INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, model.encode_batch(batch), SEED, STEP)
    reference = _trainer_loss(model, batch["pixel_values"], batch["caption"], flags)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_cached_text_is_padded_with_its_mask_and_trains_like_encoded_text(built):
    batch = shape_batch([4, 7])
    cached = {**batch, **built.encode_text(batch["caption"])}
    embeds, mask = cached["encoder_hidden_states"], cached["encoder_attention_mask"]
    assert embeds.shape == (2, 512, 32) and mask.shape == (2, 512)
    hiddens = built.pipeline().encode_prompt(batch["caption"], device="cpu")
    for row, hidden in enumerate(hiddens):
        assert mask[row].sum().item() == hidden.shape[0]
        assert torch.equal(embeds[row, : hidden.shape[0]], hidden) and not embeds[row, hidden.shape[0] :].any()
    with torch.no_grad():
        encoded = built.loss(built.trainable, built.encode_batch(batch), 0, 1)
        from_cache = built.loss(built.trainable, built.encode_batch(cached), 0, 1)
    assert from_cache.item() == encoded.item()


def test_a_caption_longer_than_max_sequence_length_is_refused_by_name(built):
    short = with_attributes(built, max_sequence_length=16)
    with pytest.raises(
        FamilyError, match=r"'a caption of more than sixteen bytes' is 37 tokens.*max_sequence_length 16"
    ):
        short.encode_text(["a caption of more than sixteen bytes"])


def test_sample_and_export_reload_with_ernie_image_pipeline(built, tmp_path):
    from diffusers import ErnieImagePipeline

    images = built.sample(built.trainable, ["a red circle"], SampleSpec(prompts=["x"], steps=2, guidance=4.0), 32)
    assert [image.size for image in images] == [(32, 32)] and built.trainable.training
    state = {k: v + 0.01 for k, v in built.trainable.state_dict().items()}
    reloaded = ErnieImagePipeline.from_pretrained(built.export(state, tmp_path / "export"))
    name = next(iter(state))
    assert torch.equal(reloaded.transformer.state_dict()[name], state[name])
    image = reloaded(prompt="a red circle", height=32, width=32, num_inference_steps=2).images[0]
    assert image.size == (32, 32)


def test_lora_export_loads_with_load_lora_weights_and_changes_the_image(tmp_path):
    """train: lora: the LoRA file loads with ErnieImagePipeline.load_lora_weights, reproduces the trained module's
    loss and changes the rendered image."""
    from diffusers import ErnieImagePipeline

    from dstune.families.lora import apply_train_mode, export_lora

    spec = FlowModelSpec(family="flow", pretrained=NAME, train="lora")
    model = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(model, spec, seed=0)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:  # B starts at zero: "train" it
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.2)
    encoded = model.encode_batch(shape_batch([1]))
    state = {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}
    out = export_lora(model, state, tmp_path / "lora", spec)
    pipe = ErnieImagePipeline.from_pretrained(model.folder)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a red circle", height=32, width=32, num_inference_steps=2, output_type="np")
    with torch.no_grad():
        base_image = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
        pipe.load_lora_weights(out)
        trained, loaded = (model.loss(module, encoded, 0, 1) for module in (model.trainable, pipe.transformer))
        lora_image = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    assert loaded.item() == pytest.approx(trained.item(), rel=1e-6)
    assert abs(lora_image - base_image).max() > 1e-3
