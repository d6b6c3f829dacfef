"""Sesame CSM's class (CsmForConditionalGeneration) on the multi-codebook core: a Llama-shaped backbone over text ids
and Mimi frames predicts codebook 0 of the next frame; a depth decoder, started from the backbone's hidden state,
predicts codebooks 1..Q-1 of that frame. Trained through the class's own loss.

CSM's codec (Mimi) is a submodule of its class. dstune takes it out of the trained module: it stays frozen and fp32,
whole on every rank (never partitioned by ZeRO-3), and encodes each clip alone, so codes are cacheable
(data.cache.codec_tokens, dstune.cache.codec_tokens) and the same for any batch or rank count. The trained module
(`CodebookFramesModel`) holds the rest of the class and does what the class does with `input_values`: each audio
frame's codes are embedded in place of its <|AUDIO|> token, the audio EOS frame (all codes = codebook_eos_token_id)
in place of <|audio_eos|>, and the labels are those codes; then the class's own forward computes the loss.

One utterance is what CSM's processor and chat template make of a (speaker, text, audio) turn:
<|begin_of_text|>[speaker]text<|end_of_text|> <|AUDIO|> x frames <|audio_eos|>, labels on the frames and the EOS frame.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dstune.families.codebooks import CodebooksModel
from dstune.families.precision import at_least_float32
from dstune.families.speech import Clip
from dstune.families.speech_codecs import decode_codes
from dstune.hf import quiet_hf_libraries
from dstune.models.csm.card import CSM_CARD, CsmCard


class CodebookFramesModel(torch.nn.Module):
    """The trained part of a CSM: the class without its codec, taking the frames' codes instead of audio."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, frame_codes, attention_mask, labels=None):
        """input_ids (B, S) text and frame tokens; frame_codes (B, S, Q) the codes at the frame tokens (anything
        elsewhere); labels (B, S, Q): codes to predict, -100 elsewhere. The class's own output (loss from labels)."""
        config = self.model.config
        is_frame = (input_ids == config.audio_token_id) | (input_ids == config.audio_eos_token_id)
        text = self.model.embed_text_tokens(input_ids)
        frames = self.model.backbone_model.embed_tokens(frame_codes)
        embeds = torch.where(is_frame.unsqueeze(-1), frames, text)
        return self.model(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels)


class Csm(CodebooksModel):
    card: CsmCard

    def take_codec(self, whole, dtype: torch.dtype) -> torch.nn.Module:
        attribute = self.card.codec_inside()
        codec = getattr(whole, attribute).to(dtype)
        codec.eval().requires_grad_(False)
        setattr(whole, attribute, None)  # frozen and whole on every rank, outside DeepSpeed
        self.codec_folder, self.codec_kind = self.folder, self.card.codec_kind  # its weights are in the model folder
        self.layout = {
            "sampling_rate": int(codec.config.sampling_rate),
            "frame_rate": float(codec.config.frame_rate),
            "num_codebooks": int(whole.config.num_codebooks),
            "frame_order": [[q, 0] for q in range(whole.config.num_codebooks)],
            "codec": self.card.codec_kind,
        }
        return codec

    def trained_module(self, whole) -> torch.nn.Module:
        # left in host memory in fp32: the start-up casts it to the training dtype, then moves it
        return CodebookFramesModel(whole).train().requires_grad_(True)

    # ------------------------------------------------------------------------------------------ the train step

    def prompt_ids(self, text: str, speaker: str) -> list[int]:
        """<|begin_of_text|>[speaker]text<|end_of_text|>: a turn's text as CSM's chat template writes it."""
        tokenizer = self.processor.tokenizer
        body = tokenizer(f"[{speaker or self.card.default_speaker}]{text}", add_special_tokens=False).input_ids
        return [tokenizer.bos_token_id] + list(body) + [tokenizer.eos_token_id]

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The batch right-padded (pad = <|end_of_text|>, labels -100). A cached batch holds "codes"; otherwise each
        clip is encoded alone by the frozen codec."""
        config, q = self.trainable.model.config, self.layout["num_codebooks"]
        speakers = self.clip_voices(batch)  # CSM's speaker ids
        rows = [
            utterance(config, self.prompt_ids(text, speaker), clip_codes)
            for text, speaker, clip_codes in zip(batch["texts"], speakers, self.clip_codes(batch))
        ]
        length = max(len(ids) for ids, _, _ in rows)
        input_ids = torch.full((len(rows), length), self.processor.tokenizer.pad_token_id, dtype=torch.long)
        frame_codes = torch.zeros((len(rows), length, q), dtype=torch.long)
        labels = torch.full((len(rows), length, q), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for row, (ids, row_codes, row_labels) in enumerate(rows):
            n = len(ids)
            input_ids[row, :n], frame_codes[row, :n], labels[row, :n] = torch.tensor(ids), row_codes, row_labels
            attention_mask[row, :n] = 1
        return {
            "input_ids": input_ids.to(self.device),
            "frame_codes": frame_codes.to(self.device),
            "attention_mask": attention_mask.to(self.device),
            "labels": labels.to(self.device),
            "indices": torch.as_tensor(batch["index"], dtype=torch.long),
        }

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The class's own loss: the backbone's cross-entropy on codebook 0 of each next frame plus the depth
        decoder's on the frame's codebooks (every frame trains the depth decoder); no random draws."""
        out = forward(
            input_ids=encoded["input_ids"],
            frame_codes=encoded["frame_codes"],
            attention_mask=encoded["attention_mask"],
            labels=encoded["labels"],
        )
        return at_least_float32(out.loss)

    # ------------------------------------------------------------------------------------------------ samples

    def speak(self, module, prompt: str, seed: int, voice) -> Clip:
        codes = generate_codes(
            module,
            self.processor,
            int(self.codec.config.codebook_size),
            prompt,
            self.max_frames(),
            self.temperature,
            seed,
            self.card.default_speaker,
        )
        wave = decode_codes(self.codec, self.codec_kind, codes) if codes.shape[1] else np.zeros(0, np.float32)
        return Clip(wave, self.sample_rate)

    @classmethod
    def synthesize(
        cls, folder, text: str, seconds: float, temperature: float, seed: int, speaker: Optional[str] = None
    ) -> Clip:
        """Speech for `text` from an exported folder with the class, its processor and its codec only, as speaker id
        `speaker` (its default speaker when None)."""
        import transformers
        from transformers import AutoProcessor

        card = CSM_CARD
        with quiet_hf_libraries():
            model = getattr(transformers, card.architecture).from_pretrained(Path(folder)).eval()
            processor = AutoProcessor.from_pretrained(Path(folder))
        codec = getattr(model, card.codec_inside())
        frames = max(1, int(seconds * codec.config.frame_rate))
        with torch.no_grad():
            codes = generate_codes(
                model,
                processor,
                int(codec.config.codebook_size),
                text,
                frames,
                temperature,
                seed,
                speaker or card.default_speaker,
            )
        wave = decode_codes(codec, card.codec_kind, codes) if codes.shape[1] else np.zeros(0, np.float32)
        return Clip(wave, int(codec.config.sampling_rate))


def utterance(config, prompt: list[int], codes: torch.Tensor) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(ids, frame codes (S, Q), labels (S, Q)) of one turn: the prompt, one <|AUDIO|> per frame of `codes`
    (Q, frames) and <|audio_eos|>; the labels are the frames' codes and the EOS frame, -100 on the prompt."""
    frames = codes.shape[1]
    ids = prompt + [config.audio_token_id] * frames + [config.audio_eos_token_id]
    eos_frame = torch.full((codes.shape[0], 1), config.codebook_eos_token_id, dtype=torch.long)
    audio = torch.cat([codes.long(), eos_frame], 1).t()
    frame_codes = torch.cat([torch.zeros(len(prompt), codes.shape[0], dtype=torch.long), audio])
    labels = torch.cat([torch.full((len(prompt), codes.shape[0]), -100, dtype=torch.long), audio])
    return ids, frame_codes, labels


def decodable_codes(vocab_size: int, codebook_size: int) -> dict:
    """generate's settings that keep every sampled id a code of the codec: the codebook vocabulary has a few ids
    past the codebook (CSM: 2051 ids, 2048 codes) that an undertrained model may pick and the codec cannot decode."""
    extra = list(range(codebook_size, vocab_size))
    return {"suppress_tokens": extra, "depth_decoder_suppress_tokens": extra} if extra else {}


def generate_codes(
    model, processor, codebook_size: int, text: str, max_frames: int, temperature: float, seed: int, speaker: str
) -> torch.Tensor:
    """(Q, frames) codes the class's own generate makes for `text` (its EOS frame and what follows cut off). The
    draws come from `seed` without touching the caller's random state; every rank runs the same calls."""
    tokenizer = processor.tokenizer
    prompt = f"{tokenizer.bos_token}[{speaker}]{text}{tokenizer.eos_token}"  # the first frame follows, as in training
    inputs = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").to(next(model.parameters()).device)
    sampling = {
        "do_sample": temperature > 0,
        "depth_decoder_do_sample": temperature > 0,
        **decodable_codes(model.config.vocab_size, codebook_size),
    }
    if temperature > 0:
        sampling.update(temperature=temperature, depth_decoder_temperature=temperature)
    with torch.random.fork_rng(devices=[]), quiet_hf_libraries():
        torch.manual_seed(seed)
        frames = model.generate(**inputs, max_new_tokens=max_frames, **sampling)
    frames = frames[0].long().cpu()  # (frames, Q)
    ended = (frames == model.config.codebook_eos_token_id).all(-1).nonzero()
    return frames[: int(ended[0]) if len(ended) else len(frames)].t()
