"""The Sesame CSM (multi-codebook TTS through its transformers class) unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import LM_LORA_TARGET_MODULES, ModelPreset, ModelUnit, lora, speech

UNIT = ModelUnit(
    name="csm",
    title="Sesame CSM (multi-codebook TTS through its transformers class)",
    docs="docs/tts.md",
    names=r"csm|sesame",
    spec_sections=("dstune.models.csm.spec:CodebooksModelSpec",),
    families={"tts_codebooks": "dstune.models.csm.family"},
    facts=("dstune.models.csm.facts:FACTS",),
    activation_cases=("dstune.models.csm.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-csm": "dstune.models.csm.builtin:TINY_CSM",
    },
    presets=(
        ModelPreset(
            "csm",
            "Sesame CSM 1B (backbone + depth decoder over 32 Mimi codebooks), LoRA on both",
            "tts_codebooks",
            "sesame/csm-1b",
            "tiny-csm",
            speech(
                **lora(16, LM_LORA_TARGET_MODULES),
                **{"model.gradient_checkpointing": True, "data.cache.codec_tokens": True},
            ),
        ),
    ),
)
