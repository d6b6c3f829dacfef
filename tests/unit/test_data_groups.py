"""Grouped batching (dstune.data.groups + GlobalBatchSampler(group_keys=...)): every global batch from one group,
deterministic in (seed, epoch), the same samples per step for any split over ranks and accumulation, exact resume.

All ranks are simulated in one process: each rank's sampler is built exactly as that rank would build it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstune.data.groups import GroupedOrder, group_batches, group_counts, key_label
from dstune.data.sampler import GlobalBatchSampler


def grouped_plan(keys, micro, accum, world):
    """A plan-like for `keys`, with the grouped steps per epoch (what dstune.plan computes)."""
    global_batch = micro * accum * world
    steps = sum(row.steps for row in group_batches(group_counts(keys), global_batch))
    return SimpleNamespace(
        micro_batch_size=micro,
        gradient_accumulation_steps=accum,
        world_size=world,
        global_batch_size=global_batch,
        steps_per_epoch=steps,
        num_samples=len(keys),
    )


def samplers(keys, plan, seed=0, epoch=0, step=0):
    return [
        GlobalBatchSampler(len(keys), plan, rank, seed, epoch, step, group_keys=keys) for rank in range(plan.world_size)
    ]


def per_step(keys, plan, seed=0, epoch=0):
    """[(sorted samples of the step over all ranks and micro batches, {keys in the step})] for one epoch."""
    streams = [list(s) for s in samplers(keys, plan, seed, epoch)]
    accum, out = plan.gradient_accumulation_steps, []
    for step in range(plan.steps_per_epoch):
        samples = [i for stream in streams for micro in stream[step * accum : (step + 1) * accum] for i in micro]
        out.append((sorted(samples), {keys[i] for i in samples}))
    return out


# keys like a small image set: three buckets of different sizes, in a scrambled order
KEYS = [(24, 40), (32, 32), (40, 24), (40, 24), (32, 32), (40, 24)] * 7 + [(32, 32)] * 3


def test_every_step_comes_from_one_group_and_no_sample_repeats():
    plan = grouped_plan(KEYS, micro=2, accum=1, world=2)
    steps = per_step(KEYS, plan, seed=3)
    counts = group_counts(KEYS)  # {(24,40): 7, (32,32): 17, (40,24): 21}
    assert counts == {(24, 40): 7, (32, 32): 17, (40, 24): 21}
    assert plan.steps_per_epoch == 7 // 4 + 17 // 4 + 21 // 4 == 10
    assert all(len(group) == 1 for _, group in steps)
    used = [i for samples, _ in steps for i in samples]
    assert len(used) == len(set(used)) == 40  # 45 samples, remainders 3 + 1 + 1 dropped
    per_group = {key: sum(1 for _, g in steps if g == {key}) for key in counts}
    assert per_group == {(24, 40): 1, (32, 32): 4, (40, 24): 5}


def test_groups_interleave_and_the_order_depends_only_on_seed_and_epoch():
    plan = grouped_plan(KEYS, micro=2, accum=1, world=2)
    order = GroupedOrder(KEYS, plan.global_batch_size, seed=3)
    assert order.step_keys(0) == GroupedOrder(KEYS, plan.global_batch_size, seed=3).step_keys(0)
    sequences = {tuple(map(tuple, (order.global_batch(e, s)[1] for s in range(10)))) for e in range(4)}
    assert len(sequences) == 4  # every epoch is a different order
    assert order.step_keys(0) != sorted(order.step_keys(0))  # not one group after the other
    other_seed = GroupedOrder(KEYS, plan.global_batch_size, seed=4)
    assert [b.tolist() for b in (other_seed.global_batch(0, s)[1] for s in range(10))] != [
        b.tolist() for b in (order.global_batch(0, s)[1] for s in range(10))
    ]


def test_one_rank_with_two_accumulation_steps_sees_what_two_ranks_see():
    """The split invariance the brief asks for: 1 rank x 2 accumulation == 2 ranks x 1, step by step."""
    one_rank = per_step(KEYS, grouped_plan(KEYS, micro=2, accum=2, world=1), seed=9, epoch=2)
    two_ranks = per_step(KEYS, grouped_plan(KEYS, micro=2, accum=1, world=2), seed=9, epoch=2)
    four_ranks = per_step(KEYS, grouped_plan(KEYS, micro=1, accum=1, world=4), seed=9, epoch=2)
    assert one_rank == two_ranks == four_ranks


@settings(max_examples=40, deadline=None)
@given(
    keys=st.lists(st.sampled_from(["short", "mid", "long"]), min_size=12, max_size=60),
    micro=st.integers(1, 3),
    accum=st.integers(1, 2),
    world=st.integers(1, 3),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 3),
    data=st.data(),
)
def test_any_split_any_keys_resume_anywhere(keys, micro, accum, world, seed, epoch, data):
    """String keys (as an audio length bucket would be): invariants for any split, and a resumed sampler yields
    exactly the tail of the uninterrupted epoch on every rank."""
    plan = grouped_plan(keys, micro, accum, world)
    if plan.steps_per_epoch == 0:
        return
    steps = per_step(keys, plan, seed, epoch)
    assert all(len(group) == 1 for _, group in steps)
    flat = grouped_plan(keys, micro * accum * world, 1, 1)
    assert steps == per_step(keys, flat, seed, epoch)  # one rank, one micro batch per step: the same samples
    start = data.draw(st.integers(0, plan.steps_per_epoch))
    for full, resumed in zip(samplers(keys, plan, seed, epoch), samplers(keys, plan, seed, epoch, start)):
        tail = (
            list(full)[start * accum :]
            if start < plan.steps_per_epoch
            else list(GlobalBatchSampler(len(keys), plan, full.rank, seed, epoch + 1, group_keys=keys))
        )
        assert list(resumed) == tail


def test_state_dict_refuses_other_groups_and_keeps_ungrouped_states_loadable():
    plan = grouped_plan(KEYS, micro=2, accum=1, world=2)
    sampler = GlobalBatchSampler(len(KEYS), plan, 0, 5, 1, 2, group_keys=KEYS)
    state = sampler.state_dict()
    assert state["epoch"] == 1 and state["step"] == 2 and len(state["group_fingerprint"]) == 16
    again = GlobalBatchSampler(len(KEYS), plan, 1, 5, group_keys=KEYS)
    again.load_state_dict(state)
    assert (again.epoch, again.start_step) == (1, 2)
    moved = list(KEYS)
    moved[0], moved[1] = moved[1], moved[0]  # same counts, one image in another bucket
    other = GlobalBatchSampler(len(KEYS), plan, 0, 5, group_keys=moved)
    with pytest.raises(ValueError, match="group_fingerprint"):
        other.load_state_dict(state)
    flat_plan = SimpleNamespace(**{**vars(plan), "steps_per_epoch": len(KEYS) // 4})
    flat = GlobalBatchSampler(len(KEYS), flat_plan, 0, 5)
    assert "group_fingerprint" not in flat.state_dict()
    with pytest.raises(ValueError, match="group_fingerprint"):
        flat.load_state_dict(state)  # a grouped checkpoint does not resume an ungrouped run


def test_a_plan_made_for_other_groups_is_refused():
    plan = grouped_plan(KEYS, micro=2, accum=1, world=2)
    wrong = SimpleNamespace(**{**vars(plan), "steps_per_epoch": plan.steps_per_epoch + 1})
    with pytest.raises(ValueError, match="plan was made for other groups"):
        GlobalBatchSampler(len(KEYS), wrong, 0, 0, group_keys=KEYS)
    with pytest.raises(ValueError, match="one key per index"):
        GlobalBatchSampler(len(KEYS), plan, 0, 0, group_keys=KEYS[:-1])


def test_labels_and_group_rows():
    assert key_label((40, 24)) == "40x24" and key_label("long") == "long" and key_label(3) == "3"
    rows = group_batches({"a": 9, "b": 3}, 4)
    assert [(r.key, r.samples, r.steps, r.dropped) for r in rows] == [("a", 9, 2, 1), ("b", 3, 0, 3)]
