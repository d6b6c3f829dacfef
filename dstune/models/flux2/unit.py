"""The FLUX.2 [klein] and [dev] unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import DEFAULT_LORA_TARGET_MODULES, ModelPreset, ModelUnit, image, lora

UNIT = ModelUnit(
    name="flux2",
    title="FLUX.2 [klein] and [dev]",
    docs="docs/family-flow.md",
    names=r"flux\.?2|flux2",
    recipes={"flow": ("dstune.models.flux2.recipe:FLUX2_KLEIN", "dstune.models.flux2.recipe:FLUX2_DEV")},
    flow_models=("dstune.models.flux2.facts:FLOW_MODELS",),
    summary="FLUX.2 [klein] (Flux2Transformer2DModel; Qwen3), FLUX.2 [dev] (Flux2Transformer2DModel; Mistral3)",
    pipelines={"Flux2KleinPipeline": 4.0, "Flux2Pipeline": 4.0},
    spec_notes={"model.max_sequence_length": "512 (FLUX.2 [klein], FLUX.2 [dev])"},
    activation_cases=("dstune.models.flux2.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-flux2": "dstune.models.flux2.builtin:TINY_FLUX2",
        "tiny-flux2-dev": "dstune.models.flux2.builtin:TINY_FLUX2_DEV",
    },
    presets=(
        ModelPreset(
            "flux2-klein",
            "FLUX.2 [klein] 4B (Flux2 transformer; Qwen3 text encoder; distilled)",
            "flow",
            "black-forest-labs/FLUX.2-klein-4B",
            "tiny-flux2",
            image(
                1024,
                1.0,
                4,
                **lora(targets=(*DEFAULT_LORA_TARGET_MODULES, "to_qkv_mlp_proj")),
                **{"model.max_sequence_length": 512},
            ),
        ),
        ModelPreset(
            "flux2-dev",
            "FLUX.2 [dev] (Flux2 transformer with a guidance embedding; Mistral3 text encoder)",
            "flow",
            "black-forest-labs/FLUX.2-dev",
            "tiny-flux2-dev",
            image(
                1024,
                4.0,
                28,
                **lora(targets=(*DEFAULT_LORA_TARGET_MODULES, "to_qkv_mlp_proj")),
                **{"model.guidance": 4.0, "model.max_sequence_length": 512},
            ),
        ),
    ),
)
