"""Spec values whose default depends on the model: data.resolution and sample.guidance when the spec leaves them
out, and the model section's own folder-decided keys (a tts_lm codec) (torch-free).

    with_model_defaults(spec) -> (spec with both filled in, where the resolution came from, where the guidance did)

The model's card (dstune.card) says its pipeline's sampling guidance and, where its pipeline fixes one in its code, its
frame size; the model section (dstune/spec/) how a pipeline of its family picks its default size from the folder's
config files. This module finds those files (dstune.memory.counts.config_folder: a built-in model's stored configs,
a local folder, the local Hugging Face cache, the configs stored with dstune) and applies the answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from dstune import registry
from dstune.memory.counts import SizesUnknown, config_folder
from dstune.spec.models import AUDIO_FAMILIES, Spec, is_single_file
from dstune.spec.section import BUILTIN_PREFIX

# The built-in tiny models are built and tested at 32 px (tiny VAEs and denoisers; the SD-style ones say so in
# their configs, sample_size 16 x a 2x VAE, and every one of them trains at that size).
BUILTIN_RESOLUTION = 32


def _reader(folder: Path):
    def read(name: str) -> Optional[dict]:
        try:
            return json.loads((folder / name).read_text())
        except (OSError, ValueError):
            return None

    return read


def native_resolution(spec: Spec) -> tuple[int, str]:
    """(the model's native image size in pixels, how it was worked out), for a spec that leaves data.resolution
    out: the model section's reading of its folder's configs, else its family's usual size."""
    model = spec.model
    reference = model.pretrained
    if is_single_file(reference) and getattr(model, "base_pipeline", None):
        reference = model.base_pipeline  # the folder whose configs describe the single file
    if reference.startswith(BUILTIN_PREFIX):
        return BUILTIN_RESOLUTION, f"{reference} is built for {BUILTIN_RESOLUTION} px"
    try:
        folder = config_folder(reference)[0]
    except SizesUnknown:
        folder = None
    found = None
    if folder is not None:
        read = _reader(folder)
        cards = (card.native_size(read("model_index.json") or {}) for card in registry.family_cards(model.family))
        found = next((size for size in cards if size), None) or model.native_resolution(read)
    if found:
        return found[0], f"{model.pretrained}'s native size: {found[1]}"
    unknown = "are not readable here" if folder is None else "do not say its size"
    return model.PRESET_RESOLUTION, f"{model.PRESET_NAME}: {model.pretrained}'s configs {unknown}"


def _guidance(spec: Spec) -> tuple[float, str]:
    model = spec.model
    reference = model.pretrained
    if is_single_file(reference) and getattr(model, "base_pipeline", None):
        reference = model.base_pipeline  # the folder whose configs describe the single file
    reference = spec.sample.pretrained or reference  # the samples' own folder (a distilled one) decides
    try:
        folder = config_folder(reference)[0]
    except SizesUnknown:
        folder = None
    index = (_reader(folder)("model_index.json") if folder is not None else None) or {}
    for card in registry.family_cards(model.family):
        found = card.sample_guidance(index)
        if found:
            return found[0], f"{found[1]}; not set in the spec"
    why = f"{model.family}'s usual pipeline default (the folder's pipeline is unknown here)"
    return model.PRESET_GUIDANCE, f"{why}; not set in the spec"


def _with_folder_defaults(spec: Spec) -> Spec:
    """The model section's keys its folder decides (a tts_lm codec from dstune_tts.json), where the spec leaves them
    out; a folder whose configs are not readable here leaves the section's own fallback."""
    try:
        folder = config_folder(spec.model.pretrained)[0]
    except SizesUnknown:
        folder = None
    read = _reader(folder) if folder is not None else (lambda name: None)
    updates = spec.model.folder_defaults(read)
    return spec.model_copy(update={"model": spec.model.model_copy(update=updates)}) if updates else spec


def _reference_size(spec: Spec) -> str:
    """The model's data.reference_size (its card's, for its folder's pipeline); "target" where the folder is not
    readable here or names no card."""
    try:
        folder = config_folder(spec.model.pretrained)[0]
    except SizesUnknown:
        return "target"
    index = _reader(folder)("model_index.json") or {}
    found = (card.reference_size(index) for card in registry.family_cards(spec.model.family))
    return next((size for size in found if size), "target")


def with_model_defaults(spec: Spec) -> tuple[Spec, str, str]:
    """The spec with data.resolution set to the model's native size and sample.guidance to its pipeline's default
    where the spec leaves them out, and where each value in effect came from ("" for speech families, which have
    neither)."""
    spec = _with_folder_defaults(spec)
    if spec.model.family in AUDIO_FAMILIES:
        return spec, "", ""
    data, size_origin = spec.data, "set in the spec"
    if "resolution" not in data.model_fields_set:
        size, why = native_resolution(spec)
        data, size_origin = data.model_copy(update={"resolution": size}), f"{why}; not set in the spec"
    if data.reference_size is None:
        data = data.model_copy(update={"reference_size": _reference_size(spec)})
    sample, guidance_origin = spec.sample, "set in the spec"
    if "guidance" not in sample.model_fields_set:
        value, guidance_origin = _guidance(spec)
        sample = sample.model_copy(update={"guidance": value})
    return spec.model_copy(update={"data": data, "sample": sample}), size_origin, guidance_origin


def bucket_step_problem(spec: Spec, origin: str) -> Optional[str]:
    """The spec checks data.buckets.step against a data.resolution it sets; this checks it against the default."""
    buckets, size = spec.data.buckets, spec.data.resolution
    if not buckets.enabled or buckets.sizes or buckets.step <= size or spec.model.family in AUDIO_FAMILIES:
        return None
    return (
        f"{buckets.step} is larger than data.resolution {size} ({origin}): no bucket side fits. Use a step of "
        "at most data.resolution (a multiple of 8), or give data.buckets.sizes."
    )
