"""The flow core's second latent stream: a clip's sound (FlowRecipe.sound, a flow_recipe.SoundStream), for an
audio+video transformer. No model is named here: the recipe says how the sound is encoded, tokenised and fed.

    encoded_sound(built, batch) -> {"sound_latent", "has_sound"}    encode_batch's part: cached or encoded latents
    loss_per_kind(...) -> (B,)      clips with sound and clips without, one transformer call per kind
    rendered_clip(built, result)    a sample's frames, with the sound the pipeline rendered beside them

The loss of a clip with sound is its video's flow-matching error plus the mean squared error of its sound tokens,
noised at the clip's sigma with noise of their own, against noise - x0; a clip without sound trains its video alone
(the recipe's predict). A micro batch mixing the two runs one call for each kind and puts the per-sample losses back
in batch order, so the batch mean is what one call per clip would give.

Under a sequence split of N ranks (built.sequence_split) the recipe's split keeps the sound stream whole on every
rank of the group, so every rank computes the whole sound error and the group's gradient sum would count it N
times: its gradient is divided by N, its value kept (the loss logged is one rank's loss).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from dstune.families.precision import at_least_float32
from dstune.families.samples import ClipWithSound


def encoded_sound(built, batch: dict) -> dict:
    """The sound stream's latents (cached, or encoded from the batch's sound) and which clips have sound; nothing
    when the recipe has no sound stream or the batch carries no sound."""
    if built.recipe.sound is None or "has_sound" not in batch:
        return {}
    heard = batch["has_sound"].to(built.device).reshape(-1).bool()  # (B,), or (B, 1) from the latent cache
    if "sound_latent" in batch:
        return {"sound_latent": batch["sound_latent"].to(built.device).float(), "has_sound": heard}
    if not heard.any():  # the loss trains these clips' video alone: their silence is not encoded
        return {"has_sound": heard}
    return {"sound_latent": built.recipe.sound.encode(built, batch["sound"].to(built.device)), "has_sound": heard}


def _rows(value, rows: torch.Tensor, batch: int):
    """The rows of a per-sample tensor (first dimension the batch); anything else as it is."""
    return value[rows] if torch.is_tensor(value) and value.ndim and len(value) == batch else value


def loss_per_kind(
    built, forward, video: tuple, conditions: dict, heard, sound: tuple, dtype, video_loss: Callable
) -> torch.Tensor:
    """Each sample's loss (B,), in batch order: `video` (noisy, timesteps, latents, noise, sigmas) of the batch,
    `sound` (tokens, their noise), `heard` which clips have sound; `video_loss` the core's per-sample video error
    (built, prediction, noisy, latents, noise, sigmas)."""
    tokens, noise = sound
    order, parts = [], []
    for rows in (heard.nonzero().flatten(), (~heard).nonzero().flatten()):  # one transformer call per kind
        if len(rows) == 0:
            continue
        order.append(rows)
        pick = functools.partial(_rows, rows=rows, batch=len(heard))
        noisy, timesteps, latents, video_noise, sigmas = (pick(t) for t in video)
        given = {name: pick(value) for name, value in conditions.items()}
        if heard[rows[0]]:
            sigma = sigmas.reshape(-1, 1, 1)
            clean, drawn = pick(tokens), pick(noise)
            noisy_sound = (1.0 - sigma) * clean + sigma * drawn
            prediction, predicted = built.recipe.sound.predict(
                built, forward, noisy, timesteps, given, noisy_sound, dtype
            )
            sound_error = _once_per_group(
                (at_least_float32(predicted) - at_least_float32(drawn - clean)).pow(2).mean(dim=(1, 2)),
                built.sequence_split,
            )
            parts.append(video_loss(built, prediction, noisy, latents, video_noise, sigmas) + sound_error)
        else:
            prediction = built.recipe.predict(built, forward, noisy, timesteps, given, dtype)
            parts.append(video_loss(built, prediction, noisy, latents, video_noise, sigmas))
    return torch.cat(parts)[torch.argsort(torch.cat(order))]


def _once_per_group(error: torch.Tensor, split: int) -> torch.Tensor:
    """`error` with its gradient divided by the split size (its value unchanged): every rank of a sequence group
    computes it whole, and the group sums the gradients."""
    return error if split == 1 else error / split + (error - error / split).detach()


def rendered_clip(built, result) -> list:
    """One rendered clip: its PIL frames, with the sound rendered beside them where the recipe has a sound stream."""
    frames = list(result.frames[0])
    sound = built.recipe.sound
    if sound is None or sound.rendered is None:
        return frames
    return ClipWithSound(frames, *sound.rendered(built, result))
