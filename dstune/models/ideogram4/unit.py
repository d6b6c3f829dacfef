"""The Ideogram 4 unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, image, lora
from dstune.spec.model_sections import DEFAULT_LORA_TARGET_MODULES

UNIT = ModelUnit(
    name="ideogram4",
    title="Ideogram 4",
    docs="docs/family-flow.md",
    names=r"ideogram",
    recipes={'flow': ('dstune.models.ideogram4.recipe:IDEOGRAM4',)},
    flow_models=('dstune.models.ideogram4.facts:FLOW_MODELS',),
    builtins=('dstune.models.ideogram4.builtin:TINY_IDEOGRAM4',),
    presets=(
        ModelPreset("ideogram4", "Ideogram 4 (9 B transformer; Qwen3-VL text encoder; frozen unconditional transformer)",
                    "flow", "ideogram-ai/ideogram-v4", "tiny-ideogram4",
                    image(1024, 7.0, 48, **lora(targets=(*DEFAULT_LORA_TARGET_MODULES, "w1", "w2", "w3")),
                           **{"model.gradient_checkpointing": True})),
    ),
)
