"""The whole suite's one cache of built-in models: output.cache_dir's default ($DSTUNE_CACHE, else the user's cache
folder) points at the checkout's test cache, which DSTUNE_TEST_CACHE moves, so that no test builds into the user's
own cache and every launch's ranks (which inherit the environment) find the same built models."""

import os
from pathlib import Path

os.environ.setdefault(
    "DSTUNE_CACHE",
    os.environ.get("DSTUNE_TEST_CACHE", str(Path(__file__).resolve().parents[1] / ".dstune-cache" / "tests")),
)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _validate_lines_whole(monkeypatch):
    """dstune's report wraps its lines at COLUMNS when that is set; the tests read validate's lines whole, as a pipe
    gives them, whatever width leaked into a worker's environment (a test that wants a width sets it itself)."""
    monkeypatch.delenv("COLUMNS", raising=False)
