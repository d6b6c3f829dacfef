"""data.eval: which samples are held out (and never train), how validate counts them, and the held-out loss itself on
the real tiny SD model: fixed draws (the same value at every evaluation) and the same number for any world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from dstune.data.index import DataError, SampleRecord, held_out_split, index_dataset
from dstune.evaluation import batch_losses, combine, eval_batches, make_held_out, rank_share
from dstune.spec.load import SpecError
from dstune.spec.models import DataSpec
from loaded_models import CACHE_DIR


def _records(count: int) -> list[SampleRecord]:
    return [SampleRecord(f"img{i:03d}.png", None, f"caption {i}", repeats=3) for i in range(count)]


def test_a_fraction_holds_out_that_share_of_the_images_once_each_and_never_trains_them():
    records = _records(40)
    training, held_out = held_out_split(records, 0.1)
    assert len(held_out) == 4 and len(training) == 36
    assert {r.sample_id for r in training}.isdisjoint(r.sample_id for r in held_out)
    assert {r.sample_id for r in training} | {r.sample_id for r in held_out} == {r.sample_id for r in records}
    assert all(r.repeats == 1 for r in held_out) and all(r.repeats == 3 for r in training)
    assert held_out_split(list(reversed(records)), 0.1)[1] == list(reversed(held_out))  # by id, not by position
    assert len(held_out_split(records, 0.001)[1]) == 1  # at least one


def test_a_fraction_of_a_one_image_dataset_is_refused_with_the_alternative():
    with pytest.raises(DataError) as err:
        held_out_split(_records(1), 0.5)
    assert err.value.key == "data.eval.fraction" and "data.eval.path" in err.value.message


def test_index_dataset_trains_on_what_is_left_and_lists_the_held_out_samples():
    plain = index_dataset(DataSpec())
    split = index_dataset(DataSpec(eval={"fraction": 0.1}))
    assert plain.held_out == [] and split.num_samples == plain.num_samples - len(split.held_out)
    assert len(split.held_out) == round(0.1 * plain.num_samples)
    assert {r.sample_id for r in split.records}.isdisjoint(r.sample_id for r in split.held_out)


def test_a_held_out_folder_is_indexed_in_the_same_layout_and_a_missing_one_names_its_key(tmp_path):
    from dstune.data.synthetic import render_shape

    folder = tmp_path / "held"
    folder.mkdir()
    for number in range(3):
        image, caption = render_shape(number, 32)
        image.save(folder / f"{number}.png")
        (folder / f"{number}.txt").write_text(caption)
    result = index_dataset(DataSpec(eval={"path": str(folder)}))
    assert result.num_samples == index_dataset(DataSpec()).num_samples  # data.path trains whole
    assert [r.sample_id for r in result.held_out] == ["0.png", "1.png", "2.png"]
    with pytest.raises(DataError) as err:
        index_dataset(DataSpec(eval={"path": str(tmp_path / "nope")}))
    assert err.value.key == "data.eval.path"


@pytest.mark.parametrize("section", [{}, {"path": "x", "fraction": 0.1}])
def test_data_eval_needs_exactly_one_source(section):
    with pytest.raises(ValueError, match="exactly one of `path`"):
        DataSpec(eval=section)


def _spec_file(tmp_path: Path, **changes) -> Path:
    spec = {
        "model": {"family": "sd", "pretrained": "builtin:tiny-sd"},
        "data": {"path": "builtin:shapes", "eval": {"fraction": 0.25, "every_steps": 5}},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 10},
    }
    for section, values in changes.items():
        spec[section].update(values)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_validate_plans_on_the_training_samples_and_says_how_many_are_held_out(tmp_path):
    from dstune.report import plan_text
    from dstune.validate import load_and_validate
    from dstune.world import world_from_flags

    resolved = load_and_validate(_spec_file(tmp_path), world=world_from_flags(num_gpus=2), accelerator="cpu")
    assert resolved.num_samples == 256 - 64
    assert "64 held out for data.eval (0.25 of the images), never trained on" in plan_text(resolved)


def test_validate_refuses_data_eval_for_speech_families_with_the_reason(tmp_path):
    from dstune.validate import load_and_validate

    path = _spec_file(
        tmp_path, model={"family": "tts_lm", "pretrained": "builtin:tiny-tts-lm"}, data={"path": "builtin:tones"}
    )
    with pytest.raises(SpecError, match="held-out loss is computed for the image families"):
        load_and_validate(path, accelerator="cpu")


def test_output_wandb_without_the_package_is_refused_before_training(tmp_path):
    from dstune.trackers import wandb_missing
    from dstune.validate import load_and_validate

    if wandb_missing() is None:
        pytest.skip("wandb is installed here")
    path = _spec_file(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["output"] = {"wandb": True}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError) as err:
        load_and_validate(path, accelerator="cpu")
    assert "output.wandb" in str(err.value) and "pip install wandb" in str(err.value)


def test_fixed_batches_cover_every_sample_once_per_bucket_and_every_rank_runs_as_many_forwards():
    keys = ["a", "b", "a", "a", "b", "a", "c"]
    batches = eval_batches(keys, len(keys), 2)
    assert batches == [[0, 2], [3, 5], [1, 4], [6]]
    for world in (1, 2, 3, 5):
        shares = [rank_share(batches, rank, world) for rank in range(world)]
        assert len({len(share) for share in shares}) == 1  # the same number of forward passes on every rank
        real = sorted(number for share in shares for number, _ in share if number >= 0)
        assert real == list(range(len(batches)))


@pytest.fixture(scope="module")
def tiny_sd():
    from dstune.pretrained import build_model
    from dstune.models.sd.spec import SdModelSpec

    built = build_model(SdModelSpec(family="sd"), str(CACHE_DIR), "cpu", torch.float32)
    built.trainable.eval()
    return built


def test_the_held_out_loss_is_the_same_for_any_number_of_ranks_and_at_every_evaluation(tiny_sd):
    built = tiny_sd
    data = DataSpec(eval={"fraction": 0.015}, random_flip=True, caption_dropout=0.5)  # ignored: evaluation is fixed
    held_out = make_held_out(data, index_dataset(data).held_out, micro_batch_size=2, seed=7)
    assert held_out.num_samples == 4 and len(held_out.batches) == 2
    results = {}
    for world in (1, 2):
        per_batch = [
            entry
            for rank in range(world)
            for entry in batch_losses(
                built, built.trainable, held_out, rank_share(held_out.batches, rank, world), torch.float32
            )
        ]
        results[world] = combine(per_batch)
    assert results[1] == results[2]  # exactly: the same batches, added in the same order
    mean, count = results[1]
    assert count == 4 and 0 < mean < 10
    # Fixed draws: the loss is the mean of the samples' own losses, each with its (seed, EVAL_STEP, index) noise,
    # whatever the batch it is computed in.
    singles = make_held_out(
        data.model_copy(update={"eval": data.eval.model_copy(update={"batch_size": 1})}),
        index_dataset(data).held_out,
        micro_batch_size=2,
        seed=7,
    )
    one_by_one = combine(
        batch_losses(built, built.trainable, singles, rank_share(singles.batches, 0, 1), torch.float32)
    )
    assert one_by_one[1] == 4 and one_by_one[0] == pytest.approx(mean, rel=1e-5)
    assert singles.dataset[0]["caption"] == singles.dataset.records[0].caption  # no caption dropout here


@pytest.mark.parametrize("family_name, pretrained", [("sdxl", "builtin:tiny-sdxl"), ("flow", "builtin:tiny-flow")])
def test_the_other_image_families_evaluate_with_fixed_draws(family_name, pretrained):
    """sdxl (added conditions from the batch's crop fields) and flow (flow matching, its own timestep densities)
    through the same evaluation: two passes give the same held-out loss."""
    from pydantic import TypeAdapter

    from dstune.pretrained import build_model
    from dstune.spec.models import Model

    model = TypeAdapter(Model).validate_python({"family": family_name, "pretrained": pretrained})
    built = build_model(model, str(CACHE_DIR), "cpu", torch.float32)
    data = DataSpec(eval={"fraction": 0.008})
    held_out = make_held_out(data, index_dataset(data).held_out, micro_batch_size=2, seed=3)
    share = rank_share(held_out.batches, 0, 1)
    first = combine(batch_losses(built, built.trainable, held_out, share, torch.float32))
    again = combine(batch_losses(built, built.trainable, held_out, share, torch.float32))
    assert first == again and first[1] == 2 and first[0] > 0
