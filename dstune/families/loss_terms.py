"""What every diffusion and video model's loss shares beside its error: loss masks (data.mask_dir, data.alpha_mask)
and the sets' roles and weights (data.sets: train and regularization samples, each set's loss_weight).

A batch carries them only where the spec asks (the image dataset and the latent cache write `loss_mask`, and with
data.sets `loss_weight` and `prior`), so a run without them computes its loss exactly as before: the plain mean.

- Masked error: a sample's loss is sum(w x err) / sum(w), w the mask at the latent grid (a clip's: frames x h x w,
  time averaged as its VAE compresses it) broadcast over the latent channels (kohya's masked_loss and OneTrainer's masking normalise per sample this way; a mask of ones gives the
  plain mean). A sample whose mask is all black adds 0.
- Roles: a micro batch's loss is the mean of loss_weight x loss over its train samples plus the same mean over its
  regularization samples and over its preservation samples, each term there only when the micro batch has such
  samples. With one train set and one regularization set of weight w this is the diffusers DreamBooth scripts'
  `loss + prior_loss_weight * prior_loss` (their instance and class halves of a batch, each a mean).
- Preservation (differential output preservation, LoRA only): a preservation sample's target is the base model's
  own prediction on the same noisy input and conditions, the adapters switched off (`base_prediction`: no copy of
  the model, no gradient), and its loss the squared error of the trained prediction against it.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.nn.functional as F

from dstune.families.lora import adapters_off

LOSS_TERM_FIELDS = ("loss_weight", "prior", "preserve")  # per-sample (B,) fields a batch carries with data.sets


def mask_at_latents(mask: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """A mask in [0, 1] averaged down to the latent grid `size`: (B, 1, H, W) to (h, w), each latent's weight the
    mean of the pixels it covers (area interpolation; H = h x the VAE's factor, so a plain block average); a clip's
    (B, 1, T, H, W) to (f, h, w) the same way after time is averaged as the video VAEs compress it: latent frame 0
    is frame 0 alone, latent frame k the mean of frames (k-1)t+1 .. kt, t = (T - 1) / (f - 1): the VAE's temporal
    compression, read from the shapes, whatever the model."""
    mask, size = mask.float(), tuple(size)
    if mask.ndim == 5:
        frames, latent_frames = mask.shape[2], size[0]
        if latent_frames == 1 or frames == 1:
            mask = mask[:, :, :1]
        elif (frames - 1) % (latent_frames - 1):
            raise ValueError(
                f"a loss mask of {frames} frames does not compress to {latent_frames} latent frames "
                "(the VAE keeps the first frame, then t frames per latent frame)"
            )
        else:
            t = (frames - 1) // (latent_frames - 1)
            rest = mask[:, :, 1:].unflatten(2, (latent_frames - 1, t)).mean(dim=3)
            mask = torch.cat([mask[:, :, :1], rest], dim=2)
    if tuple(mask.shape[2:]) == size:
        return mask
    return F.interpolate(mask, size=size, mode="area")


def loss_terms(batch: dict, latent_shape: torch.Size, device) -> dict:
    """The batch's loss mask at the latent grid of latents of `latent_shape` (B, C, h, w), or a clip's
    (B, C, f, h, w), and its sets' roles and weights, on `device`; {} for a batch without them."""
    terms = {}
    if "loss_mask" in batch:
        terms["loss_mask"] = mask_at_latents(batch["loss_mask"].to(device), tuple(latent_shape[2:]))
    terms.update({name: batch[name].to(device) for name in LOSS_TERM_FIELDS if name in batch})
    return terms


def masked_mean(error: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each sample's mean of `error` (B, C, ...), or with a (B, 1, ...) mask sum(mask x error) / sum(mask), the mask
    broadcast over the channels; 0 for a sample whose mask is all zero."""
    if mask is None:
        return error.reshape(len(error), -1).mean(dim=1)
    weights = mask.to(error.dtype).expand_as(error).reshape(len(error), -1)
    total = weights.sum(dim=1)
    return (weights * error.reshape(len(error), -1)).sum(dim=1) / total.clamp_min(torch.finfo(error.dtype).tiny)


def preserves(encoded: dict) -> bool:
    """Whether the micro batch has preservation samples (their target is the base model's prediction)."""
    return "preserve" in encoded and bool(encoded["preserve"].any())


def base_prediction(trainable: torch.nn.Module, predict) -> torch.Tensor:
    """`predict()` (the model's own forward on the step's noisy input) with the adapters of `trainable` switched
    off and no gradient: the base model's output, the target of preservation samples. Run before the trained
    forward, so its activations are freed before the trained forward keeps its own."""
    with torch.no_grad(), adapters_off(trainable):
        return predict().detach()


def preserved_error(prediction: torch.Tensor, base: torch.Tensor, encoded: dict, per_sample: torch.Tensor):
    """Each sample's loss with the preservation samples' replaced by their error against the base prediction
    (masked as the others are)."""
    held = masked_mean((prediction.float() - base.float()) ** 2, encoded.get("loss_mask"))
    return torch.where(encoded["preserve"].bool(), held.to(per_sample.dtype), per_sample)


def batch_loss(per_sample: torch.Tensor, encoded: dict) -> torch.Tensor:
    """The micro batch's loss from each sample's (B,): the mean, or with data.sets the train samples' weighted mean
    plus the regularization and the preservation samples' (see the module's docstring)."""
    if "loss_weight" not in encoded:
        return per_sample.mean()
    weighted = per_sample * encoded["loss_weight"].to(per_sample.dtype)
    none = torch.zeros(len(per_sample), dtype=torch.bool, device=per_sample.device)
    prior, preserve = (encoded.get(name, none).bool() for name in ("prior", "preserve"))
    total = per_sample.new_zeros(())
    for members in (~(prior | preserve), prior, preserve):
        if bool(members.any()):
            total = total + weighted[members].mean()
    return total


def parted_loss(parts: dict[str, torch.Tensor], encoded: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro batch's loss from several parts' per-sample errors ({name: (B,)}, summed per sample in their
    order, then batch_loss), and each part's share as the training log shows it (Family.loss_parts): averaged over
    every sample of the batch, as the loss is, so that the shares add up to it."""
    shares = {name: float(error.detach().mean()) for name, error in parts.items()}
    return batch_loss(functools.reduce(operator.add, parts.values()), encoded), shares
