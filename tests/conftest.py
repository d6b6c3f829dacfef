"""The whole suite's one cache of built-in models: output.cache_dir's default ($DSTUNE_CACHE, else the user's cache
folder) points at the checkout's test cache, which DSTUNE_TEST_CACHE moves, so that no test builds into the user's
own cache and every launch's ranks (which inherit the environment) find the same built models."""

import os
from pathlib import Path

os.environ.setdefault(
    "DSTUNE_CACHE",
    os.environ.get("DSTUNE_TEST_CACHE", str(Path(__file__).resolve().parents[1] / ".dstune-cache" / "tests")),
)
