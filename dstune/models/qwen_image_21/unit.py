"""The Qwen-Image 2.1 and its Turbo unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, image, lora

UNIT = ModelUnit(
    name="qwen_image_21",
    title="Qwen-Image 2.1 and its Turbo",
    docs="docs/family-flow.md",
    names=r"qwen-image[\s-]?2\.1|qwen_?image_?21\w*|qwen21",
    recipes={"flow": ("dstune.models.qwen_image_21.recipe:QWEN_IMAGE_21",)},
    flow_models=("dstune.models.qwen_image_21.facts:FLOW_MODELS",),
    summary="Qwen-Image 2.1 and its Turbo (QwenImage21Transformer2DModel; Qwen3-VL)",
    pipelines={"QwenImage21Pipeline": 1.0},
    spec_notes={
        "model.max_sequence_length": "512 (Qwen-Image 2.1: its example sets no limit; a longer caption is refused, naming it)"
    },
    activation_cases=("dstune.models.qwen_image_21.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-qwen-image-21": "dstune.models.qwen_image_21.builtin:TINY_QWEN_IMAGE_21",
    },
    presets=(
        ModelPreset(
            "qwen-image-21",
            "Qwen-Image 2.1 (7 B single-stream transformer; Qwen3-VL text encoder; RGBA VAE)",
            "flow",
            "Qwen/Qwen-Image-2.1",
            "tiny-qwen-image-21",
            image(
                1024,
                1.0,
                40,
                **lora(rank=16),
                **{"model.gradient_checkpointing": True, "model.timestep_sampling": "uniform"},
            ),
        ),
    ),
)
