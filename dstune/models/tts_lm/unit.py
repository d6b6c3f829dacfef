"""The Codec-token TTS language models (Llama + EnCodec / DAC / SNAC; Orpheus) unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import LM_LORA_TARGET_MODULES, ModelPreset, ModelUnit, lora, speech

UNIT = ModelUnit(
    name="tts_lm",
    title="Codec-token TTS language models (Llama + EnCodec / DAC / SNAC; Orpheus)",
    docs="docs/tts.md",
    names=r"orpheus\w*",
    spec_sections=("dstune.models.tts_lm.spec:TtsLmModelSpec",),
    families={"tts_lm": "dstune.models.tts_lm.family"},
    facts=("dstune.models.tts_lm.facts:FACTS",),
    activation_cases=("dstune.models.tts_lm.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-tts-lm": "dstune.models.tts_lm.builtin:TINY_TTS_LM",
        "tiny-orpheus": "dstune.models.tts_lm.builtin_orpheus:TINY_ORPHEUS",
    },
    presets=(
        ModelPreset(
            "llama-tts",
            "Llama-3.2-1B learning speech as EnCodec 24 kHz tokens (4 codebooks)",
            "tts_lm",
            "meta-llama/Llama-3.2-1B",
            "tiny-tts-lm",
            speech(
                **{
                    "model.codec": "encodec",
                    "model.codec_pretrained": "facebook/encodec_24khz",
                    "model.num_codebooks": 4,
                    "model.gradient_checkpointing": True,
                    "data.cache.codec_tokens": True,
                }
            ),
        ),
        ModelPreset(
            "orpheus",
            "Orpheus 3B TTS (Llama with SNAC 24 kHz tokens), LoRA on its attention",
            "tts_lm",
            "canopylabs/orpheus-3b-0.1-ft",
            "tiny-orpheus",
            speech(
                **lora(16, LM_LORA_TARGET_MODULES),
                **{
                    "model.codec": "snac",
                    "model.token_layout": "orpheus",
                    "model.codec_pretrained": "hubertsiuzdak/snac_24khz",
                },
            ),
        ),
    ),
)
