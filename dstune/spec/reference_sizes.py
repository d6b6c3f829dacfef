"""data.reference_size `own`: the size each reference (an edit model's source image) trains at, by itself. Pure
arithmetic on sizes, no files: the data layer sizes references with it, and the cards count the pictures' tokens
with it in the memory plan and the sequence-parallel checks (so it sits below both)."""

from __future__ import annotations

import math

REFERENCE_MULTIPLE = 32  # a reference's sides, as the edit pipelines round them


def own_reference_size(size: tuple[int, int], target) -> tuple[int, int]:
    """data.reference_size own: the (width, height) a reference of `size` (width, height) trains at: its aspect
    ratio at the area of `target` (a square side, or a bucket's (width, height)), each side rounded to a multiple
    of REFERENCE_MULTIPLE (at least one), as QwenImageEditPlusPipeline's calculate_dimensions rounds them."""
    target_w, target_h = (target, target) if isinstance(target, int) else target
    ratio = size[0] / size[1]
    width = math.sqrt(target_w * target_h * ratio)
    height = width / ratio
    return tuple(
        max(REFERENCE_MULTIPLE, round(side / REFERENCE_MULTIPLE) * REFERENCE_MULTIPLE) for side in (width, height)
    )


PLANNED_ASPECT = 4  # the memory plan counts own-size references of aspect ratios up to 4:1 (and 1:4)


def own_area_bound(target: int) -> int:
    """The most pixels own_reference_size gives a reference for a `target` square, over aspect ratios from
    1:PLANNED_ASPECT to PLANNED_ASPECT:1 (the rounding to 32 px can add to the target's area): what the memory plan
    and the sequence-parallel checks count per own-size reference."""
    steps = 2000
    ratios = (PLANNED_ASPECT ** (2 * k / steps - 1) for k in range(steps + 1))
    return max(math.prod(own_reference_size((ratio, 1.0), target)) for ratio in ratios)
