"""The VibeVoice unit (an LM whose hidden state conditions a diffusion head over continuous acoustic latents,
trained by the tts_codebooks family through its transformers class): what dstune.models.registry lists of it.
Torch-free."""

from __future__ import annotations

from dstune.models.unit import LM_LORA_TARGET_MODULES, ModelPreset, ModelUnit, lora, speech

UNIT = ModelUnit(
    name="vibevoice",
    title="VibeVoice (next-token diffusion over 7.5 Hz acoustic latents, Speaker N: scripts, through its "
    "transformers class)",
    docs="docs/tts.md",
    names=r"vibevoice|vibe_voice",
    recipes={"tts_codebooks": ("dstune.models.vibevoice.facts:CODEBOOKS_MODEL",)},
    # the class the family trains of it, with its generation_config's classifier-free guidance (VibeVoice-1.5B: 1.3)
    pipelines={"VibeVoiceForConditionalGeneration": 1.3},
    activation_cases=("dstune.models.vibevoice.builtin:ACTIVATION_CASES",),
    builtins={"tiny-vibevoice": "dstune.models.vibevoice.builtin:TINY_VIBEVOICE"},
    presets=(
        ModelPreset(
            "vibevoice",
            "VibeVoice 1.5B (Qwen2.5-1.5B LM + diffusion head over the acoustic tokenizer's latents), LoRA on "
            "the LM's attention",
            "tts_codebooks",
            "bezzam/VibeVoice-1.5B-hf",  # microsoft/VibeVoice-1.5B in the transformers layout
            "tiny-vibevoice",
            speech(
                **lora(16, LM_LORA_TARGET_MODULES),
                **{
                    "model.gradient_checkpointing": True,
                    "data.cache.codec_tokens": True,
                    "data.max_clip_seconds": 30.0,
                    "sample.prompts": [
                        "Speaker 0: Printing, in the only sense with which we are at present concerned.\n"
                        "Speaker 1: The quick brown fox."
                    ],
                },
            ),
        ),
    ),
)
