"""The models `dstune init --model NAME` writes a spec for: one entry per model dstune trains, with its real
defaults (the published checkpoint, its native resolution, precision, guidance, LoRA targets, the frame rate and
clip length of video models, the codec of speech models) and the built-in tiny model of the same layout.

The presets are declared by the model units (dstune/models/<name>/unit.py) and collected here from the registry
(dstune.models.registry). tests/unit/test_model_presets.py checks that every family of the spec's `model.family`
union and every built-in model has its entry (a built-in belongs to exactly one model, of the same family), and
README.md names each one. Torch-free.
"""

from __future__ import annotations

from dstune.models.registry import presets
from dstune.models.unit import ModelPreset

MODEL_PRESETS: tuple[ModelPreset, ...] = presets()  # each unit's own (dstune/models/<name>/unit.py)

PRESETS_BY_NAME: dict[str, ModelPreset] = {preset.name: preset for preset in MODEL_PRESETS}


def model_names() -> list[str]:
    return [preset.name for preset in MODEL_PRESETS]
