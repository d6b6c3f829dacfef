"""The trained parts of the built-in models (dstune.builtin.trained): stored with dstune, given to the module a build
initialises, trained only when regenerated."""

from __future__ import annotations

import pytest
import torch

from dstune.builtin import trained
from dstune.builtin.common import BuiltinError


def test_every_declared_part_is_stored_and_every_stored_part_declared():
    from dstune.builtin import BUILTIN_MODELS

    declared = {name for model in BUILTIN_MODELS.values() for name in model.trained_parts}
    stored = {path.stem for path in trained.STORE.glob("*.safetensors")}
    assert declared == stored
    for name in stored:  # each file carries the facts its training returned (possibly none)
        tensors, facts = trained.read_part(name)
        assert tensors and isinstance(facts, dict)


def _doubled(module) -> dict:
    with torch.no_grad():
        module.weight.mul_(2.0)
    torch.randn(7)  # a training that draws from the global RNG: the draw must not leak into the build
    return {"doubled": True}


PART = trained.TrainedPart("test-linear", _doubled, stored=lambda m: {"weight": m.weight})


def _fresh() -> torch.nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Linear(3, 2)


def test_retraining_writes_the_part_and_loading_gives_it_back(tmp_path, monkeypatch):
    monkeypatch.setenv(trained.RETRAIN_ENV, str(tmp_path))
    module = _fresh()
    torch.manual_seed(1)
    assert trained.give_trained_weights(PART, module) == {"doubled": True}
    after_training = torch.get_rng_state()
    torch.testing.assert_close(module.weight, 2 * _fresh().weight)

    # a second build in the same regeneration loads what the first trained, as a build outside it loads the store
    loaded = _fresh()
    torch.manual_seed(1)
    assert trained.give_trained_weights(PART, loaded) == {"doubled": True}
    assert torch.equal(torch.get_rng_state(), after_training), "training must leave the global RNG as loading does"
    assert torch.equal(loaded.weight, module.weight) and torch.equal(loaded.bias, _fresh().bias)


def test_a_stored_part_that_does_not_fit_the_module_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(trained.RETRAIN_ENV, str(tmp_path))
    trained.give_trained_weights(PART, _fresh())
    other = trained.TrainedPart("test-linear", _doubled)  # stores the whole state: bias too
    with pytest.raises(BuiltinError, match="does not fit the module its built-in makes: 1 tensors missing"):
        trained.give_trained_weights(other, _fresh())
