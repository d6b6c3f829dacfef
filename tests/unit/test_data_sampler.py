"""GlobalBatchSampler: the same samples per optimizer step for any split over ranks, exact epochs, exact resume.

All ranks are simulated in one process: each rank's sampler is built exactly as that rank would build it."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstune.data.sampler import GlobalBatchSampler
from dstune.plan import make_plan
from dstune.spec.load import SpecSource
from dstune.spec.models import TrainSpec


@dataclass(frozen=True)
class PlanLike:
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    num_samples: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def micro_batches_per_epoch_per_rank(self) -> int:
        return self.steps_per_epoch * self.gradient_accumulation_steps


def rank_streams(plan, seed=0, start_epoch=0, start_step=0):
    """Every rank's micro batches for one epoch: {rank: [micro batch, ...]}."""
    return {
        rank: list(GlobalBatchSampler(plan.num_samples, plan, rank, seed, start_epoch, start_step))
        for rank in range(plan.world_size)
    }


def per_step_sets(plan, seed=0, epoch=0):
    """The multiset of samples each optimizer step trains on, over all ranks, as sorted lists."""
    streams = rank_streams(plan, seed, epoch)
    accum = plan.gradient_accumulation_steps
    steps = []
    for step in range(plan.steps_per_epoch):
        samples = [i for rank in streams for micro in streams[rank][step * accum : (step + 1) * accum] for i in micro]
        steps.append(sorted(samples))
    return steps


configs = st.builds(
    lambda micro, accum, world, extra_batches, remainder: PlanLike(
        micro, accum, world, micro * accum * world * (1 + extra_batches) + remainder
    ),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(0, 7),
)


@settings(max_examples=60, deadline=None)
@given(plan=configs, seed=st.integers(0, 2**32), epoch=st.integers(0, 5))
def test_an_epoch_uses_each_sample_at_most_once_and_ranks_are_disjoint(plan, seed, epoch):
    streams = rank_streams(plan, seed, epoch)
    used = [i for stream in streams.values() for micro in stream for i in micro]
    assert len(used) == len(set(used)) == plan.steps_per_epoch * plan.global_batch_size
    assert set(used) <= set(range(plan.num_samples))
    for stream in streams.values():
        assert len(stream) == plan.micro_batches_per_epoch_per_rank
        assert all(len(micro) == plan.micro_batch_size for micro in stream)
    per_rank = [{i for micro in stream for i in micro} for stream in streams.values()]
    assert sum(map(len, per_rank)) == len(set().union(*per_rank))
    sampler = GlobalBatchSampler(plan.num_samples, plan, 0, seed, epoch)
    assert len(sampler) == plan.micro_batches_per_epoch_per_rank
    m, world = plan.micro_batch_size, plan.world_size
    for rank, stream in streams.items():  # the documented layout: micro batch number k * world_size + rank
        for position, micro in enumerate(stream):
            step, k = divmod(position, plan.gradient_accumulation_steps)
            number = k * world + rank
            assert micro == sampler.step_indices(epoch, step)[number * m : (number + 1) * m]
    assert per_step_sets(plan, seed, epoch) == [
        sorted(sampler.step_indices(epoch, s)) for s in range(plan.steps_per_epoch)
    ]


def splits_of(per_step_micro_batches):
    return [
        (accum, per_step_micro_batches // accum)
        for accum in range(1, per_step_micro_batches + 1)
        if per_step_micro_batches % accum == 0
    ]


@settings(max_examples=40, deadline=None)
@given(
    micro=st.integers(1, 3),
    per_step=st.sampled_from([1, 2, 4, 6, 8]),
    batches=st.integers(1, 4),
    remainder=st.integers(0, 5),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 3),
)
def test_every_step_trains_on_the_same_samples_for_any_split(micro, per_step, batches, remainder, seed, epoch):
    num_samples = micro * per_step * batches + remainder
    results = {
        (accum, world): per_step_sets(PlanLike(micro, accum, world, num_samples), seed, epoch)
        for accum, world in splits_of(per_step)
    }
    reference = results[(per_step, 1)]  # one rank accumulating everything
    assert all(steps == reference for steps in results.values()), results.keys()


def test_the_brief_example_1x4_2x2_4x1():
    results = [per_step_sets(PlanLike(2, accum, world, 50), seed=7) for accum, world in [(4, 1), (2, 2), (1, 4)]]
    assert results[0] == results[1] == results[2]
    assert len(results[0]) == 50 // 8


@settings(max_examples=40, deadline=None)
@given(plan=configs, seed=st.integers(0, 1000), epoch=st.integers(0, 3), data=st.data())
def test_resume_yields_exactly_the_tail(plan, seed, epoch, data):
    start_step = data.draw(st.integers(0, plan.steps_per_epoch - 1))
    rank = data.draw(st.integers(0, plan.world_size - 1))
    full = list(GlobalBatchSampler(plan.num_samples, plan, rank, seed, epoch))
    resumed = GlobalBatchSampler(plan.num_samples, plan, rank, seed, epoch, start_step)
    assert list(resumed) == full[start_step * plan.gradient_accumulation_steps :]
    assert len(resumed) == (plan.steps_per_epoch - start_step) * plan.gradient_accumulation_steps
    resumed.set_epoch(epoch)  # the usual loop calls this for the start epoch: it must keep the position
    assert list(resumed) == full[start_step * plan.gradient_accumulation_steps :]
    resumed.set_epoch(epoch, start_step=start_step)
    assert list(resumed) == full[start_step * plan.gradient_accumulation_steps :]
    resumed.set_epoch(epoch + 1)
    assert list(resumed) == list(GlobalBatchSampler(plan.num_samples, plan, rank, seed, epoch + 1))


def test_epochs_and_seeds_change_the_order():
    plan = PlanLike(4, 1, 1, 64)
    orders = {
        (seed, epoch): tuple(GlobalBatchSampler(64, plan, 0, seed).epoch_order(epoch).tolist())
        for seed in (0, 1)
        for epoch in (0, 1, 2)
    }
    assert len(set(orders.values())) == len(orders)
    assert sorted(orders[(0, 0)]) == list(range(64))


def test_consumption_gives_the_checkpoint_position_in_whole_steps():
    plan = PlanLike(2, 3, 2, 40)  # global 12, 3 steps per epoch, 9 micro batches per epoch per rank
    sampler = GlobalBatchSampler(40, plan, 1, seed=3)
    first_pass = list(sampler)
    sampler.record_consumed(4)  # one full step and one micro batch of the next
    assert sampler.state_dict() == {"epoch": 0, "step": 1, "seed": 3, "num_samples": 40, "global_batch_size": 12}
    assert len(sampler) == 9 and list(sampler) == first_pass  # consumption never moves what iterations yield
    assert sampler.position() == (0, 0)  # a new iteration restarted the count
    sampler.record_consumed(9)
    assert sampler.position() == (1, 0)  # a finished epoch is the start of the next one
    with pytest.raises(ValueError, match="micro batches consumed"):
        sampler.record_consumed(1)
    sampler.set_epoch(0)  # the current epoch: no change
    assert (sampler.epoch, sampler.start_step, len(sampler)) == (0, 0, 9)
    sampler.set_epoch(2, start_step=2)  # the training loop's explicit form
    assert (sampler.epoch, sampler.start_step, len(sampler)) == (2, 2, 3)
    assert list(sampler) == [sampler.micro_batch(2, 2, k) for k in range(3)]
    sampler.set_epoch(3)
    assert (sampler.epoch, sampler.start_step, len(sampler)) == (3, 0, 9)


def test_state_dict_round_trip_and_mismatches():
    plan = PlanLike(2, 2, 2, 40)
    first = GlobalBatchSampler(40, plan, 0, seed=5, start_epoch=2, start_step=1)
    state = first.state_dict()
    # A different split of the same global batch resumes the same samples (world size is not part of the order).
    other_split = PlanLike(4, 2, 1, 40)
    second = GlobalBatchSampler(40, other_split, 0, seed=5)
    second.load_state_dict(state)
    assert (second.epoch, second.start_step, second.position()) == (2, 1, (2, 1))
    first_micro, second_micro = list(second)[:2]  # one rank, accumulation 2: the first resumed step
    assert sorted(first_micro + second_micro) == sorted(first.step_indices(2, 1))
    for key, value in [("seed", 6), ("num_samples", 41), ("global_batch_size", 16)]:
        with pytest.raises(ValueError, match=key):
            second.load_state_dict({**state, key: value})
    end_of_epoch = GlobalBatchSampler(40, plan, 0, seed=5, start_epoch=2, start_step=plan.steps_per_epoch)
    assert (end_of_epoch.epoch, end_of_epoch.start_step) == (3, 0)


def test_inconsistent_plans_and_ranks_are_refused():
    with pytest.raises(ValueError, match="made for 40 samples but the dataset has 39"):
        GlobalBatchSampler(39, PlanLike(2, 2, 2, 40), 0, 0)
    no_count = SimpleNamespace(
        micro_batch_size=2, gradient_accumulation_steps=2, world_size=2, global_batch_size=8, steps_per_epoch=5
    )
    with pytest.raises(ValueError, match="different dataset size"):
        GlobalBatchSampler(39, no_count, 0, 0)  # 39 samples make 4 steps, the plan says 5
    bad_triad = SimpleNamespace(
        micro_batch_size=2, gradient_accumulation_steps=2, world_size=2, global_batch_size=16, steps_per_epoch=2
    )
    with pytest.raises(ValueError, match="!= micro 2"):
        GlobalBatchSampler(40, bad_triad, 0, 0)
    with pytest.raises(ValueError, match="rank 2"):
        GlobalBatchSampler(40, PlanLike(2, 2, 2, 40), 2, 0)
    with pytest.raises(ValueError, match="outside"):
        GlobalBatchSampler(40, PlanLike(2, 2, 2, 40), 0, 0, start_step=6)


def test_works_with_a_real_plan():
    world = SimpleNamespace(world_size=3, num_nodes=1, ranks_per_node=(3,))
    train = TrainSpec(global_batch_size=12, micro_batch_size=2, epochs=2)
    plan = make_plan(train, world, num_samples=100, source=SpecSource("spec.yaml"))
    samplers = [GlobalBatchSampler(100, plan, rank, seed=0) for rank in range(3)]
    assert all(len(s) == plan.micro_batches_per_epoch_per_rank == 16 for s in samplers)
    used = [i for s in samplers for micro in s for i in micro]
    assert len(used) == len(set(used)) == plan.samples_per_epoch == 96
