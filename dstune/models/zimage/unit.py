"""The Z-Image unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, image

UNIT = ModelUnit(
    name="zimage",
    title="Z-Image",
    docs="docs/family-flow.md",
    names=r"z-image|zimage|z_image\w*",
    recipes={"flow": ("dstune.models.zimage.recipe:ZIMAGE",)},
    flow_models=("dstune.models.zimage.facts:FLOW_MODELS",),
    summary="Z-Image (ZImageTransformer2DModel; Qwen3)",
    pipelines={"ZImagePipeline": 5.0},
    spec_notes={"model.max_sequence_length": "512 (Z-Image)"},
    activation_cases=("dstune.models.zimage.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-z-image": "dstune.models.zimage.builtin:TINY_Z_IMAGE",
    },
    presets=(
        ModelPreset(
            "z-image",
            "Z-Image (6 B single-stream transformer; Qwen3 text encoder)",
            "flow",
            "Tongyi-MAI/Z-Image",
            "tiny-z-image",
            image(
                1024,
                4.0,
                28,
                **{
                    "train.optimizer.lr": 1.0e-5,
                    "model.gradient_checkpointing": True,
                    "model.max_sequence_length": 512,
                },
            ),
        ),
    ),
)
