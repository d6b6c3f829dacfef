"""SpeechT5's card (torch-free, `model.family speecht5`): SpeechT5ForTextToSpeech folders with a SpeechT5HifiGan
vocoder. What the memory plan knows of it: its parameters, the vocoder's, and one clip's activations."""

from __future__ import annotations

from dataclasses import dataclass

from dstune.card import ModelCard, ModelPreset, speech
from dstune.memory.activations import TEXT_TOKENS_PER_SECOND, ModelShape, in_plan_units, measured_sample_bytes
from dstune.memory.counts import config_folder, count_component, count_small_tensors, read_config
from dstune.memory.plan import ModelCounts

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


@dataclass(frozen=True, kw_only=True)
class SpeechT5Card(ModelCard):
    speakers_file: str  # the speaker vectors beside an export (and read from a model folder)

    def count(self, spec, num_samples: int, clips=()) -> ModelCounts:
        folder, origin = config_folder(spec.model.pretrained)
        params, largest, _ = count_component(str(folder / "config.json"))
        companions = {}
        own = folder / type(spec.model).COMPANION_FOLDERS["vocoder"]  # model.vocoder left out: the folder's own
        vocoder = spec.model.vocoder or (str(own) if (own / "config.json").exists() else None)
        if vocoder:
            companions["vocoder"] = count_component(str(config_folder(vocoder)[0] / "config.json"))[0]
        seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
        full, checkpointed = sample_bytes(read_config(folder / "config.json"), seconds, spec.train.precision)
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
            small_tensors=count_small_tensors(str(folder / "config.json")),
        )


SPEECHT5_CARD = SpeechT5Card(
    key="speecht5",
    name="SpeechT5",
    family="speecht5",
    unit="speecht5",
    model_class="dstune.models.speecht5.model:SpeechT5",
    docs="docs/tts.md",
    names=r"speecht5",
    summary="SpeechT5 TTS (SpeechT5ForTextToSpeech: text -> log-mel frames; a SpeechT5HifiGan vocoder)",
    folder_classes={"SpeechT5ForTextToSpeech": None},  # its samples take no guidance
    speakers_file="speaker_embeddings.safetensors",
    activation_cases="dstune.models.speecht5.builtin:ACTIVATION_CASES",
    builtins={"tiny-speecht5": "dstune.models.speecht5.builtin:TINY_SPEECHT5"},
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
