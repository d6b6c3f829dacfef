"""The ERNIE-Image unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import DEFAULT_LORA_TARGET_MODULES, ModelPreset, ModelUnit, image, lora

# attention (the unit's default targets) and the GELU-gated MLP of every block
ERNIE_IMAGE_LORA_TARGETS = (*DEFAULT_LORA_TARGET_MODULES, "gate_proj", "up_proj", "linear_fc2")

UNIT = ModelUnit(
    name="ernie_image",
    title="ERNIE-Image and ERNIE-Image-Turbo",
    docs="docs/family-flow.md",
    names=r"ernie[\w-]*",
    recipes={"flow": ("dstune.models.ernie_image.recipe:ERNIE_IMAGE",)},
    flow_models=("dstune.models.ernie_image.facts:FLOW_MODELS",),
    summary="ERNIE-Image (ErnieImageTransformer2DModel; Mistral3)",
    pipelines={"ErnieImagePipeline": 4.0},
    spec_notes={"model.max_sequence_length": "512 (ERNIE-Image: dstune's; captions are padded to it)"},
    activation_cases=("dstune.models.ernie_image.builtin:ACTIVATION_CASES",),
    builtins={"tiny-ernie-image": "dstune.models.ernie_image.builtin:TINY_ERNIE_IMAGE"},
    presets=(
        ModelPreset(
            "ernie-image",
            "ERNIE-Image (8 B single-stream transformer; Mistral3 text encoder; 32-channel AutoencoderKLFlux2)",
            "flow",
            "baidu/ERNIE-Image",
            "tiny-ernie-image",
            image(
                1024,
                4.0,
                50,
                **lora(targets=ERNIE_IMAGE_LORA_TARGETS),
                **{"model.gradient_checkpointing": True, "model.max_sequence_length": 512},
            ),
        ),
    ),
)
