"""The torch-free facts of the speecht5 family (SpeechT5 text-to-speech with its HiFi-GAN vocoder): parameters and
one clip's activations; dstune.families.facts describes the contract."""

from __future__ import annotations

from dstune.memory.activations import TEXT_TOKENS_PER_SECOND, ModelShape, in_plan_units, measured_sample_bytes
from dstune.families.facts import ModelFacts
from dstune.memory.plan import ModelCounts
from dstune.memory.counts import config_folder, count_component, count_small_tensors, read_config

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds


def sample_bytes(config: dict, seconds: float, precision: str = "bf16") -> tuple[int, int]:
    """One clip's activations from SpeechT5's measured constants: the encoder over the transcript's tokens, the
    decoder over the mel frames (16 kHz, hop 256) in steps of reduction_factor, the attention scores (eager
    attention) and the guided-attention loss included. dstune never checkpoints SpeechT5: one figure for both."""
    hidden = config.get("hidden_size", 768)
    steps = seconds * 16000 / 256 / config.get("reduction_factor", 2)
    shape = ModelShape(
        hidden, {"encoder": config.get("encoder_layers", 12), "decoder": config.get("decoder_layers", 6)}
    )
    return in_plan_units(
        measured_sample_bytes("speecht5", shape, steps, seconds * TEXT_TOKENS_PER_SECOND, precision), precision
    )


def _count(spec, num_samples: int, clips=()) -> ModelCounts:
    folder, origin = config_folder(spec.model.pretrained)
    params, largest, _ = count_component(str(folder / "config.json"))
    companions = {}
    vocoder = spec.model.vocoder or (str(folder / "vocoder") if (folder / "vocoder" / "config.json").exists() else None)
    if vocoder:
        companions["vocoder"] = count_component(str(config_folder(vocoder)[0] / "config.json"))[0]
    full, checkpointed = sample_bytes(
        read_config(folder / "config.json"), spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS, spec.train.precision
    )
    config_path = str(folder / "config.json")
    return ModelCounts(
        "speecht5",
        params,
        params,
        largest,
        companions,
        (),
        int(full),
        int(checkpointed),
        0,
        0,
        origin,
        small_tensors=count_small_tensors(config_path),
    )


FACTS = ModelFacts(family="speecht5", modality="audio", count=_count)
