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


# The suite's longest modules (seconds of a quiet 2-core run), started first. `make test` hands whole files to its
# two workers (--dist loadfile) in the order they are collected, the next file to whichever worker is free: started
# last, one long file leaves the other worker idle for its length; started first, the short ones fill in around it
# (longest first, the usual greedy order for two machines).
LONGEST_FIRST = (
    "dist/test_sequence_parallel.py",
    "unit/test_activation_constants.py",
    "unit/test_working_memory.py",
    "dist/test_tts.py",
    "unit/test_golden_losses.py",
    "dist/test_settings_matrix_two_ranks.py",
    "unit/test_settings_matrix.py",
    "dist/test_two_nodes.py",
    "dist/test_train.py",
    "dist/test_optimizers_two_ranks.py",
    "dist/test_flow_qwen_edit.py",
    "dist/test_minimax_h3.py",
    "dist/test_kandinsky6.py",
    "dist/test_cache.py",
    "dist/test_ltx2.py",
)


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST's modules first, in that order; every other module after them as collected (a module's tests
    stay together and in their order)."""
    rank = {name: number for number, name in enumerate(LONGEST_FIRST)}

    def module_rank(item) -> int:
        path = item.path.as_posix()
        return next((number for name, number in rank.items() if path.endswith("tests/" + name)), len(rank))

    items[:] = sorted(items, key=module_rank)  # stable: the order within a module, and of the rest, is kept
