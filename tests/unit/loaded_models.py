"""What the model tests share: the cache of the built-in tiny models, loading one, and a loaded model with other
settings (test helpers, not tests)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))


def with_settings(model, **settings):
    """A shallow copy of a loaded model whose spec section has `settings` (what its loss and samples read at their
    call; a setting its load decides, such as model.shift's training tables, needs a model loaded with it)."""
    other = copy.copy(model)
    other.model_spec = model.model_spec.model_copy(update=settings)
    return other


def with_attributes(model, **attributes):
    """A shallow copy of a loaded model with some of its attributes replaced (max_sequence_length, ...)."""
    other = copy.copy(model)
    for name, value in attributes.items():
        setattr(other, name, value)
    return other


def start_up(spec_path):
    """The real start-up on one rank (the settings matrix's path): validate, load, records, caches, loader."""
    from dstune.distributed import Run
    from dstune.ds_json.fill_spec import merged_spec
    from dstune.spec.load import load_spec
    from dstune.startup import checked_records, load_trained_model, make_training_loader, prepare_caches
    from dstune.validate import validate_spec
    from dstune.world import World

    world = World(1, 1, (1,), ("localhost",), "one process")
    spec, source = merged_spec(*load_spec(str(spec_path), []))
    resolved = validate_spec(spec, source, world)
    run = Run(rank=0, local_rank=0, world=world, device="cpu", accelerator="cpu", node_rank=0, launched=False)
    model = load_trained_model(run, resolved.spec, ds_config=resolved.ds_config)
    records = checked_records(run, resolved.spec, model.modality)
    caches, code = prepare_caches(run, resolved.spec, model, records)
    assert code == 0
    loader, _ = make_training_loader(resolved.spec, resolved.plan, 0, model, records, caches, 0, 0)
    return model, caches, loader
