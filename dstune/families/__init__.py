"""The closed registry of model families: `model.family` in the spec -> the module that implements it.

    family = get_family(spec.model.family)
    built = family.build(spec.model, spec.output.cache_dir, device, dtype_for_frozen)
    encoded = family.encode_batch(built, batch, compute_dtype)
    loss = family.loss(built, engine, encoded, train_seed, optimizer_step)
    images = family.sample(built, engine.module, prompts, spec.sample, resolution)
    family.save_grid(images, prompts, path)
    family.export(built, consolidated_state_dict, out_dir)

The contract each family module fulfils is documented in dstune.families.base. Modules are imported on first
use, so importing this package costs nothing (no torch, no diffusers). The keys must match the spec's
discriminated union (dstune.spec.models.FAMILIES); a test checks both lists agree.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILY_BUILDERS: dict[str, str] = {
    "sd": "dstune.families.sd",
    "sdxl": "dstune.families.sdxl",
    "flow": "dstune.families.flow",
    "tts_lm": "dstune.families.tts_lm",
    "speecht5": "dstune.families.speecht5",
}


def get_family(name: str) -> ModuleType:
    """The family module for `model.family` == name; ValueError listing the known ones otherwise."""
    if name not in FAMILY_BUILDERS:
        raise ValueError(f"unknown model family {name!r}; known families: {', '.join(sorted(FAMILY_BUILDERS))}")
    return importlib.import_module(FAMILY_BUILDERS[name])
