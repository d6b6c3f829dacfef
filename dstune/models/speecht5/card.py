"""SpeechT5's card (torch-free, `model.family speecht5`): SpeechT5ForTextToSpeech folders with a SpeechT5HifiGan
vocoder. What the memory plan knows of it: its parameters, the vocoder's, and one clip's activations."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dstune.card import ModelCard, ModelPreset, speech
from dstune.families.speakers import NO_SPEAKER, SpeakersRefused, Voices, one_voice, shown
from dstune.memory.activations import TEXT_TOKENS_PER_SECOND, ModelShape, in_plan_units, measured_sample_bytes
from dstune.memory.counts import SizesUnknown, config_folder, count_component, count_small_tensors, read_config
from dstune.memory.plan import ModelCounts

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds
DEFAULT_VECTOR = "default"  # the vector of a clip without a speaker (a fixed one where the file has none)


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


def vector_sizes(path: Path) -> dict[str, int]:
    """{name: values} of every tensor of a safetensors file, from its header alone (no framework); ValueError naming
    the file when it is not one."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        sizes = {}
        for name, entry in header.items():
            if name != "__metadata__":
                sizes[name] = 1
                for side in entry["shape"]:
                    sizes[name] *= int(side)
        return sizes
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None


@dataclass(frozen=True, kw_only=True)
class SpeechT5Card(ModelCard):
    speakers_file: str  # the speaker vectors beside an export (and read from a model folder)

    def vectors_path(self, model_spec) -> tuple[Optional[Path], str]:
        """(the speaker vectors file a run reads, the key that names it): model.speaker_embeddings, else the
        model folder's own speakers file (an export's), else (None, "")."""
        if model_spec.speaker_embeddings:
            return Path(model_spec.speaker_embeddings).expanduser(), "model.speaker_embeddings"
        own = Path(model_spec.pretrained).expanduser() / self.speakers_file
        return (own, "model.pretrained") if own.is_file() else (None, "")

    def vector_dim(self, model_spec) -> Optional[int]:
        """The model's speaker_embedding_dim from its config (None when its config is not here)."""
        try:
            config = read_config(config_folder(model_spec.pretrained)[0] / "config.json")
        except SizesUnknown:
            return None
        return int(config.get("speaker_embedding_dim", 512))

    def spec_issues(self, spec) -> list[tuple[str, str]]:
        """The speaker vectors file: readable, and every vector of the model's speaker_embedding_dim (start-up reads
        them all)."""
        path, key = self.vectors_path(spec.model)
        if path is None:
            return []
        if not path.is_file():
            return [(key, f"{path} does not exist: give a safetensors file of speaker vectors, one per speaker name")]
        try:
            sizes = vector_sizes(path)
        except ValueError as err:
            return [(key, str(err))]
        dim = self.vector_dim(spec.model)
        wrong = [f"{name} ({size})" for name, size in sizes.items() if dim is not None and size != dim]
        if wrong:
            return [
                (
                    key,
                    f"{path}: speaker vectors must have {dim} values, the model's speaker_embedding_dim; "
                    f"{', '.join(wrong[:8])} do not",
                )
            ]
        return []

    def voices(self, model_spec, names) -> Voices:
        """SpeechT5 hears a speaker through its vector: each speaker of the data needs one in the vectors file (a
        clip without a speaker takes its `default` vector, or a fixed one). Without a file, one voice."""
        path, key = self.vectors_path(model_spec)
        if path is None:
            fix = (
                "Give model.speaker_embeddings: a safetensors file with one vector per speaker name (x-vectors of "
                "their clips, e.g. speechbrain/spkrec-xvect-voxceleb's). "
            )
            return one_voice(
                self.name, names, f"{self.name} has no speaker vectors here (model.speaker_embeddings is unset)", fix
            )
        try:
            sizes = vector_sizes(path)
        except ValueError:
            sizes = None  # spec_issues says why
        missing = [name for name in names if name != NO_SPEAKER and sizes is not None and name not in sizes]
        if missing:
            raise SpeakersRefused(
                key,
                f"{path} has no vector for {len(missing)} of the data's speakers: {shown(missing)} (it holds "
                f"{', '.join(sorted(sizes)[:8]) or 'none'}). Add a vector named after each speaker (the model's "
                "speaker_embedding_dim values), or set data.speakers: blend to train every clip with the default "
                "vector (docs/tts.md, Speakers).",
            )
        return Voices(
            self.name,
            f"each speaker's vector in {path} (a clip without a speaker: '{DEFAULT_VECTOR}')",
            {name: name if name != NO_SPEAKER else DEFAULT_VECTOR for name in names},
        )

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
    text_tokenizer="files",  # spm_char.model: SentencePiece characters with <unk>
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
