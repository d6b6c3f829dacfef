"""What a resume says about spec changes since the checkpoint (dstune.spec.diff): safe ones listed, the ones that
break exact continuation refused with the fix."""

from dstune.spec.diff import describe_changes, spec_changes
from dstune.spec.models import Spec

BASE = {
    "model": {"family": "sd"},
    "data": {"path": "builtin:shapes", "resolution": 32},
    "train": {"micro_batch_size": 2, "max_steps": 4, "seed": 7},
    "output": {"dir": "runs/a"},
}


def _dump(**sections) -> dict:
    raw = {name: dict(values) for name, values in BASE.items()}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return Spec.model_validate(raw).model_dump(mode="json")


def test_an_unchanged_spec_has_no_changes():
    assert spec_changes(_dump(), _dump()) == []
    assert describe_changes([], "constant") == ("", "")


def test_frequencies_folders_samples_caches_and_length_are_allowed_and_listed():
    changes = spec_changes(
        _dump(),
        _dump(
            output={"dir": "runs/b", "save_every_steps": 2},
            train={"max_steps": 8},
            sample={"prompts": ["a red circle"]},
            data={"num_workers": 3},
        ),
    )
    assert {c.key for c in changes} == {
        "output.dir",
        "output.save_every_steps",
        "train.max_steps",
        "sample.prompts",
        "data.num_workers",
    }
    assert all(c.safe for c in changes)
    safe, breaking = describe_changes(changes, "constant")
    assert breaking == "" and "train.max_steps: 4 -> 8" in safe and "output.dir: 'runs/a' -> 'runs/b'" in safe
    assert "schedule" not in safe  # a constant LR is not stretched
    assert "cosine LR schedule resumes with the length the run started with" in describe_changes(changes, "cosine")[0]


def test_data_seed_model_and_optimizer_changes_break_exact_continuation():
    changes = spec_changes(
        _dump(),
        _dump(
            train={"seed": 8, "optimizer": {"type": "sgd", "lr": 0.1}},
            data={"path": "other/folder"},
            model={"prediction": "epsilon"},
        ),
    )
    breaking = {c.key for c in changes if not c.safe}
    assert {"train.seed", "train.optimizer.type", "data.path", "model.prediction"} <= breaking
    _, text = describe_changes(changes, "constant")
    assert "train.seed: 7 -> 8" in text and "--allow-spec-changes" in text and "another output.dir" in text


def test_a_new_split_of_the_same_global_batch_is_left_to_the_resume_plan():
    """--set train.gradient_accumulation_steps=2 on half the ranks (what a resume on another world suggests) is no
    spec problem; whether the global batch is kept is dstune.checkpoints.resume_plan's decision."""
    changes = spec_changes(_dump(), _dump(train={"micro_batch_size": 1, "gradient_accumulation_steps": 2}))
    assert changes and all(c.safe for c in changes)


def test_a_new_held_out_share_breaks_continuation_but_how_often_it_is_measured_does_not():
    """data.eval.fraction decides which images train; every_steps and batch_size only when and how the held-out
    loss is measured; output.tensorboard / output.wandb only where metrics go."""
    start = _dump(data={"eval": {"fraction": 0.1, "every_steps": 10}})
    measured = spec_changes(
        start,
        _dump(
            data={"eval": {"fraction": 0.1, "every_steps": 5, "batch_size": 4}},
            output={"tensorboard": False, "wandb": True},
        ),
    )
    assert {c.key for c in measured} == {
        "data.eval.every_steps",
        "data.eval.batch_size",
        "output.tensorboard",
        "output.wandb",
    }
    assert all(c.safe for c in measured)
    share = spec_changes(start, _dump(data={"eval": {"fraction": 0.2, "every_steps": 10}}))
    assert [(c.key, c.safe) for c in share] == [("data.eval.fraction", False)]


def test_an_optional_section_added_since_the_checkpoint_is_no_change():
    """A checkpoint saved by a dstune without data.eval lacks the key; unset now, it is the same setting. Set now,
    it is a change like any other."""
    saved = _dump()
    del saved["data"]["eval"]
    assert spec_changes(saved, _dump()) == []
    assert [c.key for c in spec_changes(saved, _dump(data={"eval": {"fraction": 0.1}}))][:1] == ["data.eval.fraction"]


def test_changes_no_checkpoint_can_take_are_refused_even_when_allowed():
    """The optimizer type, precision and ZeRO stage decide what the checkpoint's optimizer state is; LoRA shapes and
    an EMA switched on decide what its weights are. Each is named with why and the way on; an LR is not refused."""
    from dstune.spec.diff import refused_changes_text

    saved = _dump()
    current = _dump(
        train={"optimizer": {"type": "sgd", "lr": 0.5}, "precision": "bf16", "ema": {}}, deepspeed={"zero_stage": 3}
    )
    text = refused_changes_text(spec_changes(saved, current), saved, current)
    for line in (
        "train.optimizer.type: 'adamw' -> 'sgd': the saved optimizer state",
        "train.precision: 'fp32' -> 'bf16'",
        "deepspeed.zero_stage: 2 -> 3",
        "train.ema: (unset) -> set: the checkpoint holds no EMA",
    ):
        assert line in text
    assert "train.optimizer.lr" not in text and "Revert them" in text and "dstune export RUN" in text
    lr_only = _dump(train={"optimizer": {"lr": 0.5}, "scheduler": {"type": "cosine"}})
    assert refused_changes_text(spec_changes(saved, lr_only), saved, lr_only) == ""
    _, breaking = describe_changes(spec_changes(saved, lr_only), "cosine")
    assert "train.optimizer.lr: 0.0001 -> 0.5" in breaking and "takes effect from the resumed step" in breaking


def test_a_checkpoint_from_before_reference_sizes_resumes_as_it_trained():
    """A checkpoint written before data.reference_size existed (the key absent, or unset) sized every reference with
    its target: resuming with `target` (every model's choice but Qwen-Image-Edit-2509/2511's) is no change, and with
    `own` it is one, which breaks exact continuation."""
    old = _dump()
    del old["data"]["reference_size"]
    assert spec_changes(old, _dump(data={"reference_size": "target"})) == []
    assert spec_changes(_dump(), _dump(data={"reference_size": "target"})) == []
    (change,) = spec_changes(old, _dump(data={"reference_size": "own"}))
    assert change.key == "data.reference_size" and not change.safe
    (change,) = spec_changes(_dump(data={"reference_size": "own"}), _dump(data={"reference_size": "target"}))
    assert change.key == "data.reference_size"
