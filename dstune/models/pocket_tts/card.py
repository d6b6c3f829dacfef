"""Pocket TTS's card (torch-free): PocketTTSForConditionalGeneration folders, trained by the multi-codebook core
through the pieces of the class's own loss from `labels` (the LSD flow loss and the end-of-speech loss). What the
memory plan knows of it: the class counted without its audio tokenizer (which the processor names, outside the
class), the audio tokenizer counted from its own config, and one clip's activations from the measured constants (the
"pocket_tts" activation case on the class itself as dstune trains it, with the self-distillation term, so the
step that holds the most): the backbone over the voice prompt, the text and one position per latent (12.5 per
second), and the flow head's draws per latent."""

from __future__ import annotations

from dataclasses import dataclass

from dstune.families.speakers import Voices
from dstune.card import ModelPreset, speech
from dstune.families.codebooks_card import CodebooksCard
from dstune.memory.activations import (
    TEXT_TOKENS_PER_SECOND,
    ModelShape,
    codec_frame_rate,
    in_plan_units,
    measured_sample_bytes,
)
from dstune.memory.counts import SizesUnknown, config_folder, count_component, read_config
from dstune.memory.plan import ModelCounts

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds


@dataclass(frozen=True, kw_only=True)
class PocketTTSCard(CodebooksCard):
    codec_subfolder: str  # where dstune's built-in and stored folders keep the audio tokenizer (its config)
    latents_kind: str  # the codec cache's kind: the audio tokenizer's float latents per frame
    voice_seconds: float  # the longest voice prompt a training utterance is given (its reference clip's start)

    def voices(self, model_spec, names) -> Voices:
        """Pocket TTS hears a speaker through a voice prompt: each clip is given another clip of its own speaker."""
        return Voices(
            self.name,
            "each clip's voice prompt, another clip of its own speaker (up to 5 s) before its text",
            {name: f"a clip of {name or 'the clips without a speaker'}" for name in names},
        )

    def codec_config_path(self, folder, config_origin: str):
        """The audio tokenizer's config.json: the codec subfolder (dstune's stored and built-in folders), else what
        processor_config.json names (a folder, or a hub id found by config_folder)."""
        own = folder / self.codec_subfolder / "config.json"
        if own.is_file():
            return own
        processor = folder / "processor_config.json"
        named = (
            (read_config(processor).get("audio_tokenizer") or {}).get("audio_tokenizer_name_or_path")
            if processor.is_file()
            else None
        )
        if not named:
            raise SizesUnknown(
                f"{config_origin}: no {self.codec_subfolder}/config.json and no audio tokenizer named in "
                "processor_config.json, so the audio tokenizer cannot be counted"
            )
        return config_folder(named)[0] / "config.json"

    def count_model(self, spec, num_samples: int, folder, origin: str, config: dict, counted: tuple) -> ModelCounts:
        params, _, lora_params, default_lora, _ = counted
        codec_path = self.codec_config_path(folder, origin)
        codec_config = read_config(codec_path)
        codec_params = count_component(str(codec_path))[0]
        frame_rate = float(config.get("frame_rate") or codec_frame_rate(codec_config))
        seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
        shape = ModelShape(
            int(config.get("hidden_size", 1024)),
            {"backbone": int(config.get("num_hidden_layers", 6))},
            ffn=int(config.get("intermediate_size", 4096)),
        )
        # the backbone's other positions: the voice prompt's latents and the text
        context = min(seconds, self.voice_seconds) * frame_rate + seconds * TEXT_TOKENS_PER_SECOND
        sample = measured_sample_bytes("pocket_tts", shape, seconds * frame_rate, context, spec.train.precision)
        full, checkpointed = in_plan_units(sample, spec.train.precision)
        latent = int(config.get("latent_dim", 32))
        cached = ("codec",) if spec.data.cache.codec_tokens else ()
        cache_bytes = int(4 * frame_rate * latent * seconds * num_samples) if spec.data.cache.codec_tokens else 0
        return ModelCounts(
            "model",
            params,
            lora_params or params,
            params,  # ZeRO-3 gathers the whole class at once (a leaf module: the flow head's JVP)
            {"codec": codec_params},
            cached,
            int(full),
            int(checkpointed),
            default_lora,
            cache_bytes,
            origin,
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
