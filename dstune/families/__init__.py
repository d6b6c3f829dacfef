"""The closed registry of model families: `model.family` in the spec -> its torch side (`Family`,
dstune.families.base) and its torch-free facts (`ModelFacts`, dstune.families.facts).

    facts = get_facts(spec.model.family)        # validate, the memory plan, the video planner: no torch
    family = get_family(spec.model.family)      # training: build, encode, loss, sample, export
    built = family.build(spec.model, folders, device, dtype_for_frozen)   # folders: dstune.pretrained
    encoded = family.encode_batch(built, batch, compute_dtype)
    loss = family.loss(built, engine, encoded, train_seed, optimizer_step)

Family modules import torch and their model libraries, so they are imported on first use; this package and the
facts modules are torch-free (tests/unit/test_families_registry.py checks it), so `dstune validate` never imports a
family's torch side. The keys must match the spec's discriminated union (dstune.spec.models.FAMILIES); a test checks
the lists agree. Adding a family: docs/architecture.md.
"""

from __future__ import annotations

import importlib

from dstune.families import flow_facts, video_facts
from dstune.families.base import Family
from dstune.families.facts import ModelFacts
from dstune.models import registry
from dstune.models.unit import VIDEO_FAMILY, load

# The shared cores' families (their models are recipes the units add: dstune.models.registry.recipes), then the
# families the model units own.
CORE_FAMILY_MODULES = {"flow": "dstune.families.flow", VIDEO_FAMILY: "dstune.families.video"}
FAMILY_MODULES: dict[str, str] = {**CORE_FAMILY_MODULES, **registry.family_modules()}

FAMILY_FACTS: dict[str, ModelFacts] = {
    facts.family: facts for facts in (flow_facts.FACTS, video_facts.FACTS, *map(load, registry.facts()))
}


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown model family {name!r}; known families: {', '.join(sorted(FAMILY_MODULES))}")


def get_family(name: str) -> Family:
    """The family for `model.family` == name; ValueError listing the known ones otherwise."""
    if name not in FAMILY_MODULES:
        raise _unknown(name)
    return importlib.import_module(FAMILY_MODULES[name]).FAMILY


def get_facts(name: str) -> ModelFacts:
    """The torch-free facts of `model.family` == name; ValueError listing the known ones otherwise."""
    if name not in FAMILY_FACTS:
        raise _unknown(name)
    return FAMILY_FACTS[name]
