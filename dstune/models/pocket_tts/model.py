"""Pocket TTS's class (PocketTTSForConditionalGeneration) on the multi-codebook core: a causal backbone over one
stream, the voice prompt's latents, the text and the speech's continuous latents (12.5 per second), whose state
conditions an LSD flow head that samples the next latent, and an end-of-speech head. Its samples are the class's
own generate, decoded by the processor's audio tokenizer.

The "codec" is the processor's audio tokenizer (`audio_tokenizer`, named by path in processor_config.json, outside
the class): frozen, fp32, whole on every rank; each clip is encoded alone as the processor encodes a training clip
(the feature extractor without the voice's end-on-pause, padded to the frame, the encoder's latents of the clip's
own frames), so the codec cache holds the processor's latents.

One utterance is what the processor builds from the chat template's prompt with precomputed latents:
    <voice BOS> <voice> x voice frames, the text, <audio BOS>, <audio> x frames
with `labels` the clip's latents. The voice is a reference clip of the utterance's speaker (the data's speaker
column; clips that name none are one voice): its first card.voice_seconds seconds, from another clip of the same
speaker where the data has one (the speaker's first clip, or for that clip itself its second), given by start-up
(`take_voices`), so every rank and every resume conditions a sample on the same voice.

The loss is the class's own from `labels`, in its pieces so that each sample draws its own noise and times
(dstune.families.flow_head_tts, which Pocket TTS shares with the other flow-head TTS models: the flow loss of each
frame from the state one position before it, the self-distillation term on a share of steps). Two deliberate differences (docs/tts.md, Pocket TTS):
- the self-distillation coin of a step is drawn from (seed, step), the same for every micro batch and rank, where the
  class draws it from a generator of its own once per forward;
- the latent statistics (`latent_mean`, `latent_std`) stay the folder's: the class moves them towards each forward's
  latents for its first `latent_stats_ema_steps` forwards, per rank and per micro batch, which would leave the ranks
  with different statistics and the flow head's space moving under a fine-tune.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.families.codebooks import CodebooksModel
from dstune.families.flow_head_tts import (
    TRAIN_KEYS,
    batch_references,
    encode_latents,
    flow_head_loss,
    gathered,
    generate_wave,
    keep_references,
    leaf_module,
    take_audio_tokenizer,
    training_inputs,
    voice_of,
)
from dstune.families.precision import at_least_float32
from dstune.families.speech import Clip
from dstune.models.pocket_tts.card import POCKET_TTS_CARD, PocketTTSCard

FLOW_PURPOSE = "pocket-tts-flow"  # a sample's noise and flow times
DISTILL_PURPOSE = "pocket-tts-distill"  # a step's self-distillation coin (the same for every sample of the step)
__all__ = ["TRAIN_KEYS", "FLOW_PURPOSE", "DISTILL_PURPOSE", "PocketTTS"]


class PocketTTS(CodebooksModel):
    card: PocketTTSCard
    voice_references = 2  # reference clips per speaker that start-up gives (take_voices)

    def __init__(self, card, model_spec, folder: Path, device, processor):
        super().__init__(card, model_spec, folder, device, processor)
        self.references: dict[str, list[tuple[str, np.ndarray]]] = {}  # speaker -> [(sample id, wave)], data order
        self._voice_latents: dict[str, torch.Tensor] = {}

    def take_codec(self, whole, dtype: torch.dtype) -> torch.nn.Module:
        codec, self.codec_folder, self.layout = take_audio_tokenizer(
            self.processor,
            self.folder,
            dtype,
            "Pocket TTS's audio tokenizer (processor_config.json)",
            self.card.latents_kind,
        )
        self.codec_kind = self.card.latents_kind
        return codec

    def trained_module(self, whole) -> torch.nn.Module:
        """The class in the shared flow-head loss module, a ZeRO-3 leaf (gathered whole: the flow head's JVP)."""
        return leaf_module(whole)

    def encode_clip(self, wave: torch.Tensor) -> torch.Tensor:
        """One clip's latents (frames, D), float: what the codec cache stores."""
        return encode_latents(self.codec, self.processor, wave.numpy())

    # ------------------------------------------------------------------------------------------------ voices

    def take_voices(self, voices: dict[str, list[tuple[str, np.ndarray]]]) -> None:
        """Each speaker's first reference clips (sample id, wave at the codec's rate), in the data's order."""
        self.references = keep_references(voices, int(self.card.voice_seconds * self.sample_rate))
        self._voice_latents = {}

    def voice_of(self, speaker: str, sample_id: str):
        """The reference clip a clip of `speaker` is conditioned on (dstune.families.flow_head_tts.voice_of)."""
        return voice_of(self.references, speaker, sample_id)

    def voice_latents(self, reference) -> torch.Tensor:
        """A reference clip's voice prompt: its audio tokenizer latents, as the processor encodes a voice."""
        sample_id, wave = reference
        if sample_id not in self._voice_latents:
            self._voice_latents[sample_id] = encode_latents(self.codec, self.processor, wave)
        return self._voice_latents[sample_id]

    # ------------------------------------------------------------------------------------------ the train step

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The processor's inputs for a batch (the chat template's prompts, the latents given precomputed): each
        clip's latents as labels, each speaker's voice. A cached batch holds each clip's latents as "codes";
        otherwise each clip is encoded alone by the frozen audio tokenizer."""
        latents = [at_least_float32(c) for c in self.clip_codes(batch)]
        voices = [None if r is None else self.voice_latents(r) for r in batch_references(self.references, batch)]
        encoded = training_inputs(self.processor, batch["texts"], voices, latents, self.device, dtype)
        return {**encoded, "indices": torch.as_tensor(batch["index"], dtype=torch.long)}

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The class's loss from the labels (the module docstring): each sample's noise and times from (seed, step,
        its dataset index), the step's self-distillation coin from (seed, step)."""
        return flow_head_loss(forward, encoded, seed, step, (FLOW_PURPOSE, DISTILL_PURPOSE), self.device)

    # ------------------------------------------------------------------------------------------------ samples

    def sample(self, trainable_module, prompts: list[str], sample_spec, resolution=None) -> list[Clip]:
        """The core's samples with the whole class gathered under ZeRO-3."""
        with gathered(trainable_module):
            return super().sample(trainable_module, prompts, sample_spec, resolution)

    def speak(self, module, prompt: str, seed: int, voice) -> Clip:
        """In the voice of its reference clip (sample.voice_prompts), else of the data's first speaker."""
        if voice is None and self.references:
            voice = self.references[sorted(self.references)[0]][0][1]
        wave = generate_wave(module, self.processor, prompt, self.max_frames(), self.temperature, seed, voice)
        return Clip(wave, self.sample_rate)

    @classmethod
    def synthesize(
        cls, folder, text: str, seconds: float, temperature: float, seed: int, speaker: Optional[str] = None
    ) -> Clip:
        """Speech for `text` from a Pocket TTS folder with the class, its processor and its audio tokenizer only, in
        its default voice: a speaker's voice comes from a voice prompt clip, which an export does not hold."""
        if speaker is not None:
            raise FamilyError(
                f"--speaker: Pocket TTS speaks in the voice of a voice prompt (a clip of the speaker), and {folder} "
                "holds none (its speakers.json names the clips training used). Leave --speaker out for its default "
                "voice; samples during training use sample.voice_prompts."
            )
        model, processor = cls.load_class(POCKET_TTS_CARD, Path(folder))
        model.eval()
        rate = int(processor.feature_extractor.sampling_rate)
        frames = max(1, int(seconds * processor.audio_tokenizer.config.frame_rate))
        with torch.no_grad():
            wave = generate_wave(model, processor, text, frames, temperature, seed)
        return Clip(wave, rate)
