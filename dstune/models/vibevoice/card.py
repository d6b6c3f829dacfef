"""VibeVoice's card (torch-free): VibeVoiceForConditionalGeneration folders in the transformers layout, trained by the
multi-codebook core through the class's own loss. What the memory plan knows of it: the class's trained part counted
without its two speech tokenizers (frozen, inside the class, counted apart, with the acoustic tokenizer's copy that
encodes the clips), and one clip's activations: the Qwen2 LM over the script's tokens and one position per acoustic
latent (7.5 per second), plus the diffusion head run on several noise draws per latent, from the constants measured
on VibeVoiceForConditionalGeneration itself as dstune trains it (the "vibevoice" activation case in its builtin
module: the head at the LM's width with its 4 layers, as VibeVoice-1.5B) at the folder's LM width, MLP width,
vocabulary and layers."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from dstune.card import LM_LORA_TARGET_MODULES, ModelPreset, lora, speech
from dstune.families.codebooks_card import CodebooksCard
from dstune.families.speakers import Voices
from dstune.hf import quiet_hf_libraries
from dstune.memory.activations import TEXT_TOKENS_PER_SECOND, ModelShape, in_plan_units, measured_sample_bytes
from dstune.memory.counts import SizesUnknown
from dstune.memory.plan import ModelCounts

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds
PROMPT_TOKENS = 40  # the chat template's system prompt and section headers
SCRIPT_LINE = re.compile(r"^\s*Speaker\s+(\d+)\s*:\s*(.*)$")  # a script's turn: "Speaker N: text"


def _hop(audio: dict) -> int:
    hop = 1
    for ratio in audio.get("downsampling_ratios") or (2, 2, 4, 5, 5, 8):
        hop *= int(ratio)
    return hop


@lru_cache(maxsize=8)
def _tokenizer_params(config_text: str) -> tuple[int, int]:
    """(acoustic tokenizer (encoder + decoder), semantic encoder) parameters, on the meta device."""
    import torch
    import transformers

    config = json.loads(config_text)
    counts = []
    for key in ("audio_config", "semantic_model_config"):
        with quiet_hf_libraries(), torch.device("meta"):
            part = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(**config[key]))
        counts.append(sum(p.numel() for p in part.parameters()))
    return counts[0], counts[1]


@dataclass(frozen=True, kw_only=True)
class VibeVoiceCard(CodebooksCard):
    latents_kind: str  # the codec cache's kind: the acoustic tokenizer's float latents per frame
    default_speaker: str  # the speaker of a transcript without "Speaker N:" lines and a numbered speaker
    noise_draws: int  # the diffusion's noise draws per latent (the class's default, and the original trainer's)
    latent_factors: tuple[str, ...]  # the tokenizer's latent statistics: set with it, never learnt

    def voices(self, model_spec, names) -> Voices:
        """VibeVoice's speakers are numbered script lines: the data's speakers take 0, 1, 2 ... in their order."""
        return Voices(
            self.name,
            'speaker N, each clip\'s script line "Speaker N: text" (a transcript of Speaker N: lines keeps its own)',
            {name: str(number) for number, name in enumerate(names)},
        )

    def takes_speaker(self, text: str) -> bool:
        """A transcript of "Speaker N: ..." lines is a script that names its own turns."""
        return not any(SCRIPT_LINE.match(line) for line in text.strip().splitlines())

    def frozen_parts(self) -> tuple[str, ...]:
        """The speech tokenizers, the semantic connector (only generate uses it: the class's training forward
        embeds the acoustic latents alone, so no gradient reaches it) and the latent statistics."""
        parts = ("model.audio_tower", "model.semantic_tokenizer_encoder", "model.semantic_connector")
        return parts + tuple(f"model.{name}" for name in self.latent_factors)

    def config_problem(self, config: dict) -> Optional[str]:
        """microsoft/VibeVoice-1.5B ships the original layout, which VibeVoiceConfig does not read: it would build a
        default-sized model and load none of the weights."""
        if "decoder_config" in config and "text_config" not in config:
            return (
                "its config.json is in the original VibeVoice layout (decoder_config, acoustic_tokenizer_config), "
                "which transformers' VibeVoiceForConditionalGeneration does not read; use a folder converted to the "
                "transformers layout (text_config, audio_config), as bezzam/VibeVoice-1.5B-hf"
            )
        return None

    def count_model(self, spec, num_samples: int, folder, origin: str, config: dict, counted: tuple) -> ModelCounts:
        params, largest, lora_params, default_lora, _ = counted
        if self.config_problem(config):
            raise SizesUnknown(f"{origin}: {self.config_problem(config)}")
        try:
            audio, text = config["audio_config"], config["text_config"]
        except KeyError as err:
            raise SizesUnknown(f"{origin}: config.json has no {err}") from None
        acoustic, semantic = _tokenizer_params(json.dumps(config, sort_keys=True))
        trained = params - acoustic - semantic  # the tokenizers stay frozen inside the class
        frame_rate = 24000 / _hop(audio)
        seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
        shape = ModelShape(
            text["hidden_size"],
            {"lm": text["num_hidden_layers"]},
            ffn=text["intermediate_size"],
            vocab=text["vocab_size"],
        )
        script = seconds * TEXT_TOKENS_PER_SECOND + PROMPT_TOKENS
        sample = measured_sample_bytes("vibevoice", shape, seconds * frame_rate, script, spec.train.precision)
        lm = in_plan_units(sample, spec.train.precision)
        cached = ("codec",) if spec.data.cache.codec_tokens else ()
        latent = int(audio.get("hidden_size", 64))
        cache_bytes = int(4 * frame_rate * latent * seconds * num_samples) if spec.data.cache.codec_tokens else 0
        return ModelCounts(
            "model",
            trained,
            lora_params or trained,
            largest,
            # the acoustic tokenizer's fp32 copy that encodes the clips (the cache replaces it), and both tokenizers
            # frozen inside the class (generate decodes and re-encodes with them)
            {"codec": acoustic, "tokenizers": acoustic + semantic},
            cached,
            int(lm[0]),
            int(lm[1]),
            default_lora,
            cache_bytes,
            origin,
        )


VIBEVOICE_CARD = VibeVoiceCard(
    key="vibevoice",
    name="VibeVoice",
    family="tts_codebooks",
    text_tokenizer="files",  # its folder's tokenizer.json (Qwen2.5's byte-level BPE)
    unit="vibevoice",
    model_class="dstune.models.vibevoice.model:VibeVoice",
    docs="docs/tts.md",
    names=r"vibevoice|vibe_voice",
    summary="VibeVoice (VibeVoiceForConditionalGeneration, transformers layout: next-token diffusion over 7.5 Hz "
    "acoustic latents, Speaker N: scripts)",
    # its generation_config's classifier-free guidance (VibeVoice-1.5B: 1.3)
    folder_classes={"VibeVoiceForConditionalGeneration": 1.3},
    architecture="VibeVoiceForConditionalGeneration",
    takes_voice_prompts=True,
    latents_kind="vibevoice_latents",
    default_speaker="0",
    noise_draws=4,
    latent_factors=("latent_scaling_factor", "latent_bias_factor"),
    activation_cases="dstune.models.vibevoice.builtin:ACTIVATION_CASES",
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
            gpu_memory="24GB",
        ),
    ),
)
