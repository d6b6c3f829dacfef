"""The closed registry of model families: `model.family` in the spec -> its `Family` (dstune.families.base).

    family = get_family(spec.model.family)
    built = family.build(spec.model, folders, device, dtype_for_frozen)   # folders: dstune.pretrained
    encoded = family.encode_batch(built, batch, compute_dtype)
    loss = family.loss(built, engine, encoded, train_seed, optimizer_step)

Family modules import torch and their model libraries, so they are imported on first use: importing this package
costs nothing (`dstune validate` never imports a family). The keys must match the spec's discriminated union
(dstune.spec.models.FAMILIES); a test checks both lists agree. Adding a family: docs/architecture.md.
"""

from __future__ import annotations

import importlib

from dstune.families.base import Family

FAMILY_MODULES: dict[str, str] = {
    "sd": "dstune.families.sd",
    "sdxl": "dstune.families.sdxl",
    "flow": "dstune.families.flow",
    "wan": "dstune.families.wan",
    "tts_lm": "dstune.families.tts_lm",
    "speecht5": "dstune.families.speecht5",
}


def get_family(name: str) -> Family:
    """The family for `model.family` == name; ValueError listing the known ones otherwise."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"unknown model family {name!r}; known families: {', '.join(sorted(FAMILY_MODULES))}")
    return importlib.import_module(FAMILY_MODULES[name]).FAMILY
