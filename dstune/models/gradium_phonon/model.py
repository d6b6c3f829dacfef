"""Gradium Phonon's class (GradiumPhononTTSForConditionalGeneration) on the multi-codebook core: the flow-head TTS layout
(dstune.families.flow_head_tts) with a speaker codec for the voice. A causal backbone over one stream (the voice
prompt's frames, the text, the speech's continuous latents at 12.5 per second) whose state conditions an LSD flow head
that samples the next latent, and an end-of-speech head; the speaker conditions (`num_speakers`, `duration_delta`) are
config values the class adds to every audio position. Its samples are the class's own generate, decoded by the
processor's audio tokenizer.

Two frozen encoders, outside the class, fp32, whole on every rank:
- the "codec" is the processor's audio tokenizer (`audio_tokenizer`, named by path in processor_config.json): each
  clip is encoded alone as the processor encodes a training clip, so the codec cache holds the processor's latents;
- the speaker codec (a MimiEncoderModel: the folder's `speaker_codec/`, else the card's hub Mimi) encodes the voice:
  its unquantized latents (`audio_prompt_dim` values per frame) are the class's `audio_prompt_latents`, which the
  backbone projects (`audio_prompt_proj`). The processor cannot make them (its audio tokenizer's latents are another
  width), so dstune gives them precomputed, to training and to the samples alike.

One utterance is what the processor builds from the chat template's prompt with precomputed latents:
    <voice> x voice frames, the text, <audio BOS>, <audio> x frames
with `labels` the clip's latents. The voice is a reference clip of the utterance's speaker (the data's speaker
column): its first card.voice_seconds seconds, from another clip of the same speaker where the data has one (the
speaker's first clip, or for that clip itself its second), given by start-up (`take_voices`), so every rank and every
resume conditions a sample on the same voice.

The loss is the class's own from `labels` in its pieces (dstune.families.flow_head_tts: each sample's noise and times
from (seed, step, its index), the class's LSD loss per sample weighted by its frames, the class's end-of-speech loss
over the batch), with the two deliberate differences the flow-head TTS models share (docs/tts.md): the self-distillation coin of
a step comes from (seed, step), and the latent statistics stay the folder's (the class moves them for its first
`latent_stats_ema_steps` forwards, per rank and per micro batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.families.codebooks import CodebooksModel, first_line
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
from dstune.hf import quiet_hf_libraries
from dstune.models.gradium_phonon.card import GRADIUM_PHONON_CARD, GradiumPhononCard

FLOW_PURPOSE = "gradium-phonon-flow"  # a sample's noise and flow times
DISTILL_PURPOSE = "gradium-phonon-distill"  # a step's self-distillation coin (the same for every sample of the step)
__all__ = ["TRAIN_KEYS", "FLOW_PURPOSE", "DISTILL_PURPOSE", "GradiumPhonon", "load_speaker_codec", "speaker_latents"]


class GradiumPhonon(CodebooksModel):
    card: GradiumPhononCard
    voice_references = 2  # reference clips per speaker that start-up gives (take_voices)

    def __init__(self, card, model_spec, folder: Path, device, processor):
        super().__init__(card, model_spec, folder, device, processor)
        self.references: dict[str, list[tuple[str, np.ndarray]]] = {}  # speaker -> [(sample id, wave)], data order
        self._voice_latents: dict[str, torch.Tensor] = {}
        self.speaker_codec = None

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"codec": self.codec, "speaker_codec": self.speaker_codec}

    def take_codec(self, whole, dtype: torch.dtype) -> torch.nn.Module:
        codec, self.codec_folder, self.layout = take_audio_tokenizer(
            self.processor,
            self.folder,
            dtype,
            "Gradium Phonon's audio tokenizer (processor_config.json)",
            self.card.latents_kind,
        )
        self.codec_kind = self.card.latents_kind
        self.speaker_codec = load_speaker_codec(self.card, self.folder, whole.config.audio_prompt_dim)
        self.speaker_codec = self.speaker_codec.to(dtype).to(self.device)
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
        """A reference clip's voice prompt: the speaker codec's unquantized latents (frames, audio_prompt_dim)."""
        sample_id, wave = reference
        if sample_id not in self._voice_latents:
            self._voice_latents[sample_id] = speaker_latents(self.speaker_codec, self.processor, wave)
        return self._voice_latents[sample_id]

    # ------------------------------------------------------------------------------------------ the train step

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The processor's inputs for a batch (the chat template's prompts, the latents given precomputed): each
        clip's latents as labels, each speaker's voice prompt. A cached batch holds each clip's latents as "codes";
        otherwise each clip is encoded alone by the frozen audio tokenizer."""
        latents = [at_least_float32(c) for c in self.clip_codes(batch)]
        voices = [None if r is None else self.voice_latents(r) for r in batch_references(self.references, batch)]
        encoded = training_inputs(self.processor, batch["texts"], voices, latents, self.device, dtype)
        return {**encoded, "indices": torch.as_tensor(batch["index"], dtype=torch.long)}

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The class's loss from the labels (the module docstring)."""
        return flow_head_loss(forward, encoded, seed, step, (FLOW_PURPOSE, DISTILL_PURPOSE), self.device)

    # ------------------------------------------------------------------------------------------------ samples

    def sample(self, trainable_module, prompts: list[str], sample_spec, resolution=None) -> list[Clip]:
        """The core's samples with the whole class gathered under ZeRO-3."""
        with gathered(trainable_module):
            return super().sample(trainable_module, prompts, sample_spec, resolution)

    def speak(self, module, prompt: str, seed: int, voice) -> Clip:
        """In the voice of its reference clip (sample.voice_prompts), else of the data's first speaker: the speaker
        codec's latents of that clip, given to the processor precomputed."""
        if voice is None and self.references:
            voice = self.references[sorted(self.references)[0]][0][1]
        limit = int(self.card.voice_seconds * self.sample_rate)
        latents = None if voice is None else speaker_latents(self.speaker_codec, self.processor, voice[:limit])
        wave = generate_wave(
            module, self.processor, prompt, self.max_frames(), self.temperature, seed, voice_latents=latents
        )
        return Clip(wave, self.sample_rate)

    def write_folder(self, whole, work: Path) -> None:
        """The class and its processor, and the speaker codec beside them, so that an export encodes voices too."""
        super().write_folder(whole, work)
        with quiet_hf_libraries():
            self.speaker_codec.save_pretrained(work / self.card.speaker_codec_subfolder, safe_serialization=True)

    @classmethod
    def synthesize(
        cls, folder, text: str, seconds: float, temperature: float, seed: int, speaker: Optional[str] = None
    ) -> Clip:
        """Speech for `text` from a Gradium Phonon folder with the class and its processor only, in its default
        voice: a speaker's voice comes from a voice prompt clip, which an export does not hold."""
        if speaker is not None:
            raise FamilyError(
                f"--speaker: Gradium Phonon speaks in the voice of a voice prompt (a clip of the speaker), and "
                f"{folder} holds none (its speakers.json names the clips training used). Leave --speaker out for its "
                "default voice; samples during training use sample.voice_prompts."
            )
        model, processor = cls.load_class(GRADIUM_PHONON_CARD, Path(folder))
        model.eval()
        rate = int(processor.feature_extractor.sampling_rate)
        frames = max(1, int(seconds * processor.audio_tokenizer.config.frame_rate))
        with torch.no_grad():
            wave = generate_wave(model, processor, text, frames, temperature, seed)
        return Clip(wave, rate)


def load_speaker_codec(card: GradiumPhononCard, folder: Path, width: int) -> torch.nn.Module:
    """The speaker codec (eval, no grad, fp32) from the folder's subfolder, else the card's hub Mimi in the local
    cache; FamilyError saying where it was looked for, or when its latents do not fit the class's voice width."""
    import transformers

    source = card.speaker_codec_source(Path(folder))
    try:
        with quiet_hf_libraries():
            codec = getattr(transformers, card.speaker_codec_class).from_pretrained(
                source, torch_dtype=torch.float32, local_files_only=True
            )
    except (OSError, ValueError) as err:
        raise FamilyError(
            f"{folder}: Gradium Phonon's voice prompts are a speaker codec's latents (a Mimi encoder), looked for in "
            f"{folder / card.speaker_codec_subfolder} and then {card.speaker_codec_hub} in the Hugging Face cache "
            f"({first_line(err)}). Download it beforehand (huggingface-cli download {card.speaker_codec_hub}) or put "
            f"a {card.speaker_codec_class} folder at {card.speaker_codec_subfolder}/."
        ) from None
    if int(codec.config.hidden_size) != int(width):
        raise FamilyError(
            f"{source}: the speaker codec's latents have {codec.config.hidden_size} values per frame, and the class's "
            f"voice prompt takes {width} (audio_prompt_dim): it is not this model's speaker codec"
        )
    return codec.eval().requires_grad_(False)


def speaker_latents(speaker_codec, processor, wave) -> torch.Tensor:
    """(frames, audio_prompt_dim) float32: the speaker codec's unquantized latents of one voice clip (1-D float at
    the processor's rate), its own frames, the clip read by the processor's feature extractor as it reads a voice."""
    extractor = processor.feature_extractor
    with quiet_hf_libraries():
        values = extractor(np.asarray(wave, dtype=np.float32), sampling_rate=extractor.sampling_rate)
    weight = next(speaker_codec.parameters())
    with torch.no_grad():
        latents = speaker_codec(values["input_values"].to(weight.device, weight.dtype)).latents[0].transpose(0, 1)
    frames = int(speaker_codec.get_encoded_length(values["padding_mask"].sum(-1))[0])
    return at_least_float32(latents[:frames]).cpu()
