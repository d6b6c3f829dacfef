"""VibeVoice's class (VibeVoiceForConditionalGeneration) on the multi-codebook core: a Qwen2 LM over the script's
text and the speech's continuous acoustic latents (7.5 per second), whose hidden state conditions a diffusion head
that denoises the next latent. Its loss is the class's LM loss from the labels and its own compute_diffusion_loss;
its samples, the class's generate.

The "codec" is the class's own acoustic tokenizer (`model.audio_tower`): a frozen fp32 copy of it, outside the
trained module, encodes each clip alone (the processor's feature extractor first: -25 dB FS, zero-padded to the
hop) into its latents, which the codec cache holds (float32, one row per frame). The trained module keeps the
whole class, tokenizers included but frozen, so that generate and the export are the class's own.

One utterance is what the processor's chat template writes for a script, then the speech as generate produces it:
    system prompt, " Text input:\\n", " Speaker N: text\\n" per turn, " Speech output:\\n", <audio BOS>,
    one <audio> per latent, <audio EOS>, <|endoftext|>
The labels are the ids with -100 on padding only; the class shifts them. Two deliberate differences from what the
processor builds with output_labels=True (docs/tts.md, VibeVoice), both taken from what generate does:
- the <audio> placeholders stay targets. generate continues the speech while the LM's argmax is <audio> and stops
  at <audio EOS>; with the placeholders masked (the processor) the LM only ever learns <audio EOS> there, and after
  a few steps it ends every utterance at once (seen on builtin:tiny-vibevoice: silent samples after 4 steps).
- each latent is diffused from the LM's hidden state one position before its own placeholder (the audio BOS for the
  first), the state generate conditions the diffusion head on. The processor's acoustic_loss_mask marks the
  placeholders themselves: a state that has already seen, as its input, the latent it is asked to denoise.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dstune.families.codebooks import CodebooksModel, pad_rows
from dstune.families.precision import at_least_float32
from dstune.families.randomness import sample_seed
from dstune.families.speech import Clip
from dstune.hf import quiet_hf_libraries
from dstune.models.vibevoice.card import SCRIPT_LINE, VIBEVOICE_CARD, VibeVoiceCard

DIFFUSION_PURPOSE = "vibevoice-diffusion"  # the per-sample draw of the diffusion's noise and timesteps
TRAIN_KEYS = ("input_ids", "attention_mask", "latents", "labels", "audio_mask", "condition_mask")


def factors_as_buffers(model, factors: tuple[str, ...]) -> None:
    """The class's latent scaling and bias (frozen scalars) become buffers of the same names: generate and the
    training step read them outside the forward of the module that holds them, where ZeRO-3 would have left each
    rank an empty share of a parameter; buffers stay whole on every rank. The state dict keeps their names."""
    inner = model.model
    for name in factors:
        value = inner._parameters.pop(name).detach().clone()
        inner.register_buffer(name, value)


class VibeVoiceModule(torch.nn.Module):
    """The trained module: the whole class under `model.` (the core's export and LoRA code find its names)."""

    def __init__(self, model, scheduler, diffusion_steps: int, noise_draws: int):
        super().__init__()
        self.model = model
        self.scheduler = scheduler
        self.diffusion_steps = diffusion_steps
        self.noise_draws = noise_draws

    def forward(self, input_ids, attention_mask, latents, labels, audio_mask, condition_mask, seeds):
        """latents (A, D): every <audio> placeholder's latent in row-major order; condition_mask (B, S): where each
        latent's condition is read; seeds (B,): each sample's draw. The class's loss: (1 - w) LM + w diffusion."""
        outer = self.model
        inner = outer.model
        # as VibeVoiceModel.forward does with input_values: the scaled latents, projected, replace the placeholders
        features = ((latents + inner.latent_bias_factor) * inner.latent_scaling_factor).to(latents.dtype)
        embeds = outer.get_input_embeddings()(input_ids)
        projected = inner.multi_modal_projector(features).to(embeds.dtype)
        embeds = embeds.masked_scatter(audio_mask.unsqueeze(-1).expand_as(embeds), projected)
        out = outer(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels)
        weight = outer.config.diffusion_loss_weight
        if weight <= 0:
            return out.loss, out.loss, out.loss * 0
        diffusion = self.diffusion_loss(out.last_hidden_state, features, audio_mask, condition_mask, seeds)
        return (1 - weight) * out.loss + weight * diffusion, out.loss, diffusion

    def diffusion_loss(self, hidden, features, audio_mask, condition_mask, seeds):
        """The class's compute_diffusion_loss sample by sample, each with its own seeded noise and timesteps (so
        the draw does not depend on the micro batch or the rank), averaged over every latent of the batch as the
        class averages its one call over the batch."""
        counts = audio_mask.sum(1).tolist()
        starts = np.cumsum([0] + counts)
        total, weighted = sum(counts), 0
        device = features.device
        for row, count in enumerate(counts):
            if not count:
                continue
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(int(seeds[row]))
                part = type(self.model).compute_diffusion_loss(
                    self.model.model.diffusion_head,
                    features[starts[row] : starts[row + 1]],
                    hidden[row][condition_mask[row]],
                    self.scheduler,
                    self.noise_draws,
                    self.diffusion_steps,
                )
            weighted = weighted + part * (count / total)
        return weighted if total else hidden.sum() * 0


def noise_scheduler(model):
    """The diffusion's training scheduler: the one the class builds from its generation_config (diffusers)."""
    return model._build_default_noise_scheduler(model.generation_config)


class VibeVoice(CodebooksModel):
    card: VibeVoiceCard

    def take_codec(self, whole, dtype: torch.dtype) -> torch.nn.Module:
        """A copy of the class's acoustic tokenizer (the class keeps its own, frozen, for generate)."""
        codec = copy.deepcopy(whole.model.audio_tower).to(dtype)
        codec.eval().requires_grad_(False)
        rate = int(self.processor.feature_extractor.sampling_rate)
        hop = int(whole.config.audio_config.hop_length)
        self.codec_folder, self.codec_kind = self.folder, self.card.latents_kind
        self.layout = {
            "sampling_rate": rate,
            "frame_rate": rate / hop,
            "num_codebooks": int(whole.config.audio_config.hidden_size),  # values per latent frame
            "frame_order": [],
            "codec": self.card.latents_kind,
        }
        return codec

    def trained_module(self, whole) -> torch.nn.Module:
        factors_as_buffers(whole, self.card.latent_factors)
        scheduler = noise_scheduler(whole)
        steps = int(scheduler.config.num_train_timesteps)
        trainable = VibeVoiceModule(whole, scheduler, steps, self.card.noise_draws).train().requires_grad_(True)
        for name in self.card.frozen_parts():  # names in the class; the trained module holds it under `model.`
            if name.rsplit(".", 1)[-1] not in self.card.latent_factors:  # buffers now
                trainable.get_submodule("model." + name).requires_grad_(False).eval()
        return trainable

    def encode_clip(self, wave: torch.Tensor) -> torch.Tensor:
        """One clip's acoustic latents (frames, D), float: what the codec cache stores."""
        return encode_latents(self.codec, self.processor, wave.numpy())

    # ------------------------------------------------------------------------------------------ the train step

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The class's inputs for a batch, right-padded with <|endoftext|>. A cached batch holds each clip's latents
        as "codes"; otherwise each clip is encoded alone by the frozen acoustic tokenizer."""
        config, tokenizer = self.trainable.model.config, self.processor.tokenizer
        latents = self.clip_codes(batch)
        speakers = self.clip_voices(batch)  # VibeVoice's speaker numbers
        end_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        rows = [
            self.prompt_ids(text, speaker) + [config.audio_token_id] * len(clip) + [config.audio_eos_token_id, end_id]
            for text, speaker, clip in zip(batch["texts"], speakers, latents)
        ]
        input_ids, attention_mask = pad_rows(rows, tokenizer.pad_token_id)
        audio_mask = input_ids == config.audio_token_id
        labels = input_ids.masked_fill(attention_mask == 0, -100)  # the placeholders are targets: "continue"
        condition_mask = torch.zeros_like(audio_mask)
        condition_mask[:, :-1] = audio_mask[:, 1:]  # the position before each latent's own
        device = self.device
        return {
            "input_ids": input_ids.to(device),
            "attention_mask": attention_mask.to(device),
            "latents": torch.cat([at_least_float32(c) for c in latents]).to(device, dtype),
            "labels": labels.to(device),
            "audio_mask": audio_mask.to(device),
            "condition_mask": condition_mask.to(device),
            "indices": torch.as_tensor(batch["index"], dtype=torch.long),
        }

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """(1 - diffusion_loss_weight) x the class's LM loss from the labels + diffusion_loss_weight x its
        compute_diffusion_loss; each sample's noise and timesteps from (seed, step, its dataset index)."""
        seeds = torch.tensor([sample_seed(seed, step, int(i), DIFFUSION_PURPOSE) for i in encoded["indices"]])
        total, _, _ = forward(**{k: encoded[k] for k in TRAIN_KEYS}, seeds=seeds)
        return at_least_float32(total)

    def prompt_ids(self, text: str, speaker: str = "") -> list[int]:
        """The chat template's ids up to and including the speech output's audio BOS."""
        messages = script_messages(text, speaker or "", self.card.default_speaker)
        rendered = self.processor.apply_chat_template(messages, tokenize=False)
        rendered = rendered[0] if isinstance(rendered, list) else rendered
        return self.processor.tokenizer(rendered, add_special_tokens=False).input_ids

    # ------------------------------------------------------------------------------------------------ samples

    def speak(self, module, prompt: str, seed: int, voice) -> Clip:
        """In the voice of its reference clip (its transcript is not part of VibeVoice's voice input)."""
        wave = generate_wave(module, self.processor, prompt, self.max_frames(), seed, self.card.default_speaker, voice)
        return Clip(wave, self.sample_rate)

    @classmethod
    def synthesize(
        cls, folder, text: str, seconds: float, temperature: float, seed: int, speaker: Optional[str] = None
    ) -> Clip:
        """Speech for `text` from a VibeVoice folder with the class and its processor only, as "Speaker `speaker`"
        (its default speaker when None; generate picks tokens by argmax: `temperature` is not used by VibeVoice's
        generate)."""
        model, processor = cls.load_class(VIBEVOICE_CARD, Path(folder))
        model.eval()
        rate = int(processor.feature_extractor.sampling_rate)
        frames = max(1, int(seconds * rate / model.config.audio_config.hop_length))
        with torch.no_grad():
            wave = generate_wave(model, processor, text, frames, seed, speaker or VIBEVOICE_CARD.default_speaker)
        return Clip(wave, rate)


def encode_latents(codec, processor, wave) -> torch.Tensor:
    """(frames, D) float32 (float64 from a float64 codec) latents of one clip (1-D float at the processor's rate),
    as the class's forward makes them from the processor's input_values with sample=False: the feature extractor's
    loudness normalisation and padding, then the acoustic tokenizer's encoder, one frame per started hop."""
    rate = processor.feature_extractor.sampling_rate
    values = processor.feature_extractor(
        np.asarray(wave, dtype=np.float32), sampling_rate=rate, return_tensors="pt", return_attention_mask=True
    )
    frames = math.ceil(int(values["padding_mask"].sum()) / codec.config.hop_length)
    with torch.no_grad():
        weight = next(codec.parameters())
        latents = codec.encode(values["input_values"].to(weight.device, weight.dtype), sample=False).latents
    return at_least_float32(latents[0, :frames]).cpu()


def turns(text: str, speaker: str, default_speaker: str) -> list[tuple[str, str]]:
    """(speaker number, text) turns of a transcript: its "Speaker N: ..." lines, else one turn of the clip's
    speaker number (its speaker as the run's map numbers it: VibeVoice's speakers are numbers), else of the default
    speaker."""
    found = [m.groups() for m in map(SCRIPT_LINE.match, text.strip().splitlines()) if m]
    if found:
        return [(number, words.strip()) for number, words in found]
    return [(speaker or default_speaker, " ".join(text.split()))]


def script_messages(text: str, speaker: str, default_speaker: str, voice=None) -> list[dict]:
    """The processor's chat messages for a script; `voice` (a waveform) is the first speaker's reference clip."""
    messages = [
        {"role": role, "content": [{"type": "text", "text": words}]}
        for role, words in turns(text, speaker, default_speaker)
    ]
    if voice is not None:
        messages[0]["content"].append({"type": "audio", "audio": np.asarray(voice, np.float32)})
    return messages


def generate_wave(model, processor, text: str, max_frames: int, seed: int, default_speaker: str, voice=None):
    """The waveform (float32 numpy) the class's own generate makes for `text` (after a reference voice when given),
    from `seed` without touching the caller's random state; every rank runs the same calls."""
    inputs = processor.apply_chat_template(
        script_messages(text, "", default_speaker, voice), tokenize=True, return_dict=True, return_tensors="pt"
    )
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), quiet_hf_libraries():
        torch.manual_seed(seed)
        audio = model.generate(**inputs, max_new_tokens=max_frames + 2)
    wave = audio[0] if audio and audio[0] is not None else None
    return np.zeros(0, np.float32) if wave is None else wave.reshape(-1).float().cpu().numpy()
