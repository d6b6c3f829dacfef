"""The Qwen-Image and Qwen-Image-Edit unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, image, lora

UNIT = ModelUnit(
    name="qwen_image",
    title="Qwen-Image and Qwen-Image-Edit",
    docs="docs/family-flow.md",
    names=r"qwen-image(?![\s-]?2)|qwen_image(?!_?21)",
    recipes={
        "flow": ("dstune.models.qwen_image.recipe:QWEN_IMAGE", "dstune.models.qwen_image.edit_recipe:QWEN_IMAGE_EDIT")
    },
    flow_models=("dstune.models.qwen_image.facts:FLOW_MODELS",),
    summary="Qwen-Image (QwenImageTransformer2DModel; Qwen2.5-VL), Qwen-Image-Edit (QwenImageTransformer2DModel; Qwen2.5-VL with the source image; trains on source/target pairs, see data.control_dir)",
    pipelines={"QwenImagePipeline": 4.0, "QwenImageEditPipeline": 4.0},
    spec_notes={"model.max_sequence_length": "512 (Qwen-Image, Qwen-Image-Edit)"},
    activation_cases=("dstune.models.qwen_image.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-qwen-image": "dstune.models.qwen_image.builtin:TINY_QWEN_IMAGE",
        "tiny-qwen-image-edit": "dstune.models.qwen_image.builtin_edit:TINY_QWEN_IMAGE_EDIT",
    },
    presets=(
        ModelPreset(
            "qwen-image",
            "Qwen-Image (20 B MMDiT; Qwen2.5-VL text encoder)",
            "flow",
            "Qwen/Qwen-Image",
            "tiny-qwen-image",
            image(1328, 4.0, 30, **lora(), **{"model.max_sequence_length": 512}),
        ),
        ModelPreset(
            "qwen-image-edit",
            "Qwen-Image-Edit (Qwen-Image trained to edit a source image)",
            "flow",
            "Qwen/Qwen-Image-Edit",
            "tiny-qwen-image-edit",
            image(
                1024,
                4.0,
                30,
                **lora(),
                **{"data.path": "/data/edits/target", "data.control_dir": "../source", "sample.prompts": []},
            ),
        ),
    ),
)
