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

The loss is the class's own from `labels`, in its pieces so that each sample draws its own noise and times: the
backbone (`model.model`) on the normalised latents, the class's loss function (transformers' LSD loss: the flow
loss of each frame from the state one position before it, the self-distillation term on a share of steps) per
sample, weighted by its frames as the class's one call averages over the batch's frames, and the class's
end-of-speech loss over every audio position of the batch. Two deliberate differences (docs/tts.md, Pocket TTS):
- the self-distillation coin of a step is drawn from (seed, step), the same for every micro batch and rank, where the
  class draws it from a generator of its own once per forward;
- the latent statistics (`latent_mean`, `latent_std`) stay the folder's: the class moves them towards each forward's
  latents for its first `latent_stats_ema_steps` forwards, per rank and per micro batch, which would leave the ranks
  with different statistics and the flow head's space moving under a fine-tune.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.families.codebooks import CodebooksModel, first_line
from dstune.families.precision import at_least_float32
from dstune.families.randomness import sample_seed
from dstune.families.speech import Clip
from dstune.hf import NotAvailableLocally, hub_snapshot, quiet_hf_libraries
from dstune.models.pocket_tts.card import POCKET_TTS_CARD, PocketTTSCard

FLOW_PURPOSE = "pocket-tts-flow"  # a sample's noise and flow times
DISTILL_PURPOSE = "pocket-tts-distill"  # a step's self-distillation coin (the same for every sample of the step)
TRAIN_KEYS = (
    "input_ids",
    "attention_mask",
    "audio_prompt_latents",
    "audio_prompt_latents_mask",
    "labels",
    "labels_mask",
)


@contextmanager
def plain_linear():
    """torch's own linear while the LSD loss runs: ZeRO-3 replaces torch.nn.functional.linear process-wide by an
    autograd function of its own (memory_efficient_linear), which has no forward-mode rule, and the loss differentiates
    the flow head with a forward-mode JVP. The whole class is gathered here (a leaf module), so nothing is lost."""
    patched = torch.nn.functional.linear
    torch.nn.functional.linear = torch._C._nn.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = patched


class PocketTTSModule(torch.nn.Module):
    """The trained module: the whole class under `model.` (the core's export and LoRA code find its names)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # the class's loss hyperparameters without the end-of-speech term, which the batch's positions share
        self.flow_config = copy.deepcopy(model.config)
        self.flow_config.eos_loss_weight = 0.0

    def forward(self, anchor, input_ids, attention_mask, labels, labels_mask, seeds, distill_seed, **voice):
        """labels (B, F, D): each clip's latents right-padded, labels_mask (B, F); seeds (B,): each sample's draws;
        voice: audio_prompt_latents and its mask where some sample has a voice. The class's loss, sample by sample.

        `anchor` (a zero that requires grad, added to the latents; positional): ZeRO-3 reduces a leaf module's
        gradients in a full backward hook on the module, which fires once the gradients of its positional inputs are
        ready; without one that requires grad it fires at the start of the backward, before any gradient exists."""
        from transformers.loss.loss_lsd import end_of_speech_loss

        outer = self.model
        config = outer.config
        normalized = ((labels - outer.latent_mean) / outer.latent_std).to(labels.dtype) + anchor.to(labels.dtype)
        hidden = outer.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            audio_latents=normalized,
            audio_latents_mask=labels_mask,
            **voice,
        ).last_hidden_state
        logits = outer.eos_head(hidden)[..., 0]
        positions = (input_ids == config.audio_bos_token_id) | (input_ids == config.audio_latent_token_id)
        counts = labels_mask.sum(1).tolist()
        total, flow, eos_logits, eos_labels = sum(counts), 0, [], []
        for row, count in enumerate(counts):
            states = hidden[row][positions[row]]  # the audio BOS, then one per frame
            eos_logits.append(logits[row][positions[row]])
            eos_labels.append(torch.arange(count + 1, device=states.device) == count)  # the last one ends the speech
            flow = flow + self.flow_loss(states[:count], normalized[row, :count], int(seeds[row]), distill_seed) * (
                count / total
            )
        eos = end_of_speech_loss(torch.cat(eos_logits), torch.cat(eos_labels))
        out = flow + config.eos_loss_weight * eos
        return out

    def flow_loss(self, conditions, targets, seed: int, distill_seed: int):
        """The class's loss function on one sample's frames, its noise and times from `seed` (the global RNG forked,
        as the class draws them) and the step's self-distillation coin from `distill_seed`."""
        outer = self.model
        device = targets.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), plain_linear():
            torch.manual_seed(seed)
            return outer.loss_function(
                flow_head=outer.flow_head,
                conditions=conditions,
                targets=targets,
                eos_logits=conditions.new_zeros(1),
                eos_labels=torch.zeros(1, dtype=torch.bool, device=device),
                config=self.flow_config,
                loss_weighting=outer.loss_weighting,
                distill_generator=torch.Generator().manual_seed(distill_seed),
                training=self.training,
            )


class PocketTTS(CodebooksModel):
    card: PocketTTSCard
    voice_references = 2  # reference clips per speaker that start-up gives (take_voices)

    def __init__(self, card, model_spec, folder: Path, device, processor):
        super().__init__(card, model_spec, folder, device, processor)
        self.references: dict[str, list[tuple[str, np.ndarray]]] = {}  # speaker -> [(sample id, wave)], data order

    def take_codec(self, whole, dtype: torch.dtype) -> torch.nn.Module:
        codec = self.processor.audio_tokenizer
        if codec is None or codec.config.encoder_config is None:
            raise FamilyError(f"{self.folder}: its processor has no audio tokenizer with an encoder to encode clips")
        codec = codec.to(dtype).eval().requires_grad_(False)
        self.codec_folder, self.codec_kind = codec_folder(codec.name_or_path), self.card.latents_kind
        self.layout = {
            "sampling_rate": int(self.processor.feature_extractor.sampling_rate),
            "frame_rate": float(codec.config.frame_rate),
            "num_codebooks": int(codec.config.latent_dim),  # values per latent frame
            "frame_order": [],
            "codec": self.card.latents_kind,
        }
        return codec

    def trained_module(self, whole) -> torch.nn.Module:
        """The class in a PocketTTSModule, which ZeRO-3 gathers whole for its forward and backward (a leaf module:
        no hooks inside it). The LSD loss runs the flow head inside a forward-mode JVP, which ZeRO-3's per-module
        hooks cannot pass through (their autograd functions have no jvp); gathering the whole model (about 100 M
        parameters for the real one) is what the memory plan counts as its largest layer."""
        from deepspeed.utils import set_z3_leaf_module

        trainable = PocketTTSModule(whole).train().requires_grad_(True)
        set_z3_leaf_module(trainable, True)
        return trainable

    def encode_clip(self, wave: torch.Tensor) -> torch.Tensor:
        """One clip's latents (frames, D), float: what the codec cache stores."""
        return encode_latents(self.codec, self.processor, wave.numpy())

    # ------------------------------------------------------------------------------------------------ voices

    def take_voices(self, voices: dict[str, list[tuple[str, np.ndarray]]]) -> None:
        """Each speaker's first reference clips (sample id, wave at the codec's rate), in the data's order."""
        limit = int(self.card.voice_seconds * self.sample_rate)
        self.references = {
            speaker: [(sample_id, wave[:limit]) for sample_id, wave in clips] for speaker, clips in voices.items()
        }
        self._voice_latents: dict[str, torch.Tensor] = {}

    def voice_of(self, speaker: str, sample_id: str):
        """(sample id, wave) of the voice a clip of `speaker` is conditioned on: the speaker's first reference clip,
        its second for that clip itself (itself where the speaker has one clip); None for a speaker the training data
        lacks (a held-out clip's) or without references: the clip is then spoken without a voice prompt."""
        clips = self.references.get(speaker or "")
        if not clips:
            return None
        first = clips[0]
        return clips[1] if first[0] == sample_id and len(clips) > 1 else first

    def voice_latents(self, reference) -> torch.Tensor:
        sample_id, wave = reference
        cached = getattr(self, "_voice_latents", {})
        if sample_id not in cached:
            cached[sample_id] = encode_latents(self.codec, self.processor, wave)
            self._voice_latents = cached
        return cached[sample_id]

    # ------------------------------------------------------------------------------------------ the train step

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The processor's inputs for a batch (the chat template's prompts, the latents given precomputed): each
        clip's latents as labels, each speaker's voice. A cached batch holds each clip's latents as "codes";
        otherwise each clip is encoded alone by the frozen audio tokenizer."""
        latents = [at_least_float32(c) for c in self.clip_codes(batch)]
        speakers = batch.get("speakers") or [""] * len(batch["texts"])
        ids = batch.get("sample_ids") or [str(int(i)) for i in batch["index"]]
        references = [self.voice_of(speaker, sample_id) for speaker, sample_id in zip(speakers, ids)]
        voices = [self.voice_latents(r) for r in references if r is not None]
        prompts = [self.prompt(text, r is not None, training=True) for text, r in zip(batch["texts"], references)]
        with quiet_hf_libraries():
            inputs = self.processor(
                text=prompts, audio_prompt_latents=voices or None, labels=latents, return_tensors="pt", padding=True
            )
        encoded = {k: inputs[k].to(self.device) for k in TRAIN_KEYS if k in inputs}
        for key in ("audio_prompt_latents", "labels"):
            if key in encoded:
                encoded[key] = encoded[key].to(dtype)
        return {**encoded, "indices": torch.as_tensor(batch["index"], dtype=torch.long)}

    def prompt(self, text: str, voiced: bool, training: bool = False) -> str:
        """The chat template's prompt for `text`: after the voice where there is one, before the target audio in
        training."""
        user = ([{"type": "audio"}] if voiced else []) + [{"type": "text", "text": " ".join(text.split())}]
        messages = [{"role": "user", "content": user}]
        if training:
            messages.append({"role": "assistant", "content": [{"type": "audio"}]})
        rendered = self.processor.apply_chat_template(messages, tokenize=False)
        return rendered[0] if isinstance(rendered, list) else rendered

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The class's loss from the labels (the module docstring): each sample's noise and times from (seed, step,
        its dataset index), the step's self-distillation coin from (seed, step)."""
        seeds = torch.tensor([sample_seed(seed, step, int(i), FLOW_PURPOSE) for i in encoded["indices"]])
        distill = sample_seed(seed, step, 0, DISTILL_PURPOSE)
        inputs = {k: encoded[k] for k in TRAIN_KEYS if k in encoded}
        anchor = torch.zeros((), device=self.device, requires_grad=True)
        return at_least_float32(forward(anchor, **inputs, seeds=seeds, distill_seed=distill))

    # ------------------------------------------------------------------------------------------------ samples

    def sample(self, trainable_module, prompts: list[str], sample_spec, resolution=None) -> list[Clip]:
        """The core's samples with the whole class gathered under ZeRO-3 (generate runs the class directly, inside the
        leaf module that gathers it for the training forward only); every rank makes the same calls."""
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(trainable_module.parameters()), modifier_rank=None):
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


def codec_folder(name_or_path: str) -> Path:
    """The audio tokenizer's local folder (it keys the codec cache): the processor's path, or its hub id's snapshot."""
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    try:
        return hub_snapshot(name_or_path)
    except NotAvailableLocally as err:
        raise FamilyError(f"Pocket TTS's audio tokenizer (processor_config.json): {err}") from None


def encode_latents(codec, processor, wave) -> torch.Tensor:
    """(frames, D) float32 latents of one clip (1-D float at the processor's rate), as the processor encodes a
    training clip: the feature extractor without end-on-pause, then the audio tokenizer's encoder, the clip's own
    frames."""
    extractor = processor.feature_extractor
    with quiet_hf_libraries():
        values = extractor(
            np.asarray(wave, dtype=np.float32), sampling_rate=extractor.sampling_rate, end_on_pause=False
        )
    weight = next(codec.parameters())
    with torch.no_grad():
        encoded = codec.encode(
            values["input_values"].to(weight.device, weight.dtype), values["padding_mask"].to(weight.device)
        )
    return at_least_float32(encoded.latents[0][encoded.latents_mask[0].bool()]).cpu()


def generate_wave(model, processor, text: str, max_frames: int, temperature: float, seed: int, voice=None):
    """The waveform (float32 numpy) the class's own generate makes for `text` (in the voice of `voice`, a waveform,
    when given) and the processor decodes, from `seed` without touching the caller's random state; every rank runs the
    same calls."""
    content = ([{"type": "audio", "audio": np.asarray(voice, np.float32)}] if voice is not None else []) + [
        {"type": "text", "text": " ".join(text.split())}
    ]
    device = next(model.parameters()).device
    try:
        with quiet_hf_libraries():
            inputs = processor.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=True, return_dict=True, return_tensors="pt"
            )
    except ValueError as err:
        raise FamilyError(f"Pocket TTS's processor cannot prepare {text[:40]!r} ({first_line(err)})") from None
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), quiet_hf_libraries():
        torch.manual_seed(seed)
        latents = model.generate(
            **inputs, max_new_tokens=max_frames, temperature=temperature, return_dict_in_generate=False
        )
    wave = processor.decode(latents[0].float().cpu())
    return wave.reshape(-1).float().numpy()
