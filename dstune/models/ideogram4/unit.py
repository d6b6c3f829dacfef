"""The Ideogram 4 unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import DEFAULT_LORA_TARGET_MODULES, ModelPreset, ModelUnit, image, lora

UNIT = ModelUnit(
    name="ideogram4",
    title="Ideogram 4",
    docs="docs/family-flow.md",
    names=r"ideogram\w*",
    recipes={"flow": ("dstune.models.ideogram4.recipe:IDEOGRAM4",)},
    flow_models=("dstune.models.ideogram4.facts:FLOW_MODELS",),
    summary="Ideogram 4 (Ideogram4Transformer2DModel; Qwen3-VL)",
    pipelines={"Ideogram4Pipeline": 7.0},
    spec_notes={"model.max_sequence_length": "2048 (Ideogram 4)"},
    activation_cases=("dstune.models.ideogram4.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-ideogram4": "dstune.models.ideogram4.builtin:TINY_IDEOGRAM4",
    },
    presets=(
        ModelPreset(
            "ideogram4",
            "Ideogram 4 (9 B transformer; Qwen3-VL text encoder; frozen unconditional transformer)",
            "flow",
            "ideogram-ai/ideogram-v4",
            "tiny-ideogram4",
            image(
                1024,
                7.0,
                48,
                **lora(targets=(*DEFAULT_LORA_TARGET_MODULES, "w1", "w2", "w3")),
                **{"model.gradient_checkpointing": True},
            ),
        ),
    ),
)
