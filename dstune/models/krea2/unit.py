"""The Krea 2 Raw and Turbo unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, image, lora

# the Krea 2 training example's default LoRA layers (its authors' recommendation): attention with its gate, the MLP,
# the image and text input projections, the text fusion's projector, the timestep MLP and modulation, the output
KREA2_LORA_TARGETS = (
    "img_in",
    "final_layer.linear",
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "to_gate",
    "ff.up",
    "ff.down",
    "text_fusion.projector",
    "txt_in.linear_1",
    "txt_in.linear_2",
    "time_embed.linear_1",
    "time_embed.linear_2",
    "time_mod_proj",
)

UNIT = ModelUnit(
    name="krea2",
    title="Krea 2 Raw and Turbo",
    docs="docs/family-flow.md",
    names=r"krea\w*",
    recipes={"flow": ("dstune.models.krea2.recipe:KREA2",)},
    flow_models=("dstune.models.krea2.facts:FLOW_MODELS",),
    summary="Krea 2 Raw and Turbo (Krea2Transformer2DModel; Qwen3-VL)",
    pipelines={"Krea2Pipeline": 4.5},
    distilled_guidance={"Krea2Pipeline": 0.0},
    spec_notes={"model.max_sequence_length": "512 (Krea 2)"},
    activation_cases=("dstune.models.krea2.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-krea2": "dstune.models.krea2.builtin:TINY_KREA2",
        "tiny-krea2-turbo": "dstune.models.krea2.builtin:TINY_KREA2_TURBO",
    },
    presets=(
        ModelPreset(
            "krea2",
            "Krea 2 Raw (12 B single-stream transformer; Qwen3-VL text encoder; the base to train)",
            "flow",
            "krea/Krea-2-Raw",
            "tiny-krea2",
            image(
                1024,
                4.5,
                28,
                **{
                    **lora(targets=KREA2_LORA_TARGETS),
                    "train.optimizer.lr": 3.0e-4,
                    "model.gradient_checkpointing": True,
                    "model.max_sequence_length": 512,
                },
            ),
        ),
        ModelPreset(
            "krea2-turbo",
            "Krea 2 Turbo (Krea 2 distilled to 8 steps without guidance)",
            "flow",
            "krea/Krea-2-Turbo",
            "tiny-krea2-turbo",
            image(
                1024,
                0.0,
                8,
                **lora(targets=KREA2_LORA_TARGETS),
                **{"model.gradient_checkpointing": True, "model.max_sequence_length": 512},
            ),
        ),
    ),
)
