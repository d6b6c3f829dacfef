"""Pocket TTS's card (torch-free): PocketTTSForConditionalGeneration folders, trained by the multi-codebook core
through the pieces of the class's own loss from `labels` (the LSD flow loss and the end-of-speech loss). What the
memory plan knows of it is the flow-head TTS card type's (dstune.families.flow_head_card): the class counted without
its audio tokenizer (which the processor names, outside the class), the audio tokenizer counted from its own config,
and one clip's activations from the constants measured on the class itself (the "pocket-tts" activation case, trained
with the self-distillation term, so the step that holds the most)."""

from __future__ import annotations

from dataclasses import dataclass

from dstune.card import ModelPreset, speech
from dstune.families.flow_head_card import FlowHeadTTSCard
from dstune.families.speakers import Voices


@dataclass(frozen=True, kw_only=True)
class PocketTTSCard(FlowHeadTTSCard):
    def voices(self, model_spec, names) -> Voices:
        """Pocket TTS hears a speaker through a voice prompt: each clip is given another clip of its own speaker."""
        return Voices(
            self.name,
            "each clip's voice prompt, another clip of its own speaker (up to 5 s) before its text",
            {name: f"a clip of {name or 'the clips without a speaker'}" for name in names},
        )


POCKET_TTS_CARD = PocketTTSCard(
    key="pocket-tts",
    name="Pocket TTS",
    family="tts_codebooks",
    text_tokenizer="files",  # its folder's tokenizer.json (a SentencePiece vocabulary with <unk>)
    unit="pocket_tts",
    model_class="dstune.models.pocket_tts.model:PocketTTS",
    docs="docs/tts.md",
    names=r"pocket.?tts",
    summary="Pocket TTS (PocketTTSForConditionalGeneration: a causal backbone over a voice prompt, the text and "
    "12.5 Hz codec latents, with an LSD flow head; Kyutai, about 100 M parameters)",
    folder_classes={"PocketTTSForConditionalGeneration": 1.0},  # no classifier-free guidance
    architecture="PocketTTSForConditionalGeneration",
    takes_voice_prompts=True,
    codec_subfolder="audio_tokenizer",
    latents_kind="pocket_tts_latents",
    voice_seconds=5.0,
    activation_cases="dstune.models.pocket_tts.builtin:ACTIVATION_CASES",
    builtins={"tiny-pocket-tts": "dstune.models.pocket_tts.builtin:TINY_POCKET_TTS"},
    presets=(
        ModelPreset(
            "pocket-tts",
            "Pocket TTS (about 100 M: backbone + LSD flow head over its audio tokenizer's latents), full "
            "fine-tuning, a voice prompt per speaker",
            "tts_codebooks",
            "eustlb/pocket-tts",  # the transformers-layout checkpoint transformers' PocketTTSConfig names
            "tiny-pocket-tts",
            speech(
                **{
                    "model.sample_temperature": 0.7,
                    "data.cache.codec_tokens": True,
                    "data.max_clip_seconds": 20.0,
                    "train.optimizer.lr": 5.0e-5,
                },
            ),
        ),
    ),
)
