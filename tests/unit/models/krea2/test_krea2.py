"""Krea 2 (its card and class, dstune.models.krea2) on builtin:tiny-krea2's real components.

The loss-parity test re-computes the loss lines of diffusers' examples/dreambooth/train_dreambooth_lora_krea2.py
with diffusers' own pieces: the captions through the text-encoding Krea2Pipeline the example makes with
from_pretrained (so the folder's text_encoder_select_layers), one caption at a time and concatenated as its cache
does, the sampled posterior normalised with latents_mean / latents_std, the scheduler's unshifted tables, the 2x2
packing, Krea2Pipeline.prepare_position_ids, timestep / 1000, the unpacking and compute_loss_weighting_for_sd3. The
posterior draw, the noise and u are dstune's per-sample draws, taken by both sides.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of, load_model
from dstune.families.base import FamilyError
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.krea2.card import KREA2_CARD
from dstune.models.krea2.model import Krea2
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_settings
from tiny_batches import shape_batch

SEED, STEP, INDICES = 5, 2, [1, 8, 13]
CASES = {  # (dstune settings, the example's flags): its defaults (uniform u: --weighting_scheme none), then others
    "script-defaults": (dict(timestep_sampling="uniform"), dict(weighting_scheme="none")),
    "logit-normal": (dict(timestep_sampling="logit_normal"), dict(weighting_scheme="logit_normal")),
}


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained="builtin:tiny-krea2"), CACHE_DIR, "cpu")


def test_raw_and_turbo_builtins_are_krea2_folders_that_differ_only_where_the_checkpoints_do(built):
    from diffusers import Krea2Pipeline

    raw, turbo = (tiny.ensure_builtin_model(name, CACHE_DIR) for name in ("tiny-krea2", "tiny-krea2-turbo"))
    assert card_of("flow", raw) is card_of("flow", turbo) is KREA2_CARD and built.card is KREA2_CARD
    assert type(built) is Krea2
    assert built.max_sequence_length == 512  # the example's --max_sequence_length default
    raw_pipeline, turbo_pipeline = Krea2Pipeline.from_pretrained(raw), Krea2Pipeline.from_pretrained(turbo)
    assert (raw_pipeline.config.is_distilled, turbo_pipeline.config.is_distilled) == (False, True)
    for part in ("transformer", "vae", "text_encoder"):
        assert (raw / part / "config.json").read_text() == (turbo / part / "config.json").read_text()
    assert not torch.equal(raw_pipeline.transformer.img_in.weight, turbo_pipeline.transformer.img_in.weight)
    assert torch.equal(raw_pipeline.vae.decoder.conv_out.weight, turbo_pipeline.vae.decoder.conv_out.weight)


def test_a_folder_whose_taps_do_not_fit_the_transformer_is_refused(tmp_path):
    import json
    import shutil

    folder = tmp_path / "krea2"
    shutil.copytree(tiny.ensure_builtin_model("tiny-krea2", CACHE_DIR), folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder_select_layers"] = [1, 2, 3]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(FamilyError, match=r"num_text_layers 2 != 3"):
        load_model(
            card_of("flow", folder),
            FlowModelSpec(family="flow", pretrained=str(folder)),
            {"pretrained": folder},
            "cpu",
            torch.float32,
        )


@functools.lru_cache(maxsize=1)
def _script_text_pipeline(folder: Path):
    """The example's text-encoding pipeline: from_pretrained without VAE, transformer and scheduler."""
    from diffusers import Krea2Pipeline

    return Krea2Pipeline.from_pretrained(folder, vae=None, transformer=None, scheduler=None)


def _script_text(folder: Path, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each caption encoded alone and the pairs concatenated (the example's concat_prompt_embedding_batches)."""
    pipeline = _script_text_pipeline(folder)
    with torch.no_grad():
        pairs = [pipeline.encode_prompt(prompt=[caption], max_sequence_length=512) for caption in captions]
    return torch.cat([embeds for embeds, _ in pairs]), torch.cat([mask for _, mask in pairs])


def _script_loss(built, encoded: dict, captions: list[str], flags: dict, u: torch.Tensor) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(built.folder / "scheduler")
    vae = built.vae
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    mean, std = encoded["latent_mean"].unsqueeze(2), encoded["latent_std"].unsqueeze(2)  # the VAE's 5-D posterior
    draw = lambda purpose: per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, purpose)  # noqa: E731
    model_input = (mean + std * draw("vae_posterior") - latents_mean) * latents_std
    noise = draw("noise")
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    positions = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[positions].flatten().view(-1, 1, 1, 1, 1)
    noisy = ((1.0 - sigmas) * model_input + sigmas * noise).permute(0, 2, 1, 3, 4)
    batch, channels, _, height, width = model_input.shape
    packed = noisy.reshape(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    packed = packed.reshape(batch, (height // 2) * (width // 2), channels * 4)
    embeds, mask = _script_text(built.folder, captions)
    ids = Krea2Pipeline.prepare_position_ids(embeds.shape[1], height // 2, width // 2, "cpu")
    with torch.no_grad():
        model_pred = built.trainable(
            hidden_states=packed,
            encoder_hidden_states=embeds,
            timestep=timesteps / 1000,
            position_ids=ids,
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
    model_pred = model_pred.view(batch, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    model_pred = model_pred.reshape(batch, channels, 1, height, width)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=flags["weighting_scheme"], sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(batch, -1), 1)
    return loss.mean()


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_diffusers_krea2_script(built, case):
    settings, flags = CASES[case]
    model = with_settings(built, **settings)
    batch = shape_batch(INDICES)
    encoded = model.encode_batch(batch)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(model.trainable, encoded, SEED, STEP)
    reference = _script_loss(model, encoded, batch["caption"], flags, u)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_cached_text_has_one_shape_per_caption_and_trains_like_encoded_text(built):
    tensors = built.encode_text(["a", "a much longer caption about a red circle"])
    embeds, mask = tensors["encoder_hidden_states"], tensors["encoder_attention_mask"]
    tokens = built.text_tokens()
    assert embeds.shape[:3] == (2, tokens, 2) and mask.shape == (2, tokens)
    assert mask[0].sum() < mask[1].sum()
    batch = shape_batch([4, 7])
    cached = {**batch, **built.encode_text(batch["caption"])}
    with torch.no_grad():
        encoded = built.loss(built.trainable, built.encode_batch(batch), 0, 1)
        from_cache = built.loss(built.trainable, built.encode_batch(cached), 0, 1)
    assert from_cache.item() == encoded.item()


def test_sample_and_export_reload_with_krea2_pipeline(built, tmp_path):
    from diffusers import Krea2Pipeline

    images = built.sample(
        built.trainable,
        ["a red circle", "a blue square"],
        SampleSpec(prompts=["x"], steps=2, guidance=4.5, seed=1),
        32,
    )
    assert [image.size for image in images] == [(32, 32), (32, 32)]
    state = {k: v + 0.01 for k, v in built.trainable.state_dict().items()}
    reloaded = Krea2Pipeline.from_pretrained(built.export(state, tmp_path / "export"))
    assert reloaded.text_encoder_select_layers == (1, 3)
    assert torch.equal(reloaded.transformer.state_dict()["img_in.weight"], state["img_in.weight"])
    rendered = reloaded(prompt="a red circle", height=32, width=32, num_inference_steps=2).images
    assert rendered[0].size == (32, 32)
