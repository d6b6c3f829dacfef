"""The models whose activations bench/activation_table.py measures: every model card's `Case`s (its
`activation_cases`, beside its built-ins in its builtin module; dstune/memory/activation_cases.py says what a case
is and the width rule that makes the narrow measurement hold at the real width), in the registry's order."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dstune import registry  # noqa: E402
from dstune.card import load  # noqa: E402

CASES = [case for where in registry.activation_cases() for case in load(where)]
CASES_BY_KEY = {case.key: case for case in CASES}
