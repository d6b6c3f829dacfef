"""Gradium Phonon's card (torch-free): GradiumPhononTTSForConditionalGeneration folders, trained by the multi-codebook
core through the pieces of the class's own loss from `labels` (the LSD flow loss and the end-of-speech loss), as the
flow-head TTS card type counts them (dstune.families.flow_head_card). What differs from the type: the voice prompt is
not the audio tokenizer's latents but a speaker codec's (a Mimi encoder's unquantized latents, `audio_prompt_dim`
values per frame at 12.5 per second), a second frozen encoder outside the class, counted from its own config; and
one clip's activations come from the constants measured on the class itself as dstune trains it (the
"gradium-phonon" activation case in its builtin module: the backbone's blocks, and outside them the LSD flow head's
passes over each latent's noise draws), which the flow-head card type reads by the card's key."""

from __future__ import annotations

from dataclasses import dataclass

from dstune.card import ModelPreset, speech
from dstune.families.flow_head_card import FlowHeadTTSCard
from dstune.families.speakers import Voices
from dstune.memory.counts import SizesUnknown, config_folder


@dataclass(frozen=True, kw_only=True)
class GradiumPhononCard(FlowHeadTTSCard):
    speaker_codec_subfolder: str  # where a folder keeps the voice prompt's encoder (a MimiEncoderModel folder)
    speaker_codec_hub: str  # the Mimi encoder read where the folder holds none (the hub cache, never downloaded)
    speaker_codec_class: str  # the transformers class of that encoder

    def voices(self, model_spec, names) -> Voices:
        """Phonon hears a speaker through a voice prompt: each clip is given another clip of its own speaker,
        encoded by the speaker codec."""
        return Voices(
            self.name,
            f"each clip's voice prompt, another clip of its own speaker (up to {self.voice_seconds:g} s, the speaker "
            "codec's latents) before its text",
            {name: f"a clip of {name or 'the clips without a speaker'}" for name in names},
        )

    def speaker_codec_source(self, folder) -> str:
        """The speaker codec's folder or hub id: the folder's own subfolder, else the hub's Mimi."""
        own = folder / self.speaker_codec_subfolder
        return str(own) if (own / "config.json").is_file() else self.speaker_codec_hub

    def companion_configs(self, folder, config_origin: str) -> dict:
        source = self.speaker_codec_source(folder)
        try:
            speaker = config_folder(source)[0] / "config.json"
        except SizesUnknown as err:
            raise SizesUnknown(f"{config_origin}: the speaker codec (the voice prompt's encoder): {err}") from None
        return {**super().companion_configs(folder, config_origin), "speaker_codec": speaker}


GRADIUM_PHONON_CARD = GradiumPhononCard(
    key="gradium-phonon",
    name="Gradium Phonon",
    family="tts_codebooks",
    text_tokenizer="files",  # its folder's tokenizer.json
    unit="gradium_phonon",
    model_class="dstune.models.gradium_phonon.model:GradiumPhonon",
    docs="docs/tts.md",
    names=r"gradium.?phonon|phonon",
    summary="Gradium Phonon (GradiumPhononTTSForConditionalGeneration: a causal backbone over a speaker codec's voice "
    "prompt, the text and 12.5 Hz codec latents, with an LSD flow head; Gradium, 31 M parameters)",
    folder_classes={"GradiumPhononTTSForConditionalGeneration": 1.0},  # no classifier-free guidance
    architecture="GradiumPhononTTSForConditionalGeneration",
    takes_voice_prompts=True,
    codec_subfolder="audio_tokenizer",
    latents_kind="gradium_phonon_latents",
    voice_seconds=5.0,
    speaker_codec_subfolder="speaker_codec",
    speaker_codec_hub="kyutai/mimi",
    speaker_codec_class="MimiEncoderModel",
    builtins={"tiny-gradium-phonon": "dstune.models.gradium_phonon.builtin:TINY_GRADIUM_PHONON"},
    activation_cases="dstune.models.gradium_phonon.builtin:ACTIVATION_CASES",
    presets=(
        ModelPreset(
            "gradium-phonon",
            "Gradium Phonon (31 M: backbone + LSD flow head over its audio tokenizer's latents), full fine-tuning, "
            "a voice prompt per speaker",
            "tts_codebooks",
            "gradium/phonon-31m-en",
            "tiny-gradium-phonon",
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
