"""The global-epoch batch sampler: one definition of an epoch, whatever the number of ranks.

An epoch is one permutation of ALL samples, drawn from (seed, epoch) with numpy's PCG64 (`default_rng`), cut into
`steps_per_epoch` global batches (the remainder is dropped). Global batch s is cut into
`gradient_accumulation_steps x world_size` micro batches of `micro_batch_size`; rank r's k-th micro batch of that
step is micro batch number k * world_size + r. So every optimizer step trains on the same set of samples for any
split of the same global batch over ranks and accumulation, ranks never overlap, and no sample repeats in an epoch.

Position: every iteration yields the epoch set last (constructor, `set_epoch`, `load_state_dict`) from its start
step, like torch's DistributedSampler; nothing moves it implicitly, so peeking at a first batch is harmless.
`len()` is the micro batches one iteration yields. Because a DataLoader with workers runs its sampler ahead of
training, what training really used is reported separately with `record_consumed` (dstune's loader does it as it
hands out each batch); `state_dict()` is that position rounded down to a whole optimizer step: a half-accumulated
step was never applied to the weights, so it is redone on resume.

Groups (aspect buckets, length buckets): with `group_keys` (one key per dataset index), each global batch comes from
one group (dstune.data.groups.GroupedOrder: per-group permutations, whole global batches, remainders dropped, the
batches shuffled together) and is cut into micro batches exactly as above, so all of the above holds per step.

Several datasets (data.sets, `sets`: the set number of each index; `set_places`: each set's places per epoch, with
set weights): the epoch's permutation is replaced by dstune.data.groups.interleaved_order (each set permuted, then
spread evenly through the epoch), cut the same way, so every global batch (and micro batch) holds the sets in their
shares to within one sample. With groups (data.buckets)
the grouped order is used as it is: each bucket's batches mix the sets by chance.

Speaker balance (data.speaker_balance, `speakers`: one name per index): the epoch's permutation is replaced by
dstune.data.groups.speaker_balanced_order (every speaker the same number of places; small speakers repeat), cut
the same way; ranks get disjoint places of it (a clip repeats only when its speaker has fewer clips than places).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from torch.utils.data import Sampler

from dstune.data.groups import GroupedOrder, interleaved_order, keys_fingerprint, speaker_balanced_order

_ORDER_SALT = 0x0_5EED  # separates the order stream from per-sample streams built from the same seed


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro batches (lists of dataset indices) for one epoch per iteration.

    plan_like: anything with micro_batch_size, gradient_accumulation_steps, global_batch_size, world_size and
    steps_per_epoch (a dstune.plan.Plan). group_keys: None (one flat permutation per epoch), or one key per
    dataset index (every global batch then comes from one key's samples; see dstune.data.groups)."""

    def __init__(
        self,
        num_samples: int,
        plan_like,
        rank: int,
        seed: int,
        start_epoch: int = 0,
        start_step: int = 0,
        group_keys=None,
        speakers=None,
        sets=None,
        set_places=None,
    ):
        self.num_samples = num_samples
        self.micro_batch_size = plan_like.micro_batch_size
        self.accumulation = plan_like.gradient_accumulation_steps
        # the data-parallel ranks: under sequence parallelism the ranks of a group share one position (rank = the
        # data-parallel rank; dstune.distributed.Run.data_parallel_rank)
        self.world_size = getattr(plan_like, "data_parallel_size", plan_like.world_size)
        self.global_batch_size = plan_like.global_batch_size
        self.steps_per_epoch = plan_like.steps_per_epoch
        self._planned_num_samples = getattr(plan_like, "num_samples", None)  # a Plan has it; a bare plan-like may not
        self.rank = rank
        self.seed = seed
        self.grouped: GroupedOrder | None = None
        if group_keys is not None:
            if len(group_keys) != num_samples:
                raise ValueError(f"{len(group_keys)} group keys for {num_samples} samples: give one key per index")
            self.grouped = GroupedOrder(group_keys, self.global_batch_size, seed)
        self.group_fingerprint = keys_fingerprint(group_keys) if group_keys is not None else None
        self.speakers = list(speakers) if speakers is not None else None  # data.speaker_balance: one per index
        if self.speakers is not None and (group_keys is not None or len(self.speakers) != num_samples):
            raise ValueError(
                f"speaker balance needs one speaker per sample ({num_samples}; got {len(self.speakers)}) "
                "and no length groups"
            )
        self.speaker_fingerprint = keys_fingerprint(self.speakers) if self.speakers is not None else None
        # data.sets: one set number per index; a single set needs no interleaving (the one-set order is kept)
        self.sets = list(sets) if sets is not None and len(set(sets)) > 1 else None
        if self.sets is not None and (len(self.sets) != num_samples or self.speakers is not None):
            raise ValueError(f"data.sets needs one set number per sample ({num_samples}; got {len(self.sets)})")
        self.set_places = list(set_places) if self.sets is not None and set_places is not None else None
        if self.set_places is not None and sum(self.set_places) != num_samples:
            raise ValueError(f"data.sets' places {self.set_places} must add up to the {num_samples} samples")
        fingerprinted = None if self.sets is None else self.sets + ["places"] + (self.set_places or [])
        self.sets_fingerprint = keys_fingerprint(fingerprinted) if fingerprinted is not None else None
        self._check_plan()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the plan's {self.world_size} ranks (0..{self.world_size - 1})")
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._set_position(start_epoch, start_step)

    def _check_plan(self) -> None:
        planned = self._planned_num_samples
        if planned is not None and planned != self.num_samples:
            raise ValueError(
                f"the plan was made for {planned} samples but the dataset has {self.num_samples} (were "
                "files skipped after planning?). Plan on the final sample count."
            )
        per_step = self.micro_batch_size * self.accumulation * self.world_size
        if per_step != self.global_batch_size:
            raise ValueError(
                f"plan global batch {self.global_batch_size} != micro {self.micro_batch_size} x accumulation "
                f"{self.accumulation} x {self.world_size} ranks = {per_step}"
            )
        if self.grouped is not None:
            if self.grouped.steps_per_epoch != self.steps_per_epoch or self.steps_per_epoch < 1:
                raise ValueError(
                    f"the plan has {self.steps_per_epoch} steps per epoch, but the {len(self.grouped.groups)} groups "
                    f"make {self.grouped.steps_per_epoch} whole global batches of {self.global_batch_size}: the plan "
                    "was made for other groups (were images changed after planning?). Plan on the final groups."
                )
        elif self.num_samples // self.global_batch_size != self.steps_per_epoch or self.steps_per_epoch < 1:
            raise ValueError(
                f"the plan has {self.steps_per_epoch} steps per epoch, but {self.num_samples} samples make "
                f"{self.num_samples // self.global_batch_size} global batches of {self.global_batch_size}: the plan was "
                "made for a different dataset size (were files skipped after planning?). Plan on the final sample count."
            )

    # ------------------------------------------------------------------------------------------ position

    def _set_position(self, epoch: int, step: int) -> None:
        if epoch < 0 or not 0 <= step <= self.steps_per_epoch:
            raise ValueError(
                f"position epoch {epoch}, step {step} is outside 0..{self.steps_per_epoch} steps per epoch"
            )
        if step == self.steps_per_epoch:  # a finished epoch is the start of the next one
            epoch, step = epoch + 1, 0
        self._epoch = epoch
        self._start_step = step  # where iterations start
        self._consumed = 0  # micro batches training has used since the last iteration started

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def start_step(self) -> int:
        return self._start_step

    def set_epoch(self, epoch: int, start_step: int | None = None) -> None:
        """Iterations now yield `epoch` from `start_step`. Without start_step: from 0 for a new epoch, and no change
        when `epoch` is the current one, so `for epoch in range(start_epoch, ...): sampler.set_epoch(epoch)` keeps
        the resume step it was built with."""
        if start_step is not None:
            self._set_position(epoch, start_step)
        elif epoch != self._epoch:
            self._set_position(epoch, 0)

    def record_consumed(self, micro_batches: int = 1) -> None:
        """Training used this many more micro batches of the current iteration (for `state_dict`)."""
        if self._consumed + micro_batches > len(self):
            raise ValueError(
                f"{self._consumed + micro_batches} micro batches consumed, but the iteration from epoch "
                f"{self._epoch} step {self._start_step} has {len(self)}"
            )
        self._consumed += micro_batches

    def position(self) -> tuple[int, int]:
        """(epoch, step) of the next optimizer step to train, from what training consumed; a finished epoch
        counts as the start of the next one."""
        step = self._start_step + self._consumed // self.accumulation
        return (self._epoch + 1, 0) if step == self.steps_per_epoch else (self._epoch, step)

    def state_dict(self) -> dict:
        epoch, step = self.position()
        state = {
            "epoch": epoch,
            "step": step,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
        }
        if self.group_fingerprint is not None:
            state["group_fingerprint"] = self.group_fingerprint
        if self.speaker_fingerprint is not None:
            state["speaker_fingerprint"] = self.speaker_fingerprint
        if self.sets_fingerprint is not None:
            state["sets_fingerprint"] = self.sets_fingerprint
        return state

    def load_state_dict(self, state: dict) -> None:
        state = {"group_fingerprint": None, "speaker_fingerprint": None, "sets_fingerprint": None, **state}  # older
        for key in (
            "seed",
            "num_samples",
            "global_batch_size",
            "group_fingerprint",
            "speaker_fingerprint",
            "sets_fingerprint",
        ):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data order was made with {key} {state[key]}, this run has {getattr(self, key)}: "
                    "resuming would replay a different sample order. Restore the original value or start a new run."
                )
        self._set_position(int(state["epoch"]), int(state["step"]))

    # ------------------------------------------------------------------------------------------ order

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of all sample indices for `epoch` (the same on every rank)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.speakers is not None:
                order = speaker_balanced_order(self.speakers, self.seed, epoch)
            elif self.sets is not None:
                order = interleaved_order(self.sets, self.seed, epoch, self.set_places)
            else:
                order = np.random.default_rng([_ORDER_SALT, self.seed, epoch]).permutation(self.num_samples)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _global_batch(self, epoch: int, step: int) -> np.ndarray:
        if self.grouped is not None:
            return self.grouped.global_batch(epoch, step)[1]
        start = step * self.global_batch_size
        return self.epoch_order(epoch)[start : start + self.global_batch_size]

    def step_indices(self, epoch: int, step: int) -> list[int]:
        """All samples of global batch `step` of `epoch`, over all ranks and accumulation micro batches."""
        return self._global_batch(epoch, step).tolist()

    def step_group(self, epoch: int, step: int):
        """The group key of global batch `step` of `epoch` (None without groups)."""
        return None if self.grouped is None else self.grouped.global_batch(epoch, step)[0]

    def micro_batch(self, epoch: int, step: int, k: int) -> list[int]:
        """This rank's k-th micro batch (0 <= k < accumulation) of global batch `step`."""
        start = (k * self.world_size + self.rank) * self.micro_batch_size
        return self._global_batch(epoch, step)[start : start + self.micro_batch_size].tolist()

    def __len__(self) -> int:
        """Micro batches the next iteration yields: the rest of the current epoch from its current step."""
        return (self.steps_per_epoch - self._start_step) * self.accumulation

    def __iter__(self) -> Iterator[list[int]]:
        self._consumed = 0  # a new iteration replays from the start position; consumption counts from here
        return self._iterate(self._epoch, self._start_step)

    def _iterate(self, epoch: int, first_step: int) -> Iterator[list[int]]:
        for step in range(first_step, self.steps_per_epoch):
            for k in range(self.accumulation):
                yield self.micro_batch(epoch, step, k)
