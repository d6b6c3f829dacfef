"""Grouped batching: every GLOBAL batch (micro x accumulation x ranks) is drawn from one group of samples.

Aspect-ratio buckets (images of one bucket share one width x height) and length-grouped audio batches (samples of
one duration bucket pad to similar lengths) are the same problem: samples carry a group key, and a batch must not
mix keys. This module is that core; it knows nothing about images or audio. numpy only, no torch, so the plan and
`dstune validate` can use the same arithmetic the sampler obeys.

API (for a new kind of group, e.g. audio duration buckets):

    keys = [bucket_of(sample) for each dataset index]    # any hashable, sortable value: (w, h), 3, "short"
    counts = group_counts(keys)                           # {key: samples}, sorted by key (dstune.plan)
    rows = group_batches(counts, global_batch_size)       # [GroupBatches(key, samples, steps, dropped)] (dstune.plan)
    plan = make_plan(train, world, len(keys), source, {key_label(k): n for k, n in counts.items()})  # dstune.plan
    order = GroupedOrder(keys, global_batch_size, seed)   # the epochs
    key, indices = order.global_batch(epoch, step)        # one global batch: its key and its sample indices

    # a training loader: dstune.data.sampler.GlobalBatchSampler(num_samples, plan, rank, seed, group_keys=keys)
    # cuts each global batch into this rank's micro batches exactly as it does without groups.

Rules (the same for every key type):
  - An epoch: each group's indices are permuted (one stream per (seed, epoch)), cut into whole global batches,
    and the remainder of each group (fewer than a global batch) is left out of that epoch; since the permutation
    changes every epoch, a different set is left out each time. The whole-batch lists of all groups are then
    shuffled together (same stream), so groups interleave across the epoch instead of running one after another.
  - steps per epoch = sum over groups of (group samples // global batch). A group smaller than one global batch
    never trains: the plan reports it (dstune.plan warns).
  - The order depends only on (seed, epoch, keys): never on the world size, the accumulation or the micro batch.
    A global batch is split into micro batches by the sampler (micro batch number k * world_size + rank), so a
    1-rank x 2-accumulation run and a 2-rank x 1-accumulation run train on the same samples at every step, and
    every micro batch of a step (all ranks, all accumulation steps) has the step's key.
  - Resume: `global_batch(epoch, step)` is a pure function of its arguments; start anywhere.
"""

from __future__ import annotations

import hashlib
from typing import Hashable, Sequence

import numpy as np

from dstune.plan import GroupBatches, group_batches, group_counts, key_label  # noqa: F401 - the core's API

_GROUP_ORDER_SALT = 0x6_B0C5  # separates the grouped order stream from the flat order and per-sample streams


def keys_fingerprint(keys: Sequence[Hashable]) -> str:
    """A short digest of the key of every index: a checkpoint made with other groups must not resume here."""
    digest = hashlib.sha256()
    for key in keys:
        digest.update(repr(key).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


class GroupedOrder:
    """The epochs of a grouped dataset: which global batch (key and indices) each optimizer step trains on."""

    def __init__(self, keys: Sequence[Hashable], global_batch_size: int, seed: int):
        self.keys = list(keys)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.groups = sorted(set(self.keys))
        self._members = {key: [] for key in self.groups}
        for index, key in enumerate(self.keys):
            self._members[key].append(index)
        self._members = {key: np.asarray(members, dtype=np.int64) for key, members in self._members.items()}
        self.rows = group_batches({key: len(self._members[key]) for key in self.groups}, global_batch_size)
        self.steps_per_epoch = sum(row.steps for row in self.rows)
        self._cache: tuple[int, list[int], np.ndarray] | None = None

    def _epoch(self, epoch: int) -> tuple[list[int], np.ndarray]:
        """(group number of each step, (steps, global batch) index array) for `epoch`, cached for the last one."""
        if self._cache is None or self._cache[0] != epoch:
            rng = np.random.default_rng([_GROUP_ORDER_SALT, self.seed, epoch])
            batches, group_of_batch = [], []
            for number, key in enumerate(self.groups):  # fixed group order: the stream is used identically
                members = self._members[key]
                whole = len(members) // self.global_batch_size * self.global_batch_size
                shuffled = members[rng.permutation(len(members))][:whole]
                batches.extend(shuffled.reshape(-1, self.global_batch_size))
                group_of_batch += [number] * (whole // self.global_batch_size)
            order = rng.permutation(len(batches))
            stacked = np.stack(batches)[order] if batches else np.zeros((0, self.global_batch_size), np.int64)
            self._cache = (epoch, [group_of_batch[i] for i in order], stacked)
        return self._cache[1], self._cache[2]

    def global_batch(self, epoch: int, step: int) -> tuple[Hashable, np.ndarray]:
        """(key, indices) of global batch `step` of `epoch`; indices has global_batch_size entries."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside 0..{self.steps_per_epoch - 1} steps per epoch")
        groups, batches = self._epoch(epoch)
        return self.groups[groups[step]], batches[step]

    def step_keys(self, epoch: int) -> list[Hashable]:
        """The key of every step of `epoch`, in order."""
        return [self.groups[g] for g in self._epoch(epoch)[0]]


_SPEAKER_ORDER_SALT = 0x5_B4A1  # separates the speaker-balanced order stream from the others


def speaker_balanced_order(speakers: Sequence[str], seed: int, epoch: int) -> np.ndarray:
    """data.speaker_balance: the epoch's order of dataset indices (one per index, so the plan's steps hold) in
    which every speaker fills the same number of places. Rule, from one stream per (seed, epoch):
      - N places, S speakers (sorted): each gets N // S places; the N % S left over go to the first speakers of a
        permutation of the speakers;
      - a speaker's places are its clips in a fresh permutation, then another permutation when they run out (a
        speaker with few clips repeats within the epoch, one with many leaves some out, a different set each epoch);
      - all places are then permuted together. Pure numpy, so every rank computes the same order."""
    rng = np.random.default_rng([_SPEAKER_ORDER_SALT, seed, epoch])
    names = sorted(set(speakers))
    members = {name: [] for name in names}
    for index, name in enumerate(speakers):
        members[name].append(index)
    share, left_over = divmod(len(speakers), len(names))
    extra = set(rng.permutation(len(names))[:left_over].tolist())
    places = []
    for number, name in enumerate(names):
        clips = np.asarray(members[name], dtype=np.int64)
        wanted = share + (number in extra)
        rounds = [clips[rng.permutation(len(clips))] for _ in range(-(-wanted // len(clips)))]
        places.append(np.concatenate(rounds)[:wanted] if rounds else clips[:0])
    order = np.concatenate(places)
    return order[rng.permutation(len(order))]


_SET_ORDER_SALT = 0x5_E7D1  # separates the sets' interleaved order stream from the others


def weighted_places(samples: Sequence[int], weights: Sequence[float] | None) -> list[int]:
    """data.sets' places per epoch of each set: its samples (repeats counted), or with weights the epoch's places
    (all sets' samples together) shared in proportion to the weights, the rounding by largest remainder (ties to
    the lower set number), so the places add up to the samples exactly."""
    if weights is None:
        return list(samples)
    total, whole = sum(samples), sum(weights)
    exact = [total * weight / whole for weight in weights]
    places = [int(share) for share in exact]
    by_remainder = sorted(range(len(exact)), key=lambda number: (-(exact[number] - places[number]), number))
    for number in by_remainder[: total - sum(places)]:
        places[number] += 1
    return places


def interleaved_order(sets: Sequence[int], seed: int, epoch: int, places: Sequence[int] | None = None) -> np.ndarray:
    """data.sets: the epoch's order of dataset indices with the sets spread evenly through it. Rule, from one stream
    per (seed, epoch): each set (in ascending number, so the stream is used identically) fills its places (`places`:
    one count per set number; default: each index once) with its indices in a fresh permutation, then another
    when they run out (a weighted set with more places than samples repeats them, one with fewer leaves some out);
    the j-th place of a set of n takes the position (j + 0.5) / n of the epoch; positions are sorted, a tie going
    to the lower set number. So any stretch of the order holds each set in its share to within one sample (set A
    with 4 places and set B with 12: every 4 places hold 1 of A and 3 of B), the per-epoch counts are exact, and
    the order is a pure function of (seed, epoch, sets, places), whatever the ranks or accumulation."""
    rng = np.random.default_rng([_SET_ORDER_SALT, seed, epoch])
    numbers = np.asarray(sets, dtype=np.int64)
    indices, positions, owners = [], [], []
    for number in sorted(set(numbers.tolist())):
        members = np.flatnonzero(numbers == number)
        wanted = len(members) if places is None else int(places[number])
        rounds = [members[rng.permutation(len(members))] for _ in range(-(-wanted // len(members)))]
        indices.append(np.concatenate(rounds)[:wanted] if rounds else members[:0])
        positions.append((np.arange(wanted) + 0.5) / max(wanted, 1))
        owners.append(np.full(wanted, number, dtype=np.int64))
    indices, positions, owners = (np.concatenate(parts) for parts in (indices, positions, owners))
    return indices[np.lexsort((owners, positions))]
