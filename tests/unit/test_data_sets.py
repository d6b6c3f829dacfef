"""data.sets: several datasets in one run. The spec's rules at the set's line, the index (ids, repeats), the
sampler's interleaving (exact per-epoch counts, the same global batches for any split, exact resume) and validate's
row per set. The 2-rank side (1 rank x 4 accumulation = 2 ranks x 2, resume mid-epoch) is tests/dist/test_train.py's
zero2 run."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from dstune.data.groups import interleaved_order
from dstune.data.images import ImageCaptionDataset
from dstune.data.index import index_dataset
from dstune.data.sampler import GlobalBatchSampler
from dstune.plan import make_plan
from dstune.spec.load import SpecError, SpecSource, load_spec
from dstune.spec.models import DataSetSpec, DataSpec, TrainSpec
from dstune.validate import load_and_validate
from dstune.world import world_from_flags


def write_set(root: Path, names: list[str], caption: str = "a shape") -> Path:
    from dstune.data.synthetic import render_shape

    root.mkdir(parents=True, exist_ok=True)
    for number, name in enumerate(names):
        render_shape(number, 32)[0].save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(caption)
    return root


@pytest.fixture
def two_sets(tmp_path) -> DataSpec:
    """Set `a`: 4 images, repeats 1; set `b`: 4 images, repeats 3 (regularization)."""
    a = write_set(tmp_path / "a", [f"a{i}" for i in range(4)], "sks dog")
    b = write_set(tmp_path / "b", [f"b{i}" for i in range(4)], "a dog")
    return DataSpec(
        resolution=32,
        num_workers=0,
        sets=[{"path": str(a)}, {"path": str(b), "repeats": 3, "role": "regularization", "loss_weight": 0.5}],
    )


def sampler_streams(num_sets: list[int], micro: int, accumulation: int, ranks: int, seed=7, start=(0, 0)):
    train = TrainSpec(micro_batch_size=micro, gradient_accumulation_steps=accumulation, epochs=1)
    plan = make_plan(train, world_from_flags(num_gpus=ranks), len(num_sets), SpecSource("spec.yaml"))
    return plan, [
        GlobalBatchSampler(len(num_sets), plan, rank, seed, start[0], start[1], sets=num_sets) for rank in range(ranks)
    ]


def global_batches(plan, samplers) -> list[list[int]]:
    """Each optimizer step's samples over all ranks and accumulation micro batches, in micro-batch order."""
    streams = [list(s) for s in samplers]
    accumulation = plan.gradient_accumulation_steps
    return [
        [i for k in range(accumulation) for stream in streams for i in stream[step * accumulation + k]]
        for step in range(len(streams[0]) // accumulation)
    ]


# ------------------------------------------------------------------------------------------------------ the spec


def test_the_spec_takes_sets_or_a_path_and_says_so_at_the_line(tmp_path):
    spec = tmp_path / "spec.yaml"
    body = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": {"path": "x", "sets": [{"path": "a"}, {"path": "b", "frames": 9}]},
        "train": {"micro_batch_size": 1, "max_steps": 4},
    }
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    text = str(err.value)
    assert "data.sets.1.frames" in text  # a key a set does not take is refused, not ignored
    body["data"]["sets"][1].pop("frames")
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    with pytest.raises(SpecError, match="give data.path .one dataset. or data.sets"):
        load_spec(spec)


def test_sets_are_refused_for_speech_families():
    """Video sets: tests/unit/test_video_sets.py."""
    from dstune.spec.data_checks import data_family_problem

    data = DataSpec(sets=[{"path": "a"}])
    assert "image and video families" in data_family_problem(True, "tts_lm", data)
    assert data_family_problem(False, "video", data, video=True) is None
    assert data_family_problem(False, "flow", data) is None


def test_two_sets_of_one_name_and_no_train_set_are_errors_at_their_keys(two_sets, tmp_path):
    spec = tmp_path / "spec.yaml"
    a, b = (item.path for item in two_sets.sets)
    body = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": {
            "resolution": 32,
            "sets": [{"path": a, "role": "regularization"}, {"path": b, "name": "a", "role": "regularization"}],
        },
        "train": {"micro_batch_size": 1, "max_steps": 4},
        "output": {"dir": str(tmp_path / "run")},
    }
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    with pytest.raises(SpecError) as err:
        load_and_validate(spec, world=world_from_flags(num_gpus=2), cross_check=False, check_files=False)
    found = {issue.key: issue for issue in err.value.issues}
    assert "is named 'a', as set 0 is" in found["data.sets.1.name"].message
    assert found["data.sets.1.name"].where.endswith("spec.yaml:10")  # the set's own line
    assert "no set has role train" in found["data.sets.0.role"].message


# ------------------------------------------------------------------------------------------------------ the index


def test_the_index_prefixes_each_set_and_multiplies_its_repeats(two_sets, tmp_path):
    (tmp_path / "b" / "3_more").mkdir()
    write_set(tmp_path / "b" / "3_more", ["c0"])  # a kohya repeat folder inside a set: 3 x the set's 3
    records = index_dataset(two_sets).records
    by_id = {r.sample_id: r for r in records}
    assert by_id["a/a0.png"].repeats == 1 and by_id["a/a0.png"].set_index == 0
    assert by_id["b/b0.png"].repeats == 3 and by_id["b/b0.png"].set_index == 1
    assert by_id["b/3_more/c0.png"].repeats == 9
    assert by_id["a/a0.png"].caption == "sks dog" and by_id["b/b0.png"].caption == "a dog"


def test_a_missing_set_folder_names_its_key(tmp_path):
    from dstune.data.index import DataError

    data = DataSpec(sets=[{"path": "builtin:shapes"}, {"path": str(tmp_path / "nope"), "name": "gone"}])
    with pytest.raises(DataError) as err:
        index_dataset(data)
    assert err.value.key == "data.sets.1.path" and "(gone)" in err.value.message


# ------------------------------------------------------------------------------------------------------ the order


def test_each_epoch_holds_every_set_exactly_and_every_global_batch_in_its_share(two_sets):
    dataset = ImageCaptionDataset(two_sets, index_dataset(two_sets).records, seed=7)
    sets = dataset.set_numbers()
    assert Counter(sets) == {0: 4, 1: 12}  # 4 files x 1, 4 files x 3
    plan, samplers = sampler_streams(sets, micro=1, accumulation=2, ranks=2)
    for epoch in range(3):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        batches = global_batches(plan, samplers)
        assert len(batches) == 4 and sorted(i for b in batches for i in b) == list(range(16))  # each index once
        counts = Counter(dataset.record_at(i).sample_id for b in batches for i in b)
        assert {counts[f"a/a{n}.png"] for n in range(4)} == {1} and {counts[f"b/b{n}.png"] for n in range(4)} == {3}
        assert all(Counter(sets[i] for i in b) == {0: 1, 1: 3} for b in batches)  # 1:3 in every global batch
    assert interleaved_order(sets, 7, 0).tolist() != interleaved_order(sets, 7, 1).tolist()  # reshuffled per epoch


def test_one_rank_with_four_accumulation_trains_the_same_micro_batches_as_two_ranks_with_two(two_sets):
    sets = ImageCaptionDataset(two_sets, index_dataset(two_sets).records, seed=7).set_numbers()
    one = global_batches(*sampler_streams(sets, micro=1, accumulation=4, ranks=1))
    two = global_batches(*sampler_streams(sets, micro=1, accumulation=2, ranks=2))
    assert one == two


def test_a_resume_mid_epoch_continues_the_same_interleaving(two_sets):
    sets = ImageCaptionDataset(two_sets, index_dataset(two_sets).records, seed=7).set_numbers()
    plan, samplers = sampler_streams(sets, micro=1, accumulation=2, ranks=2)
    whole = [list(s) for s in samplers]
    consumed = 3  # one whole step and a half: the half step is redone
    states = []
    for sampler in samplers:
        iter(sampler)
        sampler.record_consumed(consumed)
        states.append(sampler.state_dict())
    assert states[0]["step"] == 1 and "sets_fingerprint" in states[0]
    _, resumed = sampler_streams(sets, micro=1, accumulation=2, ranks=2)
    for sampler, state, stream in zip(resumed, states, whole):
        sampler.load_state_dict(state)
        assert list(sampler) == stream[2:]
    other = list(sets)
    other[0], other[-1] = other[-1], other[0]
    _, changed = sampler_streams(other, micro=1, accumulation=2, ranks=2)
    with pytest.raises(ValueError, match="sets_fingerprint"):
        changed[0].load_state_dict(states[0])


def test_one_set_keeps_the_one_set_order(tmp_path):
    """A single set (or data.path) draws the plain permutation: the order of runs without data.sets is unchanged."""
    plan, plain = sampler_streams([0] * 8, micro=1, accumulation=1, ranks=2)
    flat = [GlobalBatchSampler(8, plan, rank, 7) for rank in range(2)]
    assert [list(s) for s in plain] == [list(s) for s in flat]


# ------------------------------------------------------------------------------------------------------ validate


def test_validate_prints_a_row_per_set_with_its_share(two_sets, tmp_path):
    from dstune.report import plan_text

    spec = tmp_path / "spec.yaml"
    body = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": two_sets.model_dump(include={"resolution", "sets"}, exclude_none=True),
        "train": {"global_batch_size": 4, "micro_batch_size": 1, "max_steps": 4},
        "output": {"dir": str(tmp_path / "run")},
    }
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    text = plan_text(load_and_validate(spec, world=world_from_flags(num_gpus=2), cross_check=False, check_files=False))
    assert re.search(r"samples\s+16 \(counted in the 2 sets of data.sets, below\)", text)
    assert re.search(
        r"\ba\s+4 files x 1 = 4 samples per epoch \(25%; 1 of each global batch of 4\), 32 px, train", text
    )
    assert re.search(
        r"\bb\s+4 files x 3 = 12 samples per epoch \(75%; 3 of each global batch of 4\), 32 px, regul", text
    )
    assert "loss weight 0.5" in text


def test_a_preservation_set_needs_adapters_to_switch_off():
    from dstune.spec.data_checks import sets_problems

    data = DataSpec(sets=[{"path": "a"}, {"path": "b", "role": "preservation"}])
    ((key, message),) = sets_problems(data, lora=False)
    assert key == "data.sets.1.role" and "needs model.train: lora" in message
    assert sets_problems(data, lora=True) == []


def test_validate_counts_the_preservation_sets_extra_forward_in_the_memory_section(tmp_path, capsys):
    from dstune.cli import main

    spec = tmp_path / "spec.yaml"
    body = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd", "train": "lora"},
        "data": {
            "resolution": 32,
            "sets": [
                {"path": "builtin:shapes", "name": "subject"},
                {"path": "builtin:shapes", "name": "keep", "role": "preservation"},
            ],
        },
        "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 4},
        "output": {"dir": str(tmp_path / "run")},
    }
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    assert main(["validate", str(spec), "--num-gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Memory\n(.*\n)*    preservation\s+\+1 forward without gradients per micro batch holding", out)
    assert re.search(r"keep\s+256 files x 1 = 256 samples per epoch \(50%; 2 of each global batch of 4\)", out)


def test_each_set_is_cached_and_trains_from_the_cache(two_sets, tmp_path):
    """Latents and text of both sets cached (ids prefixed by the set, so files of one name in two sets are two
    entries), the empty caption too where a set drops captions; one epoch of cached batches carries each sample's
    set weight and role."""
    import torch

    from loaded_models import CACHE_DIR, start_up

    data = two_sets.model_dump(include={"resolution", "sets", "num_workers"}, exclude_none=True)
    data["sets"][0]["caption_dropout"] = 0.5
    data["cache"] = {"latents": True, "text_embeddings": True, "dir": str(tmp_path / "cache")}
    spec = tmp_path / "spec.yaml"
    body = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": data,
        "train": {"global_batch_size": 4, "micro_batch_size": 4, "max_steps": 4, "precision": "fp32"},
        "output": {"dir": str(tmp_path / "run"), "cache_dir": str(CACHE_DIR)},
    }
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    model, caches, loader = start_up(spec)
    assert len(caches.images.latent_paths) == 8 and set(caches.images.text_paths) == {"sks dog", "a dog", ""}
    seen = Counter()
    for batch in loader:
        assert "latent_mean" in batch and "encoder_hidden_states" in batch  # from the entries
        assert batch["loss_weight"].tolist() == [0.5 if p else 1.0 for p in batch["prior"].tolist()]
        assert batch["prior"].sum() == 3  # 1 of `a`, 3 of `b` in every global batch
        seen.update(batch["sample_id"])
        with torch.no_grad():
            loss = model.loss(model.trainable, model.encode_batch(batch, torch.float32), 7, 0)
        assert torch.isfinite(loss)
    assert {seen[f"a/a{i}.png"] for i in range(4)} == {1} and {seen[f"b/b{i}.png"] for i in range(4)} == {3}


# ------------------------------------------------------------------------------------------------------ weights


def weighted(two_sets: DataSpec, a: float, b: float) -> DataSpec:
    sets = [item.model_dump(exclude={"repeats"}, exclude_none=True) for item in two_sets.sets]
    sets[0]["weight"], sets[1]["weight"] = a, b
    return two_sets.model_copy(update={"sets": [DataSetSpec(**item) for item in sets]})


def test_weights_share_the_epochs_places_by_largest_remainder():
    from dstune.data.groups import weighted_places

    assert weighted_places([4, 12], None) == [4, 12]
    assert weighted_places([4, 12], [1, 1]) == [8, 8]
    assert weighted_places([5, 5], [1, 2]) == [3, 7]  # 3.33 / 6.67: the larger remainder rounds up
    assert weighted_places([1, 1, 1], [1, 1, 1]) == [1, 1, 1]
    assert sum(weighted_places([7, 3, 11], [0.2, 0.5, 0.3])) == 21


def test_weighted_sets_fill_their_places_each_epoch(two_sets, tmp_path):
    """Set `a` (4 samples) and `b` (4 files x 1: the weights replace repeats) weighted 3:1: 8 places, 6 of `a` (each
    sample once or twice), 2 of `b` (two of its four, others each epoch); every global batch of 4 holds 3 of `a`."""
    data = weighted(two_sets, 3, 1)
    dataset = ImageCaptionDataset(data, index_dataset(data).records, seed=7)
    assert len(dataset) == 8 and dataset.set_places() == [6, 2]
    sets, places = dataset.set_numbers(), dataset.set_places()
    train = TrainSpec(micro_batch_size=1, gradient_accumulation_steps=2, epochs=1)
    plan = make_plan(train, world_from_flags(num_gpus=2), 8, SpecSource("spec.yaml"))
    samplers = [GlobalBatchSampler(8, plan, rank, 7, sets=sets, set_places=places) for rank in range(2)]
    left_out = []
    for epoch in range(3):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        batches = global_batches(plan, samplers)
        counts = Counter(dataset.record_at(i).sample_id for b in batches for i in b)
        assert sum(counts[f"a/a{n}.png"] for n in range(4)) == 6 and {counts[f"a/a{n}.png"] for n in range(4)} == {1, 2}
        assert sum(counts[f"b/b{n}.png"] for n in range(4)) == 2 and max(counts[f"b/b{n}.png"] for n in range(4)) == 1
        assert all(Counter(sets[i] for i in b) == {0: 3, 1: 1} for b in batches)
        left_out.append(frozenset(n for n in range(4) if not counts[f"b/b{n}.png"]))
    assert len(set(left_out)) > 1  # a different half of `b` each epoch
    with pytest.raises(ValueError, match="sets_fingerprint"):  # other weights: another order, no resume
        other = GlobalBatchSampler(8, plan, 0, 7, sets=sets, set_places=[5, 3])
        other.load_state_dict(samplers[0].state_dict())


def test_weights_in_some_sets_only_or_with_repeats_or_buckets_are_errors_at_the_set():
    from pydantic import ValidationError

    from dstune.spec.data_checks import sets_problems

    ((key, message),) = sets_problems(DataSpec(sets=[{"path": "a"}, {"path": "b", "weight": 2}]), lora=False)
    assert key == "data.sets.1.weight" and "give `weight` in every set" in message
    with pytest.raises(ValidationError, match="not both"):
        DataSpec(sets=[{"path": "a", "weight": 1, "repeats": 2}])
    both = DataSpec(sets=[{"path": "a", "weight": 1}, {"path": "b", "weight": 2}], buckets={"enabled": True})
    assert [key for key, _ in sets_problems(both, lora=False)] == ["data.sets.0.weight"]


def test_validate_prints_the_weighted_sets_places(two_sets, tmp_path):
    from dstune.report import plan_text

    spec = tmp_path / "spec.yaml"
    data = weighted(two_sets, 3, 1).model_dump(include={"resolution", "sets"}, exclude_none=True)
    body = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": data,
        "train": {"global_batch_size": 4, "micro_batch_size": 1, "max_steps": 4},
        "output": {"dir": str(tmp_path / "run")},
    }
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    text = plan_text(load_and_validate(spec, world=world_from_flags(num_gpus=2), cross_check=False, check_files=False))
    assert re.search(r"\ba\s+4 files \(4 samples\), weight 3: 6 samples per epoch \(75%; 3 of each global batch", text)
    assert re.search(r"\bb\s+4 files \(4 samples\), weight 1: 2 samples per epoch \(25%; 1 of each global batch", text)
    assert "all sets' samples (8) as places, shared by weight" in text


def test_validate_json_gives_the_sets_rows_only_with_data_sets(two_sets, tmp_path, capsys):
    import json

    from dstune.cli import main

    spec = tmp_path / "spec.yaml"
    body = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": two_sets.model_dump(include={"resolution", "sets"}, exclude_none=True),
        "train": {"global_batch_size": 4, "micro_batch_size": 1, "max_steps": 4},
        "output": {"dir": str(tmp_path / "run")},
    }
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    assert main(["validate", str(spec), "--num-gpus", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sets"]
    assert [(r["label"], r["files"], r["repeats"], r["samples"], r["role"]) for r in rows] == [
        ("a", 4, 1, 4, "train"),
        ("b", 4, 3, 12, "regularization"),
    ]
    body["data"] = {"resolution": 32}
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    assert main(["validate", str(spec), "--num-gpus", "2", "--json"]) == 0
    assert "sets" not in json.loads(capsys.readouterr().out)  # a data.path spec's JSON is as it was


# ---------------------------------------------------------------------------------------- sizes per set


def test_sets_at_their_own_sizes_train_one_size_per_global_batch(two_sets, tmp_path):
    """Set `a` at data.resolution (32), set `b` (x3) at its own 64 and a built-in set with buckets: validate plans
    one group per size, and the loader (the one-process start-up, latents cached at each set's size) gives each
    global batch one size, a sample at its set's size."""
    import torch

    from loaded_models import CACHE_DIR, start_up

    data = two_sets.model_dump(include={"resolution", "sets", "num_workers"}, exclude_none=True)
    data["sets"][1]["resolution"] = 64
    data["sets"].append({"path": "builtin:shapes", "name": "shapes", "buckets": {"enabled": True, "step": 16}})
    data["cache"] = {"latents": True, "dir": str(tmp_path / "cache")}
    spec = tmp_path / "spec.yaml"
    body = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": data,
        "train": {"global_batch_size": 4, "micro_batch_size": 4, "max_steps": 4, "precision": "fp32"},
        "output": {"dir": str(tmp_path / "run"), "cache_dir": str(CACHE_DIR)},
    }
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    resolved = load_and_validate(spec, world=world_from_flags(num_gpus=1), cross_check=False, check_files=False)
    groups = {group.key: group.samples for group in resolved.plan.groups}
    assert groups == {"32x32": 4 + 256, "64x64": 12}  # the built-in shapes are square: the 32 px square bucket
    assert resolved.plan.steps_per_epoch == 1 + 64 + 3
    model, caches, loader = start_up(spec)
    sizes = {"a": 32, "b": 64, "shapes": 32}
    seen = Counter()
    for batch in loader:
        sets = {sample_id.split("/", 1)[0] for sample_id in batch["sample_id"]}
        side = {sizes[name] for name in sets}
        assert len(side) == 1, sets  # one size per global batch
        assert batch["latent_mean"].shape[-1] == side.pop() // 2  # tiny-sd's VAE: 2 pixels per latent
        seen.update(sample_id.split("/", 1)[0] for sample_id in batch["sample_id"])
    assert seen == {"a": 4, "b": 12, "shapes": 256}  # the whole epoch, every set at its size
    with torch.no_grad():
        assert torch.isfinite(model.loss(model.trainable, model.encode_batch(batch, torch.float32), 7, 0))


def test_a_sets_size_the_model_cannot_take_is_an_error_at_the_set(tmp_path):
    spec = tmp_path / "spec.yaml"
    body = {
        "model": {"family": "flow", "pretrained": "builtin:tiny-flow"},
        "data": {
            "resolution": 32,
            "sets": [
                {"path": "builtin:shapes", "name": "a"},
                {"path": "builtin:shapes", "name": "b", "resolution": 42},
            ],
        },
        "train": {"micro_batch_size": 1, "max_steps": 4},
        "output": {"dir": str(tmp_path / "run")},
    }
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    with pytest.raises(SpecError) as err:
        load_and_validate(spec, world=world_from_flags(num_gpus=1), cross_check=False, check_files=False)
    found = {issue.key: issue.message for issue in err.value.issues}
    assert list(found) == ["data.sets.1.resolution"] and found["data.sets.1.resolution"].startswith("42: ")


def test_the_memory_plan_counts_the_largest_set(tmp_path):
    from dstune.validate import plan_memory

    activations = []
    for side in (32, 64):
        spec = tmp_path / f"spec-{side}.yaml"
        body = {
            "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
            "data": {
                "resolution": 32,
                "sets": [
                    {"path": "builtin:shapes", "name": "a"},
                    {"path": "builtin:shapes", "name": "b", "resolution": side},
                ],
            },
            "train": {"micro_batch_size": 1, "max_steps": 4},
            "output": {"dir": str(tmp_path / "run")},
        }
        spec.write_text(yaml.safe_dump(body, sort_keys=False))
        resolved = load_and_validate(spec, world=world_from_flags(num_gpus=1), cross_check=False, check_files=False)
        memory = plan_memory(resolved.spec, resolved.plan, resolved.ds_config, accelerator="cpu")
        activations.append(memory["per_gpu"]["activations_bytes"])
    assert activations[1] > 2 * activations[0]  # 4x the pixels of the largest sample
