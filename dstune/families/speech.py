"""What the speech families share: the clip type, sample WAV folders, and what a codec-token LM family builds. (The tts_lm token layouts, written as
`dstune_tts.json` beside a model, are described in dstune.models.tts_lm.token_layouts.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class Clip:
    wave: np.ndarray  # float32 mono
    sample_rate: int


@dataclass(kw_only=True)
class CodecTokensBuilt:
    """What a family that trains an LM over codec tokens builds (tts_lm, tts_codebooks): the trained module, the
    frozen codec beside it, and the layout the codec-token cache and the samples read. Each family adds its own."""

    folder: Path
    device: torch.device
    trainable: torch.nn.Module  # the only part DeepSpeed wraps
    codec: torch.nn.Module  # frozen, fp32, eval
    codec_folder: Path  # what keys the codec-token cache (its fingerprint)
    codec_kind: str
    layout: dict  # sampling_rate, num_codebooks, frame_order (and frame_rate): what the cache and samples read
    max_sample_seconds: float = 2.0
    temperature: float = 0.8
    # wave (float32 numpy at sample_rate) -> one clip's tensor for the codec cache, for a model whose "codes" are
    # its own encoder's continuous latents (frames, values); None: dstune.families.speech_codecs.encode_clip
    clip_encoder: Optional[Callable] = None

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"codec": self.codec}

    @property
    def sample_rate(self) -> int:
        return int(self.layout["sampling_rate"])


def checkpoint_activations(model) -> None:
    """`gradient_checkpointing: true` on a transformers class: its own non-reentrant checkpointing, without the forward
    hooks transformers adds with it to make each input embedding's output require grad. Those serve reentrant
    checkpointing only (non-reentrant reaches the parameters inside a checkpointed block anyway); with a frozen
    embedding (LoRA) they make its output a leaf that requires grad, which a class that writes into its embeddings
    in place (a depth decoder that writes its first position) cannot take."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()


def save_wavs(clips: list[Clip], prompts: list[str], path) -> Path:
    """WAVs in a folder named like `path` without its suffix (samples/step-000010/00.wav ...) + prompts.txt."""
    import soundfile

    folder = Path(path).with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    for number, clip in enumerate(clips):
        soundfile.write(str(folder / f"{number:02d}.wav"), clip.wave, clip.sample_rate, subtype="FLOAT")
    (folder / "prompts.txt").write_text("".join(f"{n:02d}.wav\t{p}\n" for n, p in enumerate(prompts)))
    return folder
