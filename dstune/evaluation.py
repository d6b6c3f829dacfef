"""The held-out loss (data.eval): the training loss on samples that never train, with the same noise and timesteps
at every evaluation, so two evaluations differ only because the weights did.

    held_out = make_held_out(spec.data, records, plan.micro_batch_size, seed)   # records: index_dataset(...).held_out
    mean, count = evaluate(run, model, engine, held_out, dtype, offloaded)   # collective, every rank

Fixed draws: every random draw of the loss comes from sample_generator(seed, EVAL_STEP, index, purpose), where index
is the sample's position in the held-out set; training steps are >= 0, so the held-out draws never repeat a
training draw. The images are centre-cropped, unflipped and keep their captions.

Independent of the number of ranks: the held-out set is cut into fixed batches (`eval_batches`: dataset order,
one bucket per batch) whatever the world; rank r computes batches r, r + world, ...; the per-batch sums are gathered
and added in batch order on every rank. So 1 rank and 8 ranks add the same numbers in the same order. Every rank
runs the same number of forward passes (a rank short of a batch repeats one and drops its result), because under
ZeRO-3 each forward gathers the weights with all ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from dstune.cache.latents import frozen_on_device
from dstune.data.images import ImageCaptionDataset, collate
from dstune.distributed import Run, all_gather_object
from dstune.families.base import TrainedModel
from dstune.spec.models import DataSpec

EVAL_STEP = -1  # the `step` of the held-out draws (see the module docstring)


@dataclass
class HeldOut:
    dataset: ImageCaptionDataset
    batches: list[list[int]]  # the fixed batches: dataset indices, the same on every rank and for every world
    every_steps: Optional[int]
    seed: int

    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate after optimizer step `step`: every data.eval.every_steps, and after the last step."""
        return step == last_step or bool(self.every_steps and step % self.every_steps == 0)


def eval_batches(group_keys: Optional[list], count: int, batch_size: int) -> list[list[int]]:
    """Indices 0..count-1 cut into batches of at most batch_size, in dataset order, each from one group (bucket):
    groups in the order they first appear."""
    groups: dict = {}
    for index in range(count):
        groups.setdefault(None if group_keys is None else group_keys[index], []).append(index)
    return [
        members[start : start + batch_size]
        for members in groups.values()
        for start in range(0, len(members), batch_size)
    ]


def rank_share(batches: list[list[int]], rank: int, world_size: int) -> list[tuple[int, list[int]]]:
    """(batch number, indices) of the batches rank `rank` computes, padded to the most any rank has: a padding
    entry has number -1 (computed for the collective forward passes, then dropped)."""
    mine = [(number, batches[number]) for number in range(rank, len(batches), world_size)]
    most = math.ceil(len(batches) / world_size)
    return mine + [(-1, batches[0])] * (most - len(mine))


def make_held_out(data: DataSpec, records: list, micro_batch_size: int, seed: int) -> Optional[HeldOut]:
    """The held-out set of data.eval (None without it). The images are read as training reads them, without the
    random parts: centre crop, no flip, no caption dropout; with data.sets, as a folder of its own (no set's role,
    weight or masks: the plain mean over its images)."""
    if data.eval is None:
        return None
    fixed = data.model_copy(
        update={"center_crop": True, "random_flip": False, "caption_dropout": 0.0, "eval": None, "sets": None}
    )
    dataset = ImageCaptionDataset(fixed, records, seed)
    batches = eval_batches(dataset.group_keys(), len(dataset), data.eval.batch_size or micro_batch_size)
    return HeldOut(dataset, batches, data.eval.every_steps, seed)


def batch_losses(
    model: TrainedModel, forward, held_out: HeldOut, share: list[tuple[int, list[int]]], dtype: torch.dtype
) -> list[tuple[int, float, int]]:
    """(batch number, loss x samples, samples) for each real batch of `share`, under no_grad. The model's loss
    is the mean over its batch, so loss x samples is the batch's sum."""
    out = []
    with torch.no_grad():
        for number, indices in share:
            batch = collate([held_out.dataset[index] for index in indices])
            encoded = model.encode_batch(batch, dtype)
            loss = model.loss(forward, encoded, held_out.seed, EVAL_STEP)
            if number >= 0:
                out.append((number, float(loss.detach().double()) * len(indices), len(indices)))
    return out


def combine(per_batch: list[tuple[int, float, int]]) -> tuple[float, int]:
    """(mean loss per sample, samples) from every rank's batch results, added in batch order."""
    ordered = sorted(per_batch)
    total = 0.0
    for _, loss_sum, _ in ordered:
        total += loss_sum
    count = sum(samples for _, _, samples in ordered)
    return total / max(count, 1), count


def evaluate(
    run: Run, model: TrainedModel, engine, held_out: HeldOut, dtype: torch.dtype, offloaded: list[str]
) -> tuple[float, int]:
    """Collective: the held-out loss with the current (trained, not EMA) weights, the same value on every rank.
    The model is in eval mode meanwhile (dropout off), and back in train mode after."""
    # the ranks of a sequence group compute the same batches together (their forward is one split forward)
    share = rank_share(held_out.batches, run.data_parallel_rank, run.data_parallel_size)
    modules = list(model.trainable.modules())
    training = [module.training for module in modules]  # restored as they were, frozen parts in eval included
    model.trainable.eval()
    try:
        with frozen_on_device(model, offloaded):
            mine = batch_losses(model, engine, held_out, share, dtype)
    finally:
        for module, mode in zip(modules, training):
            module.training = mode
    mine = mine if run.rank % run.sequence_parallel_size == 0 else []  # one result per sequence group
    return combine([entry for rank_entries in all_gather_object(mine) for entry in rank_entries])
