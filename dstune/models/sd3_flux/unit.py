"""The SD3 and FLUX.1 (flow-matching MMDiT) unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, image, lora

UNIT = ModelUnit(
    name="sd3_flux",
    title="SD3 and FLUX.1 (flow-matching MMDiT)",
    docs="docs/family-flow.md",
    names=r"sd3|flux(?![.\s-]?2)|flux\.1",
    recipes={"flow": ("dstune.models.sd3_flux.recipe:SD3", "dstune.models.sd3_flux.recipe:FLUX")},
    flow_models=("dstune.models.sd3_flux.facts:FLOW_MODELS",),
    summary="SD3-class (SD3Transformer2DModel; CLIP x2 + T5), Flux-class (FluxTransformer2DModel; CLIP + T5)",
    pipelines={"StableDiffusion3Pipeline": 7.0, "FluxPipeline": 3.5},
    spec_notes={"model.max_sequence_length": "77 (SD3-class) / 512 (Flux-class)"},
    activation_cases=("dstune.models.sd3_flux.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-flow": "dstune.models.sd3_flux.builtin:TINY_FLOW",
        "tiny-flux": "dstune.models.sd3_flux.builtin:TINY_FLUX",
    },
    checkpoint_layouts={
        "model.diffusion_model.joint_blocks.": (
            "flow",
            "an SD3 checkpoint (model.family flow, from its diffusers folder)",
        ),
        "double_blocks.": ("flow", "a Flux checkpoint (model.family flow, from its diffusers folder)"),
        "model.diffusion_model.double_blocks.": (
            "flow",
            "a Flux checkpoint (model.family flow, from its diffusers folder)",
        ),
    },
    presets=(
        ModelPreset(
            "sd3",
            "Stable Diffusion 3 Medium (SD3 MMDiT; CLIP x2 + T5)",
            "flow",
            "stabilityai/stable-diffusion-3-medium-diffusers",
            "tiny-flow",
            image(1024, 7.0, 28, **lora(), **{"model.precondition_outputs": True, "model.max_sequence_length": 77}),
        ),
        ModelPreset(
            "flux",
            "FLUX.1 [dev] (Flux transformer with a guidance embedding; CLIP + T5)",
            "flow",
            "black-forest-labs/FLUX.1-dev",
            "tiny-flux",
            image(1024, 3.5, 28, **lora(), **{"model.guidance": 1.0, "model.max_sequence_length": 512}),
        ),
    ),
)
