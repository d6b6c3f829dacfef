"""Dia's card (torch-free): DiaForConditionalGeneration folders, trained by the multi-codebook core through the
class's own loss. What the memory plan knows of it: the class counted without its DAC (which the processor names,
outside the class), the DAC counted from its own config, and one clip's activations: the encoder over the
transcript's bytes, the decoder one position per DAC frame (plus BOS, EOS and the delay pattern's longest delay)
with logits over every codebook's ids at once, from the constants measured on DiaForConditionalGeneration itself (the
"dia" activation case in its builtin module, at Dia-1.6B's 9 channels and its encoder half the decoder's width) at
the folder's decoder width, layer counts and code vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

from dstune.card import LM_LORA_TARGET_MODULES, ModelPreset, lora, speech
from dstune.families.codebooks_card import CodebooksCard, processor_codec_config
from dstune.families.speakers import SpeakersRefused, Voices, shown
from dstune.memory.activations import (
    TEXT_TOKENS_PER_SECOND,
    ModelShape,
    codec_frame_rate,
    in_plan_units,
    measured_sample_bytes,
)
from dstune.memory.counts import count_component, read_config
from dstune.memory.plan import ModelCounts

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds


@dataclass(frozen=True, kw_only=True)
class DiaCard(CodebooksCard):
    codec_subfolder: str  # where dstune's built-in and stored Dia folders keep the DAC (its config)
    # dstune.families.speech_codecs' name for its codec: DAC on the clip zero-padded to a multiple of its hop
    codec_kind: str
    speaker_tags: tuple[str, ...]  # its dialogue turns; a text must start with one

    def voices(self, model_spec, names) -> Voices:
        """Dia's dialogue has a tag per voice ([S1], [S2]): the data's speakers take them in their order; a third
        speaker has none."""
        tags = self.speaker_tags
        if len(names) > len(tags):
            raise SpeakersRefused(
                "data.path",
                f"the data names {len(names)} speakers ({shown(names)}), but {self.name} has {len(tags)} voices, "
                f"{' and '.join(tags)}, so a third speaker cannot be told apart. Train {len(tags)} speakers per run (a "
                f".list or metadata.jsonl of their clips), or set data.speakers: blend to train every clip as "
                f"{tags[0]} (docs/tts.md, Speakers).",
            )
        return Voices(
            self.name,
            "each clip's transcript starts with its speaker's tag (a transcript that starts with a tag keeps its own)",
            dict(zip(names, tags)),
        )

    def takes_speaker(self, text: str) -> bool:
        """A transcript that starts with a tag is a dialogue that names its own turns."""
        return not text.strip().startswith(self.speaker_tags)

    def codec_config_path(self, folder, config_origin: str):
        """The DAC config.json a Dia folder uses (dstune.families.codebooks_card.processor_codec_config)."""
        return processor_codec_config(folder, self.codec_subfolder, config_origin, "the DAC")

    def count_model(self, spec, num_samples: int, folder, origin: str, config: dict, counted: tuple) -> ModelCounts:
        params, largest, lora_params, default_lora, _ = counted
        codec_path = self.codec_config_path(folder, origin)
        codec_config = read_config(codec_path)
        codec_params = count_component(str(codec_path))[0]
        decoder, encoder = config["decoder_config"], config["encoder_config"]
        channels, frame_rate = int(decoder["num_channels"]), codec_frame_rate(codec_config)
        seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
        positions = seconds * frame_rate + 2 + max(config.get("delay_pattern") or [0])  # BOS, EOS, the delay
        shape = ModelShape(
            decoder["hidden_size"],
            {"encoder": encoder["num_hidden_layers"], "decoder": decoder["num_hidden_layers"]},
            vocab=decoder["vocab_size"],
        )
        text = seconds * TEXT_TOKENS_PER_SECOND
        full, checkpointed = in_plan_units(
            measured_sample_bytes("dia", shape, positions, text, spec.train.precision), spec.train.precision
        )
        cached = ("codec",) if spec.data.cache.codec_tokens else ()
        cache_bytes = int(4 * frame_rate * channels * seconds * num_samples) if spec.data.cache.codec_tokens else 0
        return ModelCounts(
            "model",
            params,
            lora_params or params,
            largest,
            {"codec": codec_params},
            cached,
            full,
            checkpointed,
            default_lora,
            cache_bytes,
            origin,
        )


DIA_CARD = DiaCard(
    key="dia",
    name="Dia",
    family="tts_codebooks",
    text_tokenizer="utf8",  # DiaTokenizer: the transcript's UTF-8 bytes
    unit="dia",
    model_class="dstune.models.dia.model:Dia",
    docs="docs/tts.md",
    names=r"dia|nari",
    summary="Dia (DiaForConditionalGeneration: a byte-level text encoder, an audio decoder over the DAC codebooks "
    "with a delay pattern; [S1]/[S2] dialogue)",
    # its generation_config's classifier-free guidance (Dia-1.6B: 3.0)
    folder_classes={"DiaForConditionalGeneration": 3.0},
    architecture="DiaForConditionalGeneration",
    takes_voice_prompts=True,
    codec_subfolder="audio_tokenizer",
    codec_kind="dac_hop_padded",
    speaker_tags=("[S1]", "[S2]"),
    activation_cases="dstune.models.dia.builtin:ACTIVATION_CASES",
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
            gpu_memory="24GB",
        ),
    ),
)
