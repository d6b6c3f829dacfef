"""What the speech models share: the clip type, sample WAV folders, and their base classes.

`SpeechModel` (a TrainedModel) is every TTS class's: its samples are clips, one per prompt, made by the class's own
`speak` from a seed of the prompt's number, with the trained module in eval mode and every rank making the same
calls (ZeRO-3 gathers parameters in them); `dstune synthesize` asks each speech class whether an exported folder is
its model's (`speaks_from`) and speaks from it without dstune state (`synthesize`). `CodecTokensModel` adds the
frozen codec of a model trained on its codes (tts_lm, the multi-codebook classes): the layout the codec-token cache
and the samples read, and one clip's codes (`encode_clip`, the same for any batch, rank count or device).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import numpy as np
import torch

from dstune.families.base import FamilyError, TrainedModel
from dstune.families.speakers import Voices, heard_speakers
from dstune.families.speech_codecs import encode_clip


@dataclass
class Clip:
    wave: np.ndarray  # float32 mono
    sample_rate: int


def save_wavs(clips: list[Clip], prompts: list[str], path) -> Path:
    """WAVs in a folder named like `path` without its suffix (samples/step-000010/00.wav ...) + prompts.txt."""
    import soundfile

    folder = Path(path).with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    for number, clip in enumerate(clips):
        soundfile.write(str(folder / f"{number:02d}.wav"), clip.wave, clip.sample_rate, subtype="FLOAT")
    (folder / "prompts.txt").write_text("".join(f"{n:02d}.wav\t{p}\n" for n, p in enumerate(prompts)))
    return folder


def checkpoint_activations(model) -> None:
    """`gradient_checkpointing: true` on a transformers class: its own non-reentrant checkpointing, without the forward
    hooks transformers adds with it to make each input embedding's output require grad. Those serve reentrant
    checkpointing only (non-reentrant reaches the parameters inside a checkpointed block anyway); with a frozen
    embedding (LoRA) they make its output a leaf that requires grad, which a class that writes into its embeddings
    in place (a depth decoder that writes its first position) cannot take."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()


class SpeechModel(TrainedModel):
    """A TTS model loaded for training (see the module docstring): `trainable` beside its frozen parts."""

    supports_lora: ClassVar[bool] = True

    def __init__(self, card, model_spec, folder: Path, device):
        self.card, self.model_spec, self.folder, self.device = card, model_spec, Path(folder), torch.device(device)
        self.max_sample_seconds = model_spec.max_sample_seconds  # a sample's longest length (s)
        self.trainable = None
        # how it hears the data's speakers (dstune.families.speakers.voices_for, set by start-up and the export;
        # kept in speakers.json beside an export): None where the data names none
        self.voices: Optional[Voices] = None

    @property
    def modality(self) -> str:
        return "audio"

    @property
    def sample_rate(self) -> int:
        """The rate (Hz) its clips are read at and its samples written at."""
        raise NotImplementedError

    def clip_voices(self, batch: dict) -> list[str]:
        """Each clip's speaker as the model is given it (self.voices: "0", "[S2]", a vector's name ...; "": its
        default voice). Clips that name speakers need the run's map: a batch alone cannot number them the same way
        every time."""
        heard = heard_speakers(self.card, batch.get("speakers") or [""] * len(batch["texts"]), batch["texts"])
        if self.voices is None:
            named = sorted({s for s in heard if s})
            if named:
                raise FamilyError(
                    f"the clips name speakers ({', '.join(named[:5])}) but {self.card.name} was not given how to hear "
                    "them (model.voices: dstune.families.speakers.voices_for)"
                )
            return [""] * len(heard)
        unknown = sorted({s for s in heard if s and s not in self.voices.given and not self.voices.blended})
        if unknown:
            raise FamilyError(
                f"the clips' speakers {', '.join(unknown[:5])} are not in the run's speaker map (its speakers: "
                f"{', '.join(self.voices.given)})"
            )
        return ["" if speaker is None else self.voices.of(speaker) for speaker in heard]

    def save_samples(self, outputs: list[Clip], prompts: list[str], path) -> Path:
        return save_wavs(outputs, prompts, path)

    def sample(self, trainable_module, prompts: list[str], sample_spec, resolution=None) -> list[Clip]:
        """One clip per prompt, from sample_spec.seed (the same clips at every step for the same weights), in the
        voice of its reference clip where sample.voice_prompts names one per prompt."""
        module = self.generating_module(trainable_module)
        was_training = module.training
        module.eval()
        voices = self.voice_prompts(sample_spec)
        try:
            with torch.no_grad():
                return [
                    self.speak(module, prompt, sample_spec.seed * 1000 + number, voices[number] if voices else None)
                    for number, prompt in enumerate(prompts)
                ]
        finally:
            module.train(was_training)

    def generating_module(self, trainable_module):
        """The module the samples generate with: the trained module, or the class it holds."""
        return trainable_module

    def voice_prompts(self, sample_spec) -> list:
        """One reference voice per prompt (sample.voice_prompts), as `speak` takes it; [] for none."""
        return []

    def speak(self, module, prompt: str, seed: int, voice) -> Clip:
        """One sample clip of `prompt` from `seed` (and `voice`: a reference, or None)."""
        raise NotImplementedError

    @classmethod
    def speaks_from(cls, card, folder: Path) -> bool:
        """Whether `folder` is an export of this model (`dstune synthesize` picks the class that says so)."""
        return False

    @classmethod
    def synthesize(
        cls, folder, text: str, seconds: float, temperature: float, seed: int, speaker: Optional[str] = None
    ) -> Clip:
        """Speech for `text` from an exported folder, with the ecosystem's classes only (no dstune state), in the
        voice of `speaker` (the model's form of it, from the export's speakers.json; None: its default voice)."""
        raise NotImplementedError(f"{cls.__name__} does not speak from a folder")


class CodecTokensModel(SpeechModel):
    """A model trained on a frozen codec's codes: the codec (fp32, eval, whole on every rank), the folder that keys
    the codec-token cache, and `layout` (sampling_rate, num_codebooks, frame_order, frame_rate): what the cache
    and the samples read."""

    def __init__(self, card, model_spec, folder: Path, device):
        super().__init__(card, model_spec, folder, device)
        self.temperature = model_spec.sample_temperature  # the samples' sampling temperature
        self.codec = None
        self.codec_folder: Optional[Path] = None  # its fingerprint keys the codec-token cache
        self.codec_kind = ""  # dstune.families.speech_codecs' name for it
        self.layout: dict = {}

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"codec": self.codec}

    @property
    def sample_rate(self) -> int:
        return int(self.layout["sampling_rate"])

    def max_frames(self) -> int:
        """The frames a sample may take (model.max_sample_seconds, at least one)."""
        return max(1, int(self.max_sample_seconds * self.layout["frame_rate"]))

    def encode_clip(self, wave: torch.Tensor) -> torch.Tensor:
        """One clip's codes (positions, frames) int64, encoded alone by the frozen codec: what the codec-token cache
        stores (a model whose codes are its encoder's continuous latents returns those, float)."""
        return encode_clip(self.codec, self.codec_kind, wave, self.layout["num_codebooks"], self.layout["frame_order"])

    def clip_codes(self, batch: dict) -> list[torch.Tensor]:
        """Each clip's codes: the cached ones a cached batch holds, else encoded now."""
        return batch.get("codes") or [self.encode_clip(wave) for wave in batch["audio"]]
