"""data.speaker_balance: every epoch gives each speaker the same number of places, drawn from the seed alone (the
same on every rank), cut into disjoint rank shares by the global-epoch sampler; refused where there is nothing to
balance (no speakers) or with length groups."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dstune.data.groups import speaker_balanced_order
from dstune.data.sampler import GlobalBatchSampler

# 3 speakers with 60, 15 and 5 clips: a plain permutation gives them 75%, 19% and 6% of an epoch
SPEAKERS = ["ann"] * 60 + ["bob"] * 15 + ["cy"] * 5


class PlanLike:
    micro_batch_size, gradient_accumulation_steps, world_size, num_samples = 4, 2, 2, len(SPEAKERS)
    global_batch_size = 16
    steps_per_epoch = len(SPEAKERS) // 16


def test_each_speaker_fills_an_equal_share_of_every_epoch():
    for epoch in range(3):
        order = speaker_balanced_order(SPEAKERS, seed=7, epoch=epoch)
        assert len(order) == len(SPEAKERS)
        shares = Counter(SPEAKERS[i] for i in order)
        assert sorted(shares.values()) == [26, 27, 27]  # 80 places: 26 each, the 2 left over to two speakers
        cy = [i for i in order if SPEAKERS[i] == "cy"]
        assert set(cy) == set(range(75, 80))  # the small speaker repeats: every clip, about 5 times each
        assert max(Counter(cy).values()) - min(Counter(cy).values()) <= 1
        ann = [i for i in order if SPEAKERS[i] == "ann"]
        assert len(set(ann)) == len(ann)  # the large one never repeats, it leaves clips out


def test_the_order_is_a_function_of_seed_and_epoch():
    same = speaker_balanced_order(SPEAKERS, seed=7, epoch=1)
    assert np.array_equal(same, speaker_balanced_order(list(SPEAKERS), seed=7, epoch=1))
    assert not np.array_equal(same, speaker_balanced_order(SPEAKERS, seed=8, epoch=1))
    assert not np.array_equal(same, speaker_balanced_order(SPEAKERS, seed=7, epoch=2))


def test_ranks_take_disjoint_places_of_the_same_balanced_steps():
    plan = PlanLike()
    samplers = [GlobalBatchSampler(len(SPEAKERS), plan, rank, seed=3, speakers=SPEAKERS) for rank in range(2)]
    order = speaker_balanced_order(SPEAKERS, seed=3, epoch=0)
    streams = [list(s) for s in samplers]
    per_step = plan.gradient_accumulation_steps
    for step in range(plan.steps_per_epoch):
        mine = [streams[r][step * per_step + k] for r in range(2) for k in range(per_step)]
        places = sorted(x for batch in mine for x in batch)
        assert places == sorted(order[step * 16 : (step + 1) * 16].tolist())  # the step's places, each taken once
        assert all(samplers[0].step_indices(0, step) == s.step_indices(0, step) for s in samplers)
    used = Counter(SPEAKERS[i] for stream in streams for batch in stream for i in batch)
    assert max(used.values()) - min(used.values()) <= 6  # 64 places of 80: balanced, unlike 48/12/4
    assert samplers[0].state_dict()["speaker_fingerprint"]
    plain = GlobalBatchSampler(len(SPEAKERS), plan, 0, seed=3)
    with pytest.raises(ValueError, match="speaker_fingerprint"):
        plain.load_state_dict(samplers[0].state_dict())


def test_validate_refuses_balance_without_speakers_naming_the_key(tmp_path):
    from dstune.validate import ResolveError, load_and_validate
    from dstune.world import world_from_flags

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: {family: tts_lm}\n"
        "data: {path: 'builtin:tones', max_clip_seconds: 0.6, speaker_balance: true}\n"
        "train: {global_batch_size: 8, micro_batch_size: 4, max_steps: 3}\n"
    )
    with pytest.raises(ResolveError) as refused:
        load_and_validate(str(spec), world=world_from_flags(world_size=2), cross_check=False)
    assert "data.speaker_balance" in str(refused.value) and "names no speaker" in str(refused.value)


def test_balance_and_length_groups_are_refused_together(tmp_path):
    from dstune.spec.load import SpecError, load_spec

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: {family: tts_lm}\ndata: {path: 'builtin:tones', speaker_balance: true, "
        "duration_bucket_seconds: 0.25}\ntrain: {micro_batch_size: 1, max_steps: 1}\n"
    )
    with pytest.raises(SpecError, match="speaker_balance and data.duration_bucket_seconds"):
        load_spec(str(spec), [])


def test_a_gptsovits_list_validates_and_gives_one_speaker_per_index(tmp_path):
    """The positive path: a .list naming speakers passes validate, and the loader's speakers (speaker_keys, repeats
    expanded) fit the plan's sample count."""
    import soundfile

    from dstune.data.audio_index import index_audio, speaker_keys
    from dstune.data.synthetic import render_tones
    from dstune.spec.models import DataSpec
    from dstune.validate import load_and_validate
    from dstune.world import world_from_flags

    (tmp_path / "wavs").mkdir()
    lines = []
    for number in range(12):
        soundfile.write(tmp_path / "wavs" / f"{number}.wav", render_tones(str(10 + number)), 16000)
        lines.append(f"wavs/{number}.wav|{'ann' if number < 9 else 'bob'}|en|{10 + number}")
    (tmp_path / "metadata.list").write_text("\n".join(lines) + "\n")
    spec = tmp_path / "spec.yaml"
    # a tts_lm layout that names the voice (orpheus): dstune's own layout refuses several speakers
    spec.write_text(
        f"model: {{family: tts_lm, pretrained: 'builtin:tiny-orpheus', codec: snac}}\n"
        f"data: {{path: '{tmp_path}', speaker_balance: true}}\n"
        "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 3}\n"
    )
    resolved = load_and_validate(str(spec), world=world_from_flags(world_size=2), cross_check=False)
    records = index_audio(resolved.spec.data).records
    speakers = speaker_keys(records, resolved.spec.data)
    assert len(speakers) == resolved.num_samples == 12 and Counter(speakers) == {"ann": 9, "bob": 3}
    assert speaker_keys(records, DataSpec(path=str(tmp_path))) is None
    order = speaker_balanced_order(speakers, seed=0, epoch=0)
    assert Counter(speakers[i] for i in order) == {"ann": 6, "bob": 6}
