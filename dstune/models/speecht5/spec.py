"""The `model` section of SpeechT5 text-to-speech (`model.family speecht5`), listed in the spec's union by
dstune.registry.FAMILY_SECTIONS. Torch-free."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from dstune.spec.section import Section


class SpeechT5ModelSpec(Section):
    modality: ClassVar[str] = "audio"  # what the data is (dstune.spec.models.VIDEO_FAMILIES, AUDIO_FAMILIES)
    MODEL_FOLDER_FIELDS: ClassVar[tuple[str, ...]] = ("pretrained",)
    COMPANION_FOLDERS: ClassVar[dict[str, str]] = {"vocoder": "vocoder"}
    FILE_FIELDS: ClassVar[tuple[str, ...]] = ("speaker_embeddings",)
    family: Literal["speecht5"] = Field(
        description="Model family. `speecht5`: SpeechT5ForTextToSpeech (text -> log-mel, L1 + stop-token loss), "
        "with a SpeechT5HifiGan vocoder for samples. See docs/tts.md."
    )
    pretrained: str = Field(
        "builtin:tiny-speecht5",
        description="A SpeechT5 TTS folder (config.json + weights + processor files; `vocoder/` optional), a hub id "
        "already in the local Hugging Face cache, or `builtin:tiny-speecht5` (a tiny model built offline).",
    )
    vocoder: Optional[str] = Field(
        None, description="SpeechT5HifiGan folder or hub id (already downloaded). Omitted: `<pretrained>/vocoder`."
    )
    speaker_embeddings: Optional[str] = Field(
        None,
        description="A safetensors file of speaker vectors (one tensor per speaker name, the model's "
        "speaker_embedding_dim; `default` for clips without a speaker). Omitted: every clip uses one fixed vector.",
    )
    max_sample_seconds: float = Field(
        3.0, gt=0, description="Samples during training: the longest audio generated per prompt, in seconds."
    )
