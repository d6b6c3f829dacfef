"""The loss terms every diffusion model shares (dstune.families.loss_terms), on the real tiny models of both cores
(UnetModel: tiny-sd; FlowModel: tiny-flow, an SD3 transformer): masked loss and DreamBooth prior preservation.

- masked loss: a mask of ones gives the unmasked loss; a half mask gives the error over the kept half, computed by
  hand from diffusers' train_text_to_image.py lines on the same draws; the mask the latent cache stores beside the
  latents is the mask file averaged down to the latent grid, and trains as the uncached mask does;
- prior preservation: a batch of instance and class images gives diffusers' train_dreambooth.py
  `loss + prior_loss_weight * prior_loss` on the same draws (1e-5);
- differential output preservation (LoRA): the target is the base model's output with the adapters switched off,
  equal bit for bit to the model loaded without adapters, and the loss the adapted prediction's error against it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image

from dstune.builtin.common import to_tensor
from dstune.data.synthetic import render_shape
from dstune.families.randomness import per_sample_randint, per_sample_randn
from dstune.models.sd.spec import SdModelSpec
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec
from loaded_models import CACHE_DIR, start_up

SEED, STEP = 3, 5
PRIOR_LOSS_WEIGHT = 0.7


@pytest.fixture(scope="module")
def sd():
    return build_model(SdModelSpec(family="sd", pretrained="builtin:tiny-sd"), CACHE_DIR, "cpu", torch.float32)


@pytest.fixture(scope="module")
def flow():
    spec = FlowModelSpec(family="flow", pretrained="builtin:tiny-flow", timestep_sampling="uniform")
    return build_model(spec, CACHE_DIR, "cpu", torch.float32)


def batch(indices: list[int], **fields) -> dict:
    images = [render_shape(i, 32) for i in indices]
    return {
        "pixel_values": to_tensor([image for image, _ in images]),
        "captions": [caption for _, caption in images],
        "indices": torch.tensor(indices, dtype=torch.long),
        **fields,
    }


def loss_of(model, fields: dict, indices=(0, 1, 2, 3)) -> torch.Tensor:
    with torch.no_grad():
        encoded = model.encode_batch(batch(list(indices), **fields), torch.float32)
        return model.loss(model.trainable, encoded, SEED, STEP)


def reference_sd_error(model, indices) -> torch.Tensor:
    """diffusers' examples/text_to_image/train_text_to_image.py step on tiny-sd, with dstune's per-sample draws
    (a sample's noise, timestep and posterior draw from its own generator): F.mse_loss(model_pred, target,
    reduction="none"), (B, C, h, w), before its mean."""
    model_pred, target = reference_sd_step(model, indices)
    return F.mse_loss(model_pred.float(), target.float(), reduction="none")


def reference_sd_prediction(model, indices) -> torch.Tensor:
    return reference_sd_step(model, indices)[0]


def reference_sd_step(model, indices) -> tuple[torch.Tensor, torch.Tensor]:
    """(model_pred, target) of that step."""
    with torch.no_grad():
        b = batch(list(indices))
        latent_dist = model.vae.encode(b["pixel_values"]).latent_dist
        draw = per_sample_randn(latent_dist.mean.shape[1:], SEED, STEP, list(indices), "vae_posterior")
        latents = (latent_dist.mean + latent_dist.std * draw) * model.vae.config.scaling_factor
        noise = per_sample_randn(latents.shape[1:], SEED, STEP, list(indices), "noise")
        scheduler = model.noise_scheduler
        timesteps = per_sample_randint(scheduler.config.num_train_timesteps, SEED, STEP, list(indices), "timestep")
        noisy = scheduler.add_noise(latents, noise, timesteps)
        if scheduler.config.prediction_type == "epsilon":
            target = noise
        else:
            target = scheduler.get_velocity(latents, noise, timesteps)
        hidden = model.encode_text(b["captions"])["encoder_hidden_states"]
        model_pred = model.trainable(noisy, timesteps, hidden, return_dict=False)[0]
        return model_pred, target


# ------------------------------------------------------------------------------------------------------ masks


@pytest.mark.parametrize("name", ["sd", "flow"])
def test_a_mask_of_ones_gives_the_unmasked_loss(name, request):
    model = request.getfixturevalue(name)
    plain = loss_of(model, {})
    ones = loss_of(model, {"loss_mask": torch.ones(4, 1, 32, 32)})
    assert ones.item() == pytest.approx(plain.item(), rel=1e-6)
    half = torch.ones(4, 1, 32, 32)
    half[..., 16:] = 0
    assert abs(loss_of(model, {"loss_mask": half}).item() - plain.item()) > 1e-4  # a mask does change it


def test_a_half_mask_gives_the_error_over_the_kept_half_by_hand(sd):
    """The left half of every image kept (pixels 0-15 of 32: the left half of the latent columns)."""
    mask = torch.zeros(4, 1, 32, 32)
    mask[..., :16] = 1
    error = reference_sd_error(sd, (0, 1, 2, 3))
    kept = error[..., : error.shape[-1] // 2].mean(dim=(1, 2, 3)).mean()
    assert loss_of(sd, {"loss_mask": mask}).item() == pytest.approx(kept.item(), rel=1e-5)
    assert loss_of(sd, {}).item() == pytest.approx(error.mean().item(), rel=1e-5)  # the reference is the loss's


def test_a_grey_mask_weighs_the_error_per_sample(flow):
    """sum(w x err) / sum(w) per sample: a mask that is 0.5 everywhere gives the unmasked loss (the weights cancel),
    and a sample whose mask is all black adds nothing to the mean of the others."""
    plain = loss_of(flow, {})
    assert loss_of(flow, {"loss_mask": torch.full((4, 1, 32, 32), 0.5)}).item() == pytest.approx(plain.item(), 1e-6)
    black = torch.ones(4, 1, 32, 32)
    black[3] = 0
    three = loss_of(flow, {}, indices=(0, 1, 2))
    assert loss_of(flow, {"loss_mask": black}).item() == pytest.approx(three.item() * 3 / 4, rel=1e-6)


# ----------------------------------------------------------------------------------------- prior preservation


def test_prior_preservation_equals_the_dreambooth_scripts_loss_lines(sd):
    """Instance images 0, 1 and class images 2, 3 in one batch, as train_dreambooth.py concatenates them: its
    chunk(2) into instance and prior halves, each F.mse_loss(..., reduction="mean"), loss + w x prior_loss."""
    error = reference_sd_error(sd, (0, 1, 2, 3))
    instance, prior = torch.chunk(error, 2, dim=0)
    reference = instance.mean() + PRIOR_LOSS_WEIGHT * prior.mean()
    fields = {
        "loss_weight": torch.tensor([1.0, 1.0, PRIOR_LOSS_WEIGHT, PRIOR_LOSS_WEIGHT]),
        "prior": torch.tensor([False, False, True, True]),
    }
    assert loss_of(sd, fields).item() == pytest.approx(reference.item(), rel=1e-5)


@pytest.mark.parametrize("name", ["sd", "flow"])
def test_prior_preservation_is_the_instance_mean_plus_the_weighted_class_mean(name, request):
    """The flow DreamBooth scripts (train_dreambooth_sd3.py, _flux.py) add their prior loss the same way: each half's
    own loss (each sample's draws are its own, so each half alone draws what it drew in the batch), then
    loss + w x prior_loss; the samples may come in any order in the batch."""
    model = request.getfixturevalue(name)
    instance, prior = loss_of(model, {}, indices=(0, 2)), loss_of(model, {}, indices=(1, 3))
    fields = {
        "loss_weight": torch.tensor([1.0, PRIOR_LOSS_WEIGHT, 1.0, PRIOR_LOSS_WEIGHT]),
        "prior": torch.tensor([False, True, False, True]),
    }
    combined = loss_of(model, fields)
    assert combined.item() == pytest.approx((instance + PRIOR_LOSS_WEIGHT * prior).item(), rel=1e-5)


# --------------------------------------------------------------------------------------------- the mask cache


def write_masked_set(root: Path) -> Path:
    """4 images with captions in `images/`, and a mask per image in `masks/`: white left of a column that differs
    per image, with a grey band, at twice the image's size (masks are resized to their image)."""
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i in range(4):
        image, caption = render_shape(i, 32)
        image.save(root / "images" / f"{i}.png")
        (root / "images" / f"{i}.txt").write_text(caption)
        mask = np.zeros((64, 64), dtype=np.uint8)
        mask[:, : 16 + 8 * i] = 255
        mask[:, 16 + 8 * i : 24 + 8 * i] = 128
        Image.fromarray(mask).save(root / "masks" / f"{i}.png")
    return root


def test_the_cached_mask_is_the_images_mask_at_latent_size_and_trains_as_the_uncached_one(tmp_path):
    root = write_masked_set(tmp_path / "data")
    losses = {}
    for cached in (True, False):
        spec = {
            "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
            "data": {
                "path": str(root / "images"),
                "mask_dir": "../masks",
                "resolution": 32,
                "num_workers": 0,
                "cache": {"latents": cached, "dir": str(tmp_path / "cache")},
            },
            "train": {"micro_batch_size": 4, "max_steps": 1, "precision": "fp32", "seed": SEED},
            "output": {"dir": str(tmp_path / f"run-{cached}"), "cache_dir": str(CACHE_DIR)},
        }
        path = tmp_path / f"spec-{cached}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        model, caches, loader = start_up(path)
        batch = next(iter(loader))
        if cached:
            side = batch["latent_mean"].shape[-1]  # the latent grid (tiny-sd's VAE: 2 pixels per latent)
            assert caches.images.latents and batch["loss_mask"].shape == (4, 1, side, side)  # read from the entries
            factor = 32 // side
            for row, sample_id in zip(batch["loss_mask"], batch["sample_id"]):
                mask = Image.open(root / "masks" / sample_id).resize((32, 32), Image.Resampling.BILINEAR)
                pixels = torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)
                by_hand = pixels.reshape(side, factor, side, factor).mean(dim=(1, 3))  # the mean of its pixels
                assert torch.allclose(row[0], by_hand, atol=1e-6)
        else:
            assert batch["loss_mask"].shape == (4, 1, 32, 32)  # pixels; the model averages them down
        with torch.no_grad():
            losses[cached] = model.loss(model.trainable, model.encode_batch(batch, torch.float32), SEED, 0).item()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


# ---------------------------------------------------------------------------- differential output preservation


def with_trained_adapters(spec, seed=11):
    """A loaded model with LoRA adapters whose B matrices are drawn away from zero (as after training), so the
    adapted model's output differs from the base's."""
    from dstune.families.lora import apply_train_mode

    model = build_model(spec, CACHE_DIR, "cpu", torch.float32)
    apply_train_mode(model, spec, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


@pytest.fixture(scope="module")
def sd_lora():
    return with_trained_adapters(SdModelSpec(family="sd", pretrained="builtin:tiny-sd", train="lora", lora={"rank": 2}))


@pytest.fixture(scope="module")
def flow_lora():
    spec = FlowModelSpec(
        family="flow", pretrained="builtin:tiny-flow", timestep_sampling="uniform", train="lora", lora={"rank": 2}
    )
    return with_trained_adapters(spec)


def predictions(model, name: str):
    """`prediction()`: the model's forward on fixed noisy latents of batch 0-3 (its own predict, its own inputs)."""
    encoded = model.encode_batch(batch([0, 1, 2, 3]), torch.float32)
    noisy = torch.randn(encoded["latent_mean"].shape, generator=torch.Generator().manual_seed(5))
    if name == "sd":
        timesteps = torch.tensor([10, 200, 500, 900])
        return lambda: model.predict(model.trainable, noisy, timesteps, encoded)
    conditions = model.conditions(encoded, torch.float32)
    return lambda: model.predict(
        model.trainable, noisy, torch.tensor([10.0, 200.0, 500.0, 900.0]), conditions, torch.float32
    )


@pytest.mark.parametrize("name", ["sd", "flow"])
def test_the_preservation_target_is_the_base_models_output_bit_for_bit(name, request):
    """base_prediction switches the adapters off in place: its output equals the model loaded without adapters,
    exactly; the adapters are back on afterwards and still train."""
    from dstune.families.loss_terms import base_prediction

    adapted, base = request.getfixturevalue(f"{name}_lora"), request.getfixturevalue(name)
    with torch.no_grad():
        trained = predictions(adapted, name)()
        reference = predictions(base, name)()
    target = base_prediction(adapted.trainable, predictions(adapted, name))
    assert torch.equal(target, reference)
    assert (trained - reference).abs().max() > 1e-3  # the adapters do change the output
    with torch.no_grad():
        assert torch.equal(predictions(adapted, name)(), trained)  # switched back on
    trainable = [n for n, p in adapted.trainable.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)


def test_dop_loss_is_the_adapted_prediction_against_the_base_by_hand(sd_lora, sd):
    """A micro batch of preservation samples (weight w): w x the mean squared error of the adapted model's
    prediction against the base model's, on the step's own noisy latents (diffusers' lines, reference_sd_error);
    its gradient reaches the adapters."""
    fields = {
        "loss_weight": torch.full((4,), PRIOR_LOSS_WEIGHT),
        "prior": torch.zeros(4, dtype=torch.bool),
        "preserve": torch.ones(4, dtype=torch.bool),
    }
    adapted_prediction = reference_sd_prediction(sd_lora, (0, 1, 2, 3))
    base_prediction_ = reference_sd_prediction(sd, (0, 1, 2, 3))
    by_hand = PRIOR_LOSS_WEIGHT * ((adapted_prediction - base_prediction_) ** 2).mean()
    encoded = sd_lora.encode_batch(batch([0, 1, 2, 3], **fields), torch.float32)
    loss = sd_lora.loss(sd_lora.trainable, encoded, SEED, STEP)
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    loss.backward()
    grads = [p.grad for n, p in sd_lora.trainable.named_parameters() if ".lora_B." in n]
    assert grads and all(g is not None for g in grads) and any(g.abs().max() > 0 for g in grads)
    sd_lora.trainable.zero_grad(set_to_none=True)
