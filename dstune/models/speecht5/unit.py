"""The SpeechT5 TTS (mel frames, HiFi-GAN vocoder) unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, speech

UNIT = ModelUnit(
    name="speecht5",
    title="SpeechT5 TTS (mel frames, HiFi-GAN vocoder)",
    docs="docs/tts.md",
    names=r"speecht5",
    spec_sections=("dstune.models.speecht5.spec:SpeechT5ModelSpec",),
    families={"speecht5": "dstune.models.speecht5.family"},
    facts=("dstune.models.speecht5.facts:FACTS",),
    activation_cases=("dstune.models.speecht5.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-speecht5": "dstune.models.speecht5.builtin:TINY_SPEECHT5",
    },
    presets=(
        ModelPreset(
            "speecht5",
            "SpeechT5 TTS (encoder-decoder to mel frames, HiFi-GAN vocoder)",
            "speecht5",
            "microsoft/speecht5_tts",
            "tiny-speecht5",
            speech(**{"model.vocoder": "microsoft/speecht5_hifigan", "train.optimizer.lr": 1.0e-5}),
        ),
    ),
)
