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
