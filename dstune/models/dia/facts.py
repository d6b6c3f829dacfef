"""Dia's torch-free facts, as its recipe on the tts_codebooks family (dstune.families.codebook_models): the class
counted without its DAC (which the processor names, outside the class), the DAC counted from its own config, and one
clip's activations: the encoder over the transcript's bytes, the decoder one position per DAC frame (plus BOS, EOS
and the delay pattern's longest delay) with logits over every codebook's ids at once, from the constants measured on
DiaForConditionalGeneration itself (the "dia" activation case in its builtin module, at Dia-1.6B's 9 channels and its encoder half
the decoder's width) at the folder's decoder width, layer counts and code vocabulary."""

from __future__ import annotations

from dstune.families.codebook_models import CodebooksModel
from dstune.memory.activations import (
    TEXT_TOKENS_PER_SECOND,
    ModelShape,
    codec_frame_rate,
    in_plan_units,
    measured_sample_bytes,
)
from dstune.memory.counts import SizesUnknown, config_folder, count_component, read_config
from dstune.memory.plan import ModelCounts

ARCHITECTURE = "DiaForConditionalGeneration"
CODEC_FOLDER = "audio_tokenizer"  # where dstune's built-in and stored Dia folders keep the DAC (its config)
DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds


def codec_config_path(folder, config_origin: str):
    """The DAC config.json a Dia folder uses: its `audio_tokenizer/` (dstune's stored and built-in folders), else
    what processor_config.json names (a folder, or a hub id found by config_folder)."""
    own = folder / CODEC_FOLDER / "config.json"
    if own.is_file():
        return own
    named = (
        (read_config(folder / "processor_config.json").get("audio_tokenizer") or {}).get("audio_tokenizer_name_or_path")
        if (folder / "processor_config.json").is_file()
        else None
    )
    if not named:
        raise SizesUnknown(
            f"{config_origin}: no {CODEC_FOLDER}/config.json and no audio tokenizer named in "
            "processor_config.json, so the DAC cannot be counted"
        )
    return config_folder(named)[0] / "config.json"


def count(spec, num_samples: int, folder, origin: str, config: dict, counted: tuple) -> ModelCounts:
    params, largest, lora, default_lora = counted
    codec_path = codec_config_path(folder, origin)
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
    sample = measured_sample_bytes("dia", shape, positions, seconds * TEXT_TOKENS_PER_SECOND, spec.train.precision)
    full, checkpointed = in_plan_units(sample, spec.train.precision)
    cached = ("codec",) if spec.data.cache.codec_tokens else ()
    cache_bytes = int(4 * frame_rate * channels * seconds * num_samples) if spec.data.cache.codec_tokens else 0
    return ModelCounts(
        "model",
        params,
        lora or params,
        largest,
        {"codec": codec_params},
        cached,
        full,
        checkpointed,
        default_lora,
        cache_bytes,
        origin,
    )


CODEBOOKS_MODEL = CodebooksModel(
    title="Dia", architecture=ARCHITECTURE, torch_side="dstune.models.dia.model", count=count, takes_voice_prompts=True
)
