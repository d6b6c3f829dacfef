"""The flow-matching pieces the flow family's models share: per-sample timestep densities, loss weights, and
2x2 latent packing (as the MMDiT pipelines pack) with its position ids. Pure tensor functions; the models' recipes
are in their units (dstune/models/<name>/model.py)."""

from __future__ import annotations

import torch

from dstune.families.loss_terms import masked_mean
from dstune.families.precision import at_least_float32
from dstune.families.randomness import sample_generator
from dstune.spec.models import FlowModelSpec


def timestep_density(settings: FlowModelSpec, seed: int, step: int, indices: list[int]) -> torch.Tensor:
    """u in [0, 1] per sample (float32, CPU), by diffusers' compute_density_for_timestep_sampling, each sample
    drawing with its own generator."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    scheme = {"uniform": "none"}.get(settings.timestep_sampling, settings.timestep_sampling)
    or_default = lambda value, default: default if value is None else value  # noqa: E731
    options = dict(
        logit_mean=or_default(settings.logit_mean, 0.0),
        logit_std=or_default(settings.logit_std, 1.0),
        mode_scale=or_default(settings.mode_scale, 1.29),
    )  # the scripts' defaults
    draws = [
        compute_density_for_timestep_sampling(
            scheme, 1, **options, generator=sample_generator(seed, step, i, "timestep")
        )
        for i in indices
    ]
    return torch.cat(draws).float()


def loss_weights(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights (diffusers' compute_loss_weighting_for_sd3): none, sigma_sqrt or cosmap."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    return compute_loss_weighting_for_sd3(scheme, sigmas).float()


def flow_loss_per_sample(
    prediction: torch.Tensor,
    noisy: torch.Tensor,
    latents: torch.Tensor,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    weights: torch.Tensor,
    precondition_outputs: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sample's weighted squared error (at least float32), as diffusers' flow-matching DreamBooth scripts compute it: the velocity
    prediction against noise - x0, or, preconditioned (EDM-style, the MMDiT scripts' default), the x0 it implies
    (x_t - sigma v) against x0, which is the velocity error times sigma^2. With a loss `mask` (B, 1, h, w) at the
    latent grid, each sample's sum(mask x error) / sum(mask) (dstune.families.loss_terms)."""
    prediction, target = at_least_float32(prediction), at_least_float32(noise) - at_least_float32(latents)
    if precondition_outputs:
        prediction, target = prediction * (-sigmas) + at_least_float32(noisy), at_least_float32(latents)
    error = weights * (prediction - target) ** 2
    if mask is None:
        return error.reshape(len(prediction), -1).mean(dim=1)
    return masked_mean(error, mask)  # data.mask_dir / alpha_mask: sum(mask x error) / sum(mask)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 patches as tokens."""
    batch, channels, height, width = latents.shape
    packed = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return packed.reshape(batch, (height // 2) * (width // 2), channels * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of pack_latents; height and width are the latent sides."""
    batch, _, features = packed.shape
    latents = packed.view(batch, height // 2, width // 2, features // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(batch, features // 4, height, width)


def image_ids(height: int, width: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """(H/2 * W/2, 3) positions of the packed latent tokens: (0, row, column), as FluxPipeline makes them."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)
