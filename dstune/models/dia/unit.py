"""The Dia unit (multi-codebook TTS with a delay pattern, trained by the tts_codebooks family through its
transformers class): what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import LM_LORA_TARGET_MODULES, ModelPreset, ModelUnit, lora, speech

UNIT = ModelUnit(
    name="dia",
    title="Dia (multi-codebook TTS with a delay pattern, [S1]/[S2] dialogue, through its transformers class)",
    docs="docs/tts.md",
    names=r"dia|nari",
    recipes={"tts_codebooks": ("dstune.models.dia.facts:CODEBOOKS_MODEL",)},
    # the class the family trains of it, with its generation_config's classifier-free guidance (Dia-1.6B: 3.0)
    pipelines={"DiaForConditionalGeneration": 3.0},
    activation_cases=("dstune.models.dia.builtin:ACTIVATION_CASES",),
    builtins={"tiny-dia": "dstune.models.dia.builtin:TINY_DIA"},
    presets=(
        ModelPreset(
            "dia",
            "Dia 1.6B (text encoder + audio decoder over 9 DAC 44.1 kHz codebooks, delay pattern), LoRA "
            "on its attention",
            "tts_codebooks",
            "nari-labs/Dia-1.6B-0626",
            "tiny-dia",
            speech(
                **lora(16, LM_LORA_TARGET_MODULES),
                **{
                    "model.gradient_checkpointing": True,
                    "model.sample_temperature": 1.8,
                    "data.cache.codec_tokens": True,
                    "data.max_clip_seconds": 20.0,
                    "sample.prompts": [
                        "[S1] Printing, in the only sense with which we are at present concerned. "
                        "[S2] The quick brown fox."
                    ],
                },
            ),
        ),
    ),
)
