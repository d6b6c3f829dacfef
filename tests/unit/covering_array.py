"""A covering array of strength 2 ("pairwise"): rows of settings in which every pair of two settings' values meets
at least once, in far fewer rows than every combination. Ours, small and deterministic; the settings matrix
(tests/unit/settings_matrix.py) makes each model's cases with it.

    pairwise({"micro_batch_size": (1, 2), "precision": ("fp32", "bf16"), ...}) -> [{setting: value}, ...]
    uncovered_pairs(factors, rows) -> the pairs no row holds ([] for a covering array)
"""

from __future__ import annotations

import random
from itertools import combinations
from typing import Callable, Optional


def _pairs(row: dict, names: list[str]) -> set:
    items = [(name, row[name]) for name in names if name in row]
    return set(combinations(items, 2))


def required_pairs(factors: dict[str, tuple], allowed: Callable[[dict], bool] = lambda row: True) -> list:
    """Every ((setting, value), (setting, value)) of two different settings that `allowed` lets meet, in a fixed
    order (settings in the order given, values in theirs)."""
    names = list(factors)
    return [
        ((a, va), (b, vb))
        for a, b in combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
        if allowed({a: va, b: vb})
    ]


CANDIDATES = 100  # rows tried for each row kept


def _fill(seed: tuple, order: list[str], factors: dict[str, tuple], open_pairs: set, allowed, rng) -> Optional[dict]:
    """A row grown from one seed pair: setting by setting in `order`, an allowed value that covers the most open
    pairs with the values already in the row (ties drawn from `rng`); None when some setting has no allowed value."""
    (a, va), (b, vb) = seed
    row = {a: va, b: vb}
    for name in order:
        if name in row:
            continue
        choices = [v for v in factors[name] if allowed({**row, name: v})]
        if not choices:
            return None
        gains = [
            sum(((n, row[n]), (name, v)) in open_pairs or ((name, v), (n, row[n])) in open_pairs for n in row)
            for v in choices
        ]
        row[name] = rng.choice([v for v, gain in zip(choices, gains) if gain == max(gains)])
    return row


def pairwise(factors: dict[str, tuple], allowed: Callable[[dict], bool] = lambda row: True) -> list[dict]:
    """A covering array of strength 2: rows (setting -> value) in which every required pair meets at least once.

    Greedy, as AETG (Cohen et al. 1997): each row kept is the best of CANDIDATES rows, each grown from an uncovered
    pair in a shuffled order of the settings (`_fill`), the one that covers the most uncovered pairs. The draws come
    from a generator seeded with a constant, so the cases are the same on every run and machine. `allowed` sees
    partial rows and refuses only what it can tell from them."""
    rng = random.Random(0x5E77)
    names = list(factors)
    uncovered = required_pairs(factors, allowed)
    rows: list[dict] = []
    while uncovered:
        open_pairs = set(uncovered)
        best, best_count = None, 0
        for attempt in range(CANDIDATES):
            order = rng.sample(names, len(names))
            row = _fill(
                uncovered[0] if attempt == 0 else rng.choice(uncovered), order, factors, open_pairs, allowed, rng
            )
            count = len(_pairs(row, names) & open_pairs) if row else 0
            if count > best_count:
                best, best_count = row, count
        if best is None:
            raise ValueError(f"no allowed row covers {uncovered[0]}")
        rows.append({name: best[name] for name in names})
        covered = _pairs(best, names)
        uncovered = [pair for pair in uncovered if pair not in covered]
    for row in reversed(list(rows)):  # a row whose every pair another row also holds is left out
        others = [other for other in rows if other is not row]
        if not uncovered_pairs(factors, others, allowed):
            rows = others
    return rows


def uncovered_pairs(factors: dict[str, tuple], rows: list[dict], allowed=lambda row: True) -> list:
    """The required pairs no row holds (empty for a covering array)."""
    names = list(factors)
    covered = set().union(*(_pairs(row, names) for row in rows)) if rows else set()
    return [pair for pair in required_pairs(factors, allowed) if pair not in covered]
