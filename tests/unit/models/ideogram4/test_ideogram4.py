"""Ideogram 4 (its card and class, dstune.models.ideogram4) on builtin:tiny-ideogram4's real components.

The loss-parity test re-computes the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_ideogram4.py
with diffusers' own pieces: Ideogram4Pipeline.encode_prompt for the batch's image grid (the packed text features,
position, segment and indicator ids), the posterior's mode patchified as the example's patchify_latents does and
normalised with the VAE's batch-norm statistics, sigma from compute_density_for_timestep_sampling at the example's
defaults (the pipeline module's _resolution_aware_mu, logit_std 1.5) used directly, x_t, [zeros | image tokens], the
model time 1 - sigma, the output cut to the image tokens, the target x0 - noise, compute_loss_weighting_for_sd3.
Both sides take dstune's per-sample draws: the noise, and the generator each sample's sigma is drawn with.
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of
from dstune.families.base import FamilyError
from dstune.families.randomness import per_sample_randn, sample_generator
from dstune.models.ideogram4.card import IDEOGRAM4_CARD
from dstune.models.ideogram4.model import Ideogram4
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_attributes, with_settings
from tiny_batches import shape_batch

SEED, STEP, INDICES = 5, 3, [4, 11, 2]
NAME = "builtin:tiny-ideogram4"
# (dstune settings, the example's flags): its defaults (logit-normal, mean 0 before the resolution shift, std 1.5),
# then others
CASES = {
    "script-defaults": (dict(), dict(weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.5)),
    "logit-mean-std": (
        dict(logit_mean=0.5, logit_std=1.0),
        dict(weighting_scheme="logit_normal", logit_mean=0.5, logit_std=1.0),
    ),
    "uniform": (dict(timestep_sampling="uniform"), dict(weighting_scheme="none", logit_mean=0.0, logit_std=1.5)),
    "cosmap": (
        dict(timestep_sampling="uniform", loss_weighting="cosmap"),
        dict(weighting_scheme="cosmap", logit_mean=0.0, logit_std=1.5),
    ),
}


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained=NAME), CACHE_DIR, "cpu")


def test_builtin_is_an_ideogram4_pipeline_folder(built):
    folder = tiny.ensure_builtin_model("tiny-ideogram4", CACHE_DIR)
    assert card_of("flow", folder) is IDEOGRAM4_CARD and built.card is IDEOGRAM4_CARD
    assert type(built) is Ideogram4
    assert type(built.text_encoders["text_encoder"]).__name__ == "Qwen3VLModel"
    assert built.max_sequence_length == 128  # the example's 2048, capped by the tiny tokenizer's model_max_length


def _script_loss(built, pixels: torch.Tensor, captions: list[str], flags: dict) -> torch.Tensor:
    """The example's loss lines (train_dreambooth_lora_ideogram4.py's training step) at dstune's draws."""
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _resolution_aware_mu
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    vae, length, patch = built.vae, built.max_sequence_length, 2
    vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    bn_mean = vae.bn.running_mean.view(1, 1, -1)
    bn_std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, 1, -1)
    with torch.no_grad():
        model_input = vae.encode(pixels).latent_dist.mode()
    grid_h, grid_w = model_input.shape[2] // patch, model_input.shape[3] // patch
    with torch.no_grad():
        prompt_embeds, position_ids, segment_ids, indicator = built.pipeline().encode_prompt(
            prompt=list(captions), grid_h=grid_h, grid_w=grid_w, max_sequence_length=length, device="cpu"
        )
    image_height, image_width = model_input.shape[-2] * vae_scale_factor, model_input.shape[-1] * vae_scale_factor
    batch, channels = model_input.shape[:2]
    model_input = model_input.view(batch, channels, grid_h, patch, grid_w, patch).permute(0, 2, 4, 3, 5, 1)
    model_input = model_input.reshape(batch, grid_h * grid_w, patch * patch * channels)
    model_input = (model_input - bn_mean) / bn_std
    # dstune's noise draw, (4C, h, w) per sample, read in the example's token layout
    noise = per_sample_randn((4 * channels, grid_h, grid_w), SEED, STEP, INDICES, "noise")
    noise = noise.permute(0, 2, 3, 1).reshape(model_input.shape)
    sigmas = torch.cat(
        [
            compute_density_for_timestep_sampling(
                weighting_scheme=flags["weighting_scheme"],
                batch_size=1,
                logit_mean=_resolution_aware_mu(image_height, image_width, base_mu=flags["logit_mean"]),
                logit_std=flags["logit_std"],
                mode_scale=1.29,
                generator=sample_generator(SEED, STEP, i, "timestep"),
            )
            for i in INDICES
        ]
    ).view(batch, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    packed = torch.cat([torch.zeros(batch, length, model_input.shape[-1]), noisy_model_input], dim=1)
    with torch.no_grad():
        model_pred = built.trainable(
            hidden_states=packed,
            timestep=(1.0 - sigmas).reshape(batch),
            encoder_hidden_states=prompt_embeds,
            position_ids=position_ids,
            segment_ids=segment_ids,
            indicator=indicator,
            return_dict=False,
        )[0]
    model_pred = model_pred[:, length:]
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=flags["weighting_scheme"], sigmas=sigmas)
    target = model_input - noise
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(batch, -1), 1)
    return loss.mean()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_ideogram4_script(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    batch = shape_batch(INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, model.encode_batch(batch), SEED, STEP)
    reference = _script_loss(model, batch["pixel_values"], batch["caption"], flags)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_cached_text_trains_like_encoded_text(built):
    batch = shape_batch([4, 7])
    cached = {**batch, **built.encode_text(batch["caption"])}
    assert cached["encoder_hidden_states"].shape == (2, 128, 13 * 16)
    with torch.no_grad():
        encoded = built.loss(built.trainable, built.encode_batch(batch), 0, 1)
        from_cache = built.loss(built.trainable, built.encode_batch(cached), 0, 1)
    assert from_cache.item() == encoded.item()


def test_sample_and_export_reload_with_ideogram4_pipeline(built, tmp_path):
    """Samples render at 32 px (the unconditional transformer loaded for them); the export loads in
    Ideogram4Pipeline with the trained weights and the source's unconditional transformer, and renders."""
    from diffusers import Ideogram4Pipeline

    images = built.sample(built.trainable, ["a red circle"], SampleSpec(prompts=["x"], steps=2, guidance=3.0), 32)
    assert [image.size for image in images] == [(32, 32)] and built.trainable.training
    state = {k: v + 0.01 for k, v in built.trainable.state_dict().items()}
    reloaded = Ideogram4Pipeline.from_pretrained(built.export(state, tmp_path / "export"))
    name = next(iter(state))
    assert torch.equal(reloaded.transformer.state_dict()[name], state[name])
    source = Ideogram4Pipeline.from_pretrained(built.folder)
    assert torch.equal(
        reloaded.unconditional_transformer.state_dict()[name], source.unconditional_transformer.state_dict()[name]
    )
    image = reloaded(
        prompt="a red circle",
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=3.0,
        guidance_schedule=None,
        max_sequence_length=128,
    ).images[0]
    assert image.size == (32, 32)


def test_lora_export_loads_with_load_lora_weights_and_changes_the_image(tmp_path):
    """train: lora: the LoRA file loads with Ideogram4Pipeline.load_lora_weights, reproduces the trained module's
    loss and changes the rendered image."""
    from diffusers import Ideogram4Pipeline

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
    pipe = Ideogram4Pipeline.from_pretrained(model.folder)
    pipe.set_progress_bar_config(disable=True)
    call = dict(
        prompt="a red circle",
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=3.0,
        guidance_schedule=None,
        max_sequence_length=128,
        output_type="np",
    )
    with torch.no_grad():
        base_image = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
        pipe.load_lora_weights(out)
        trained, loaded = (model.loss(module, encoded, 0, 1) for module in (model.trainable, pipe.transformer))
        lora_image = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    assert loaded.item() == pytest.approx(trained.item(), rel=1e-6)
    assert abs(lora_image - base_image).max() > 1e-3


def test_folder_whose_parts_do_not_fit_is_refused(tmp_path):
    """An unconditional transformer of another width than the conditional one is refused with the keys named."""
    import json
    import shutil

    folder = tmp_path / "ideogram4"
    shutil.copytree(tiny.ensure_builtin_model("tiny-ideogram4", CACHE_DIR), folder)
    config_path = folder / "unconditional_transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["llm_features_dim"] = 99
    config_path.write_text(json.dumps(config))
    with pytest.raises(FamilyError, match="unconditional_transformer llm_features_dim 99 != the transformer's 208"):
        build_model(FlowModelSpec(family="flow", pretrained=str(folder)), CACHE_DIR, "cpu")


def test_caption_longer_than_max_sequence_length_is_refused_naming_it(built):
    short = with_attributes(built, max_sequence_length=24)
    with pytest.raises(FamilyError, match=r"the caption 'a red circle' is \d+ tokens .* model.max_sequence_length 24"):
        short.encode_text(["a red circle"])


def test_model_shift_is_refused_by_validate_and_at_build(tmp_path):
    """Ideogram 4 draws sigma off the scheduler tables, so model.shift would be silently ignored: refused instead."""
    from dstune.families import get_facts
    from dstune.spec.load import load_spec

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(
        f"model: {{family: flow, pretrained: '{NAME}', shift: 3.0}}\n"
        "data: {path: 'builtin:shapes', resolution: 32}\n"
        "train: {micro_batch_size: 1, max_steps: 1}\n"
        f"output: {{dir: '{tmp_path / 'run'}'}}\n"
    )
    issues = get_facts("flow").spec_issues(load_spec(spec_path)[0])
    assert [key for key, _ in issues] == ["model.shift"] and "draws sigma itself" in issues[0][1]
    with pytest.raises(FamilyError, match="model.shift"):
        build_model(FlowModelSpec(family="flow", pretrained=NAME, shift=3.0), CACHE_DIR, "cpu")
