"""Dia's class (DiaForConditionalGeneration) on the multi-codebook core: a byte-level text encoder and an audio
decoder that predicts every DAC codebook of a frame at once, each codebook delayed by its entry of the delay pattern
(Dia-1.6B: [0, 8, 9, ..., 15] over 9 codebooks). Trained through the class's own loss.

Dia keeps its codec outside the model class: the DiaProcessor holds the DacModel (`audio_tokenizer`, named by path
in processor_config.json). It is frozen, fp32 and whole on every rank; each clip is encoded alone, zero-padded to a
multiple of DAC's hop as the processor pads it, so the codes are cacheable and equal to the processor's.

One utterance, as the processor builds it for training (generation=False): the text's bytes ([S1]/[S2] are ids 1
and 2) on the encoder side; on the decoder side BOS, the frames' codes, EOS, then the delay pattern applied
(codebook c shifted right by delay[c], BOS before, PAD after), left-padded with BOS to the batch's longest clip.
The labels are the delayed sequence one position ahead, -100 on BOS and PAD: the class's loss is the mean
cross-entropy over every codebook of every remaining position (transformers' ForMaskedLM loss: no further shift).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.families.codebooks import CodebooksModel, first_line, pad_rows, read_voice
from dstune.families.precision import at_least_float32
from dstune.families.speech import Clip
from dstune.families.speech_codecs import decode_codes
from dstune.hf import NotAvailableLocally, hub_snapshot, quiet_hf_libraries
from dstune.models.dia.card import DIA_CARD, DiaCard

TRAIN_KEYS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels")


class DiaModule(torch.nn.Module):
    """The trained module: the whole class (its codec is not part of it), under `model.`."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels=None):
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            labels=labels,
        )


class Dia(CodebooksModel):
    card: DiaCard

    @classmethod
    def load_class(cls, card: DiaCard, folder: Path):
        from transformers import DiaForConditionalGeneration, DiaProcessor

        try:
            with quiet_hf_libraries():
                model = DiaForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32)
                processor = DiaProcessor.from_pretrained(folder)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
            raise FamilyError(
                f"{folder}: cannot load it as {card.architecture} with its DiaProcessor and DAC ({first_line(err)})"
            ) from None
        return model, processor

    def take_codec(self, whole, dtype: torch.dtype) -> torch.nn.Module:
        codec = self.processor.audio_tokenizer.to(dtype).eval().requires_grad_(False)
        rate, hop = int(codec.config.sampling_rate), int(codec.config.hop_length)
        channels = int(whole.config.decoder_config.num_channels)
        self.codec_folder, self.codec_kind = codec_folder(codec.name_or_path), self.card.codec_kind
        self.layout = {
            "sampling_rate": rate,
            "frame_rate": rate / hop,
            "num_codebooks": channels,
            "frame_order": [[q, 0] for q in range(channels)],
            "codec": self.card.codec_kind,
        }
        return codec

    def trained_module(self, whole) -> torch.nn.Module:
        return DiaModule(whole).train().requires_grad_(True)

    # ------------------------------------------------------------------------------------------ the train step

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The class's inputs for a batch: text right-padded (pad id 0), audio as decoder_batch. A cached batch
        holds "codes"; otherwise each clip is encoded alone by the frozen DAC."""
        tokenizer = self.processor.tokenizer
        tags = self.card.speaker_tags
        texts = [
            tokenizer(dia_text(text, tags, tag), add_special_tokens=False).input_ids
            for text, tag in zip(batch["texts"], self.clip_voices(batch))
        ]
        input_ids, attention_mask = pad_rows(texts, tokenizer.pad_token_id)
        encoded = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            **decoder_batch(self.trainable.model.config, self.clip_codes(batch)),
        }
        return {
            **{k: v.to(self.device) for k, v in encoded.items()},
            "indices": torch.as_tensor(batch["index"], dtype=torch.long),
        }

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The class's own loss from the labels (mean over every labelled codebook position); no random draws."""
        return at_least_float32(forward(**{k: encoded[k] for k in TRAIN_KEYS}).loss)

    # ------------------------------------------------------------------------------------------------ samples

    def voice_prompt(self, path) -> tuple[np.ndarray, str]:
        """(wave at the DAC's rate, transcript) of a reference clip and the .txt of the same name beside it."""
        path = Path(path).expanduser()
        try:
            text = path.with_suffix(".txt").read_text().strip()
        except OSError as err:
            raise FamilyError(f"sample.voice_prompts: {path}'s transcript cannot be read ({first_line(err)})") from None
        return read_voice(path, self.sample_rate), text

    def speak(self, module, prompt: str, seed: int, voice) -> Clip:
        audio, text = voice if voice else (None, "")
        words = dia_text(f"{text.strip()} {prompt}" if audio is not None else prompt, self.card.speaker_tags)
        codes = generate_codes(module, self.processor, words, self.max_frames(), self.temperature, seed, audio)
        return Clip(dac_wave(self.codec, codes), self.sample_rate)

    @classmethod
    def synthesize(
        cls, folder, text: str, seconds: float, temperature: float, seed: int, speaker: Optional[str] = None
    ) -> Clip:
        """Speech for `text` from a Dia folder with the class, its processor and its DAC only, spoken by the tag
        `speaker` (the first when None)."""
        model, processor = cls.load_class(DIA_CARD, Path(folder))
        model.eval()
        codec = processor.audio_tokenizer.eval()
        frames = max(1, int(seconds * codec.config.sampling_rate / codec.config.hop_length))
        words = dia_text(text, DIA_CARD.speaker_tags, speaker or "")
        with torch.no_grad():
            codes = generate_codes(model, processor, words, frames, temperature, seed)
            wave = dac_wave(codec, codes)
        return Clip(wave, int(codec.config.sampling_rate))


def codec_folder(name_or_path: str) -> Path:
    """The DAC's local folder (it keys the codec-token cache): the processor's path, or its hub id's snapshot."""
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    try:
        return hub_snapshot(name_or_path)
    except NotAvailableLocally as err:
        raise FamilyError(f"Dia's audio tokenizer (processor_config.json): {err}") from None


def dia_text(text: str, speaker_tags: tuple[str, ...], tag: str = "") -> str:
    """A transcript as Dia reads it: kept when it starts with a speaker tag (a dialogue's turns), else spoken by
    `tag` (the clip's speaker), or the first speaker."""
    text = text.strip()
    return text if text.startswith(speaker_tags) else f"{tag or speaker_tags[0]} {text}"


def delayed(frames: torch.Tensor, delays: list[int], bos: int, pad: int) -> torch.Tensor:
    """(B, T, C) frames -> the delay pattern: codebook c shifted right by delays[c] (BOS in front), the sequence
    extended by max(delays) positions of PAD so that every codebook's last code is kept."""
    batch, length, channels = frames.shape
    extended = torch.cat([frames, torch.full((batch, max(delays), channels), pad, dtype=frames.dtype)], 1)
    out = torch.empty_like(extended)
    for channel, delay in enumerate(delays):
        out[:, :delay, channel] = bos
        out[:, delay:, channel] = extended[:, : extended.shape[1] - delay, channel]
    return out


def decoder_batch(config, codes: list[torch.Tensor]) -> dict:
    """decoder_input_ids (B, T, C), decoder_attention_mask (B, T) and labels (B * C, T), channel-major, from each
    clip's (C, frames) codes: [BOS, frames..., EOS] left-padded with BOS to the longest clip, then delayed."""
    decoder = config.decoder_config
    bos, eos, pad = decoder.bos_token_id, decoder.eos_token_id, decoder.pad_token_id
    delays, channels = list(config.delay_pattern), decoder.num_channels
    longest = max(c.shape[1] for c in codes)
    frames = torch.full((len(codes), longest + 2, channels), bos, dtype=torch.long)
    mask = torch.zeros((len(codes), longest + 2 + max(delays)), dtype=torch.long)
    for row, clip in enumerate(codes):
        padding = longest - clip.shape[1]
        frames[row, padding + 1 : padding + 1 + clip.shape[1]] = clip.t().long()
        frames[row, -1] = eos
        mask[row, padding:] = 1
    sequence = delayed(frames, delays, bos, pad)
    labels = sequence[:, 1:].clone()
    labels[(labels == pad) | (labels == bos)] = -100
    # one clip: a view; the class's loss views it flat
    labels = labels.transpose(1, 2).reshape(len(codes) * channels, -1).contiguous()
    return {"decoder_input_ids": sequence[:, :-1], "decoder_attention_mask": mask[:, :-1], "labels": labels}


def undelayed_codes(config, sequence: torch.Tensor, start: int) -> torch.Tensor:
    """(C, frames) codes of a generated (T, C) delayed sequence: the delay reverted, from frame `start` (after BOS
    and any voice prompt) up to the first EOS of codebook 0 (or the last frame every codebook reached)."""
    delays, eos = list(config.delay_pattern), config.decoder_config.eos_token_id
    usable = sequence.shape[0] - max(delays)
    frames = (
        torch.stack([sequence[d : d + usable, c] for c, d in enumerate(delays)], 1) if usable > 0 else (sequence[:0])
    )
    ended = (frames[:, 0] == eos).nonzero()
    end = int(ended[0]) if len(ended) else len(frames)
    codes = frames[start:end]
    return codes.clamp(max=eos - 1).t().long()  # a codebook other than 0 may not have stopped yet: keep it a code


def generate_codes(
    model, processor, words: str, max_frames: int, temperature: float, seed: int, prompt_audio=None
) -> torch.Tensor:
    """(C, frames) codes the class's own generate makes for `words` (after a voice prompt's audio, whose transcript
    `words` starts with: Dia continues it), from `seed` without touching the caller's random state; every rank runs
    the same calls. Guidance, top-k and top-p are the folder's generation_config's; the temperature is the
    caller's."""
    audio = (
        {}
        if prompt_audio is None
        else {
            "audio": [np.asarray(prompt_audio, np.float32)],
            "sampling_rate": processor.feature_extractor.sampling_rate,
        }
    )
    with warnings.catch_warnings():  # DiaTokenizer's own max_length meets the processor's padding=True
        warnings.filterwarnings("ignore", message="`max_length` is ignored")
        inputs = processor(text=[words], **audio).to(next(model.parameters()).device)
    start = int((inputs["decoder_input_ids"][0, :, 0] != model.config.decoder_config.pad_token_id).sum())
    sampling = {"do_sample": temperature > 0, **({"temperature": temperature} if temperature > 0 else {})}
    with torch.random.fork_rng(devices=[]), quiet_hf_libraries():
        torch.manual_seed(seed)
        sequence = model.generate(**inputs, max_new_tokens=max_frames, **sampling)
    return undelayed_codes(model.config, sequence[0].cpu(), start)


def dac_wave(codec, codes: torch.Tensor) -> np.ndarray:
    return decode_codes(codec, "dac", codes) if codes.shape[1] else np.zeros(0, np.float32)
