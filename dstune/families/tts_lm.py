"""The `tts_lm` family: a transformers causal LM over text tokens followed by audio-codec tokens (VALL-E /
GPT-SoVITS-s1 style), with a frozen codec (EnCodec, DAC or Mimi) turning audio into tokens and back.

    build(model: TtsLmModel, folders, device, dtype_for_frozen) -> TtsLmBuilt
    encode_batch(built, batch, dtype) -> {"input_ids", "attention_mask", "labels", "indices"}
    loss(built, trainable_forward, encoded, seed, step) -> scalar tensor (token mean over the micro batch)
    sample(built, lm_module, prompts, sample_spec, resolution) -> list[Clip]   (every rank calls it: ZeRO-3)
    save_samples(clips, prompts, path) -> folder of WAVs (path without its suffix; dstune.families.speech)
    export(built, state_dict, out_dir) -> transformers folder + codec/ + dstune_tts.json
    synthesize(folder, text) -> Clip   (from an exported folder, with transformers and the codec only)

One utterance is the sequence  [text ids] [audio BOS] [frame 0: codebook 0..Q-1] [frame 1: ...] ... [audio EOS],
where codebook q's code c is the token audio_offset + q * codebook_size + c (the flattened residual codes, as in
VALL-E's "flattening" variant). Labels are -100 over the text and the BOS, so the loss is on audio tokens (and
the EOS, which teaches the model when to stop). The layout (dstune_tts.json) travels with the export; an LM
without one gets the audio tokens appended to its vocabulary (resize_token_embeddings).

Codec tokens are deterministic per clip (each clip is encoded alone, in fp32, never padded to a batch), so they
are the same whatever the micro batch, the rank count or the device, and can be cached (dstune.cache.codec_tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from dstune.families.base import Family, FamilyError
from dstune.families.speech import TTS_LAYOUT_FILE, Clip, save_wavs, tts_layout
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import SampleSpec, TtsLmModel

__all__ = ["TtsLmBuilt", "Clip", "build", "encode_batch", "loss", "sample", "export", "FAMILY", "synthesize",
           "encode_clip", "decode_codes"]

_CODEC_CLASSES = {"encodec": "EncodecModel", "dac": "DacModel", "mimi": "MimiModel"}


@dataclass
class TtsLmBuilt:
    folder: Path
    device: torch.device
    trainable: torch.nn.Module  # the causal LM: the only part DeepSpeed wraps
    codec: torch.nn.Module  # frozen, fp32, eval
    codec_folder: Path  # what the codec was loaded from (its fingerprint keys the codec-token cache)
    codec_kind: str
    tokenizer: object  # None: text is UTF-8 bytes (ids 0..255)
    layout: dict  # see dstune.families.speech.tts_layout
    max_sample_seconds: float = 2.0
    temperature: float = 0.8

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"codec": self.codec}

    @property
    def sample_rate(self) -> int:
        return int(self.layout["sampling_rate"])


# ---------------------------------------------------------------------------------------------------- build


def _codec_facts(codec, kind: str) -> tuple[int, int, float]:
    """(codebooks, codebook size, frames per second) of a loaded codec."""
    config = codec.config
    codebooks = config.n_codebooks if kind == "dac" else config.num_quantizers
    frame_rate = config.sampling_rate / config.hop_length if kind == "dac" else config.frame_rate
    return int(codebooks), int(config.codebook_size), float(frame_rate)


def _load_codec(model: TtsLmModel, folder: Path, codec_folder: Optional[Path]):
    import transformers

    source = codec_folder if codec_folder is not None else folder / "codec"
    if not source.is_dir():
        raise FamilyError(f"no codec: {source} does not exist. Set model.codec_pretrained to a {model.codec} folder "
                          f"({_CODEC_CLASSES[model.codec]}.save_pretrained) or put one in {folder / 'codec'}.")
    try:
        with quiet_hf_libraries():
            codec = getattr(transformers, _CODEC_CLASSES[model.codec]).from_pretrained(source, torch_dtype=torch.float32)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
        raise FamilyError(f"{source}: cannot load it as {_CODEC_CLASSES[model.codec]} (model.codec: {model.codec}): "
                          f"{(str(err).strip().splitlines() or [type(err).__name__])[0]}") from None
    return codec.eval().requires_grad_(False), source


def _layout_for(model: TtsLmModel, folder: Path, lm, codec, tokenizer) -> dict:
    codebooks, codebook_size, frame_rate = _codec_facts(codec, model.codec)
    path = folder / TTS_LAYOUT_FILE
    if path.is_file():
        layout = json.loads(path.read_text())
        problems = [f"{name} {layout.get(name)!r} != {value!r}" for name, value in
                    (("codec", model.codec), ("codebook_size", codebook_size), ("vocab_size", lm.config.vocab_size))
                    if layout.get(name) != value]
        if model.num_codebooks not in (None, layout["num_codebooks"]):
            problems.append(f"num_codebooks {layout['num_codebooks']} != model.num_codebooks {model.num_codebooks}")
        if problems:
            raise FamilyError(f"{path} does not match this model and codec: {'; '.join(problems)}. Use the codec this "
                              "LM was trained with, or start from an LM without dstune_tts.json.")
        return layout
    wanted = model.num_codebooks or codebooks
    if wanted > codebooks:
        raise FamilyError(f"model.num_codebooks {wanted}: the codec in use makes only {codebooks}")
    text_vocab = lm.config.vocab_size
    if tokenizer is None and text_vocab < 256:
        raise FamilyError(f"{folder}: no tokenizer and a vocabulary of {text_vocab} < 256 byte ids")
    return tts_layout("tokenizer" if tokenizer is not None else "bytes", text_vocab, wanted, codebook_size,
                      model.codec, codec.config.sampling_rate, frame_rate)


def build(model: TtsLmModel, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32) -> TtsLmBuilt:
    """Load the LM (fp32, train mode) and the codec (fp32 always: its tokens must not depend on the precision)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = folders["pretrained"]
    if not (folder / "config.json").is_file():
        raise FamilyError(f"{folder}: no config.json, so this is not a transformers causal-LM folder")
    try:
        with quiet_hf_libraries():
            lm = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
        raise FamilyError(f"{folder}: cannot load it as a causal LM ({(str(err).strip().splitlines() or [''])[0]})") from None
    tokenizer = None
    if (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(folder)
    codec, codec_folder = _load_codec(model, folder, folders.get("codec_pretrained"))
    layout = _layout_for(model, folder, lm, codec, tokenizer)
    if lm.config.vocab_size < layout["vocab_size"]:
        lm.resize_token_embeddings(layout["vocab_size"])
    if model.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    device = torch.device(device)
    return TtsLmBuilt(folder=folder, device=device, trainable=lm.to(device).train().requires_grad_(True),
                      codec=codec.to(device), codec_folder=codec_folder, codec_kind=model.codec, tokenizer=tokenizer, layout=layout,
                      max_sample_seconds=model.max_sample_seconds, temperature=model.sample_temperature)


# ------------------------------------------------------------------------------------------------ codec


def encode_clip(codec, kind: str, wave: torch.Tensor, num_codebooks: int) -> torch.Tensor:
    """(num_codebooks, frames) int64 codes of one clip (1-D float tensor at the codec's rate)."""
    x = wave.float().reshape(1, 1, -1).to(next(codec.parameters()).device)
    with torch.no_grad():
        if kind == "encodec":
            codes = codec.encode(x, bandwidth=max(codec.config.target_bandwidths)).audio_codes[0, 0]
        elif kind == "mimi":
            codes = codec.encode(x, num_quantizers=num_codebooks).audio_codes[0]
        else:
            codes = codec.encode(x).audio_codes[0]
    return codes[:num_codebooks].long().cpu()


def decode_codes(codec, kind: str, codes: torch.Tensor) -> np.ndarray:
    """float32 waveform of (codebooks, frames) codes."""
    codes = codes.long().to(next(codec.parameters()).device)
    with torch.no_grad():
        if kind == "encodec":
            audio = codec.decode(codes[None, None], [None]).audio_values
        elif kind == "mimi":
            audio = codec.decode(codes[None]).audio_values
        else:
            audio = codec.decode(audio_codes=codes[None]).audio_values
    return audio.reshape(-1).float().cpu().numpy()


def text_ids(built_or_layout, text: str, tokenizer=None) -> list[int]:
    tokenizer = tokenizer if isinstance(built_or_layout, dict) else built_or_layout.tokenizer
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return list(tokenizer(text).input_ids)


def audio_tokens(layout: dict, codes: torch.Tensor) -> torch.Tensor:
    """(codebooks, frames) codes -> flat frame-major audio token ids."""
    offsets = layout["audio_offset"] + layout["codebook_size"] * torch.arange(codes.shape[0]).unsqueeze(1)
    return (codes + offsets).t().reshape(-1)


# --------------------------------------------------------------------------------------------- train step


def encode_batch(built: TtsLmBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """Token sequences of a collated batch, right-padded. A cached batch holds "codes" already; otherwise every
    clip is encoded alone with the codec (no padding effects, no random draws)."""
    layout = built.layout
    codes = batch.get("codes") or [encode_clip(built.codec, built.codec_kind, wave, layout["num_codebooks"])
                                   for wave in batch["audio"]]
    sequences, label_rows = [], []
    for text, clip_codes in zip(batch["texts"], codes):
        prefix = torch.tensor(text_ids(built, text) + [layout["audio_bos"]], dtype=torch.long)
        audio = torch.cat([audio_tokens(layout, clip_codes), torch.tensor([layout["audio_eos"]])])
        sequences.append(torch.cat([prefix, audio]))
        label_rows.append(torch.cat([torch.full_like(prefix, -100), audio]))
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), layout["pad"], dtype=torch.long)
    labels = torch.full((len(sequences), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, (sequence, label) in enumerate(zip(sequences, label_rows)):
        input_ids[row, :len(sequence)], labels[row, :len(label)], attention_mask[row, :len(sequence)] = sequence, label, 1
    device = built.device
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
            "labels": labels.to(device), "indices": torch.as_tensor(batch["index"], dtype=torch.long)}


def loss(built: TtsLmBuilt, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """Cross-entropy over the audio tokens (and audio EOS) of the micro batch; no random draws."""
    out = trainable_forward(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"],
                            labels=encoded["labels"])
    return out.loss.float()


# ------------------------------------------------------------------------------------------------- sampling


def _allowed_mask(layout: dict, position: int, vocab: int) -> torch.Tensor:
    """Audio token `position` (0-based after BOS) may only be a code of codebook position % Q, or EOS at a frame
    start: the output always decodes, whatever an undertrained model prefers."""
    q, size = position % layout["num_codebooks"], layout["codebook_size"]
    mask = torch.zeros(vocab, dtype=torch.bool)
    start = layout["audio_offset"] + q * size
    mask[start:start + size] = True
    if q == 0 and position > 0:
        mask[layout["audio_eos"]] = True
    return mask


def generate_codes(lm, layout: dict, prompt_ids: list[int], max_frames: int, temperature: float,
                   generator: torch.Generator) -> torch.Tensor:
    """(codebooks, frames) codes generated after `prompt_ids` + BOS. Always runs max_frames x Q forward steps
    (cut at EOS afterwards), so every rank makes the same number of calls (ZeRO-3 gathers parameters in them)."""
    device = next(lm.parameters()).device
    ids = torch.tensor([prompt_ids + [layout["audio_bos"]]], dtype=torch.long, device=device)
    nq, generated, past, ended = layout["num_codebooks"], [], None, False
    for position in range(max_frames * nq):
        out = lm(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float().cpu()
        logits[~_allowed_mask(layout, position, logits.numel())] = float("-inf")
        if temperature > 0:
            token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        else:
            token = int(logits.argmax())
        if token == layout["audio_eos"]:
            ended = True
        if not ended:
            generated.append(token)
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
    frames = len(generated) // nq
    flat = torch.tensor(generated[:frames * nq], dtype=torch.long).reshape(frames, nq).t()
    return flat - layout["audio_offset"] - layout["codebook_size"] * torch.arange(nq).unsqueeze(1)


def sample(built: TtsLmBuilt, lm_module: torch.nn.Module, prompts: list[str], sample_spec: SampleSpec,
           resolution=None) -> list[Clip]:
    """One clip per prompt, from sample_spec.seed (the same clips at every step for the same weights)."""
    was_training = lm_module.training
    lm_module.eval()
    max_frames = max(1, int(built.max_sample_seconds * built.layout["frame_rate"]))
    clips = []
    try:
        with torch.no_grad():
            for number, prompt in enumerate(prompts):
                generator = torch.Generator().manual_seed(sample_spec.seed * 1000 + number)
                codes = generate_codes(lm_module, built.layout, text_ids(built, prompt), max_frames,
                                       built.temperature, generator)
                wave = decode_codes(built.codec, built.codec_kind, codes) if codes.shape[1] else np.zeros(0, np.float32)
                clips.append(Clip(wave, built.sample_rate))
    finally:
        lm_module.train(was_training)
    return clips


# --------------------------------------------------------------------------------------------------- export


def export(built: TtsLmBuilt, state_dict: dict, out_dir, pretrained_folder: Optional[Path] = None) -> Path:
    """A folder AutoModelForCausalLM loads, with codec/ and dstune_tts.json beside it (and the tokenizer)."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    with folder_written_atomically(out_dir, "export") as work:
        with quiet_hf_libraries():
            lm = AutoModelForCausalLM.from_config(built.trainable.config)
            missing, unexpected = lm.load_state_dict(state_dict, strict=False)
            tied = {"lm_head.weight"} if getattr(lm.config, "tie_word_embeddings", False) else set()
            if set(missing) - tied or unexpected:
                raise ValueError(f"trained weights do not fit the LM: missing {sorted(set(missing) - tied)[:5]}, "
                                 f"unexpected {sorted(unexpected)[:5]}")
            lm.save_pretrained(work, safe_serialization=True)
            built.codec.save_pretrained(work / "codec")
            if built.tokenizer is not None:
                built.tokenizer.save_pretrained(work)
        (work / TTS_LAYOUT_FILE).write_text(json.dumps(built.layout, indent=2) + "\n")
    return out_dir


def synthesize(folder, text: str, seconds: float = 2.0, temperature: float = 0.8, seed: int = 0) -> Clip:
    """Speech for `text` from an exported folder, using transformers and the codec only (no dstune state)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    layout = json.loads((folder / TTS_LAYOUT_FILE).read_text())
    with quiet_hf_libraries():
        lm = AutoModelForCausalLM.from_pretrained(folder).eval()
        codec = getattr(transformers, _CODEC_CLASSES[layout["codec"]]).from_pretrained(folder / "codec").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder) if layout["text"] == "tokenizer" else None
    with torch.no_grad():
        codes = generate_codes(lm, layout, text_ids(layout, text, tokenizer),
                               max(1, int(seconds * layout["frame_rate"])), temperature,
                               torch.Generator().manual_seed(seed))
    wave = decode_codes(codec, layout["codec"], codes) if codes.shape[1] else np.zeros(0, np.float32)
    return Clip(wave, int(layout["sampling_rate"]))


FAMILY = Family(
    name="tts_lm", modality="audio", pretrained_fields=("pretrained", "codec_pretrained"), build=build,
    encode_batch=encode_batch, loss=loss, sample=sample, save_samples=save_wavs, export=export)
