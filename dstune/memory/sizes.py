"""Sizes as users write them (--gpu-memory 24GB, 80GiB), in bytes."""

from __future__ import annotations


def parse_size(text: str) -> int:
    """ "24GB", "80GiB", "24G", "24" (GB) -> bytes. GB and G are 10^9 (as GPU datasheets say), GiB 2^30."""
    units = {
        "": 1e9,
        "g": 1e9,
        "gb": 1e9,
        "gib": 2**30,
        "m": 1e6,
        "mb": 1e6,
        "mib": 2**20,
        "t": 1e12,
        "tb": 1e12,
        "tib": 2**40,
    }
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("abgimt")
    unit = stripped[len(number) :]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: write e.g. 24GB, 80GB or 40GiB") from None
    if unit not in units or value <= 0:
        raise ValueError(f"{text!r} is not a size: write e.g. 24GB, 80GB or 40GiB (units: GB, GiB, MB, TB)")
    return int(value * units[unit])
