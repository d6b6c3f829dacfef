"""Sesame CSM's card (torch-free): CsmForConditionalGeneration folders, trained by the multi-codebook core through the
class's own loss. What validate and the memory plan know of it: its codec inside the class (Mimi, counted apart and
never trained) and one clip's activations.

The backbone sees one position per audio frame (plus the text), the depth decoder Q positions per frame, each started
from the backbone's hidden state. Their activations are the constants measured on CsmForConditionalGeneration itself
(the "csm" activation case in its builtin module, at CSM-1B's 32 codebooks and its depth decoder half the backbone's
width), evaluated at the folder's backbone width, layer counts and codebook vocabulary; they include the copy of the
depth decoder's per-codebook heads that each forward gathers and keeps for backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dstune.card import LM_LORA_TARGET_MODULES, ModelPreset, lora, speech
from dstune.families.codebooks_card import CodebooksCard
from dstune.families.speakers import Voices
from dstune.memory.activations import (
    TEXT_TOKENS_PER_SECOND,
    ModelShape,
    codec_frame_rate,
    in_plan_units,
    measured_sample_bytes,
)
from dstune.memory.plan import ModelCounts

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds


def mimi_frame_rate(codec_config: dict) -> float:
    """Frames per second of the codec; Mimi halves its convolutions' rate with a last stride-2 downsampling
    (24 kHz / (8 * 6 * 5 * 4 * 2) = 12.5 Hz), which its config does not store."""
    if codec_config.get("model_type") == "mimi" and not codec_config.get("frame_rate"):
        hop = 2
        for ratio in codec_config.get("upsampling_ratios", [8, 6, 5, 4]):
            hop *= ratio
        return codec_config.get("sampling_rate", 24000) / hop
    return codec_frame_rate(codec_config)


@dataclass(frozen=True, kw_only=True)
class CsmCard(CodebooksCard):
    codec_config_key: str  # where config.json keeps the codec's config
    codec_kind: str  # dstune.families.speech_codecs' name for its codec
    default_speaker: str  # CSM's prompts name a speaker ("[0]Hello."); clips without one are this speaker

    def codec_inside(self) -> Optional[str]:
        return "codec_model"

    def voices(self, model_spec, names) -> Voices:
        """CSM's speakers are numbers: the data's speakers take 0, 1, 2 ... in their order."""
        return Voices(
            self.name,
            "speaker id N, each clip's text written [N]text as its chat template writes a turn of role N",
            {name: str(number) for number, name in enumerate(names)},
        )

    def count_model(self, spec, num_samples: int, folder, origin: str, config: dict, counted: tuple) -> ModelCounts:
        params, largest, lora_params, default_lora, codec = counted
        frame_rate = mimi_frame_rate(config.get(self.codec_config_key) or {})
        codebooks = int(config.get("num_codebooks", 32))
        seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
        frames = seconds * frame_rate + 1  # the EOS frame
        depth = config.get("depth_decoder_config") or {}
        layers = {"backbone": config["num_hidden_layers"], "depth": depth.get("num_hidden_layers", 4)}
        shape = ModelShape(config["hidden_size"], layers, vocab=config["vocab_size"])
        sample = measured_sample_bytes("csm", shape, frames, seconds * TEXT_TOKENS_PER_SECOND, spec.train.precision)
        full, checkpointed = in_plan_units(sample, spec.train.precision)
        cached = ("codec",) if spec.data.cache.codec_tokens else ()
        cache_bytes = int(4 * frame_rate * codebooks * seconds * num_samples) if spec.data.cache.codec_tokens else 0
        return ModelCounts(
            "model",
            params,
            lora_params or params,
            largest,
            {"codec": codec},
            cached,
            int(full),
            int(checkpointed),
            default_lora,
            cache_bytes,
            origin,
        )


CSM_CARD = CsmCard(
    key="csm",
    name="Sesame CSM",
    family="tts_codebooks",
    text_tokenizer="files",  # its folder's tokenizer.json (Llama 3's byte-level BPE)
    unit="csm",
    model_class="dstune.models.csm.model:Csm",
    docs="docs/tts.md",
    names=r"csm|sesame",
    summary="Sesame CSM (CsmForConditionalGeneration: a backbone over text and Mimi frames, a depth decoder over "
    "each frame's codebooks)",
    folder_classes={"CsmForConditionalGeneration": None},  # its generate has no classifier-free guidance
    architecture="CsmForConditionalGeneration",
    codec_config_key="codec_config",
    codec_kind="mimi",
    default_speaker="0",
    activation_cases="dstune.models.csm.builtin:ACTIVATION_CASES",
    builtins={"tiny-csm": "dstune.models.csm.builtin:TINY_CSM"},
    presets=(
        ModelPreset(
            "csm",
            "Sesame CSM 1B (backbone + depth decoder over 32 Mimi codebooks), LoRA on both",
            "tts_codebooks",
            "sesame/csm-1b",
            "tiny-csm",
            speech(
                **lora(16, LM_LORA_TARGET_MODULES),
                **{"model.gradient_checkpointing": True, "data.cache.codec_tokens": True},
            ),
            gpu_memory="24GB",
        ),
    ),
)
