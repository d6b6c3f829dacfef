"""The `tts_lm` family: a transformers causal LM over text tokens followed by audio-codec tokens (VALL-E /
GPT-SoVITS-s1 / Orpheus style), with a frozen codec (EnCodec, DAC, Mimi or SNAC) turning audio into tokens and back.

    build(model: TtsLmModelSpec, folders, device, dtype_for_frozen) -> TtsLmBuilt
    encode_batch(built, batch, dtype) -> {"input_ids", "attention_mask", "labels", "indices"}
    loss(built, trainable_forward, encoded, seed, step) -> scalar tensor (token mean over the micro batch)
    sample(built, lm_module, prompts, sample_spec, resolution) -> list[Clip]   (every rank calls it: ZeRO-3)
    save_samples(clips, prompts, path) -> folder of WAVs (path without its suffix; dstune.families.speech)
    export(built, state_dict, out_dir) -> transformers folder + codec/ + dstune_tts.json
    synthesize(folder, text) -> Clip   (from an exported folder, with transformers and the codec only)

One utterance is a token sequence described by the layout (dstune.models.tts_lm.token_layouts): a prompt template of
special tokens around the text ids, the audio ids frame by frame (code k at frame position p is the token
audio_offset + p * codebook_size + k), and closing tokens. Preset `dstune`: [text] [audio BOS] [codebook 0..Q-1 per
frame] [audio EOS] with the loss on the audio and EOS (VALL-E's "flattening" variant); preset `orpheus`: SNAC codes,
7 per frame, in Orpheus's prompt, with the loss on every token as Orpheus's fine-tuning script labels them. The
layout (dstune_tts.json) travels with the export; an LM with fewer ids than the layout gets them appended
(resize_token_embeddings).

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

from dstune.families.base import Family, FamilyError, Speaker
from dstune.families.precision import at_least_float32, at_least_float32_dtype
from dstune.families.speech import Clip, CodecTokensBuilt, checkpoint_activations, save_wavs
from dstune.families.speech_codecs import CODEC_CLASSES, codec_facts, decode_codes, encode_clip, load_codec, save_codec
from dstune.models.tts_lm.token_layouts import (
    TTS_LAYOUT_FILE,
    describe,
    dstune_layout,
    layout_problems,
    orpheus_layout,
    prompt_ids,
    spoken_text,
    token,
    training_ids,
)
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import SampleSpec
from dstune.models.tts_lm.spec import TtsLmModelSpec

__all__ = [
    "TtsLmBuilt",
    "Clip",
    "build",
    "encode_batch",
    "loss",
    "sample",
    "export",
    "FAMILY",
    "synthesize",
    "encode_clip",
    "decode_codes",
]


@dataclass(kw_only=True)
class TtsLmBuilt(CodecTokensBuilt):
    """The causal LM (`trainable`), its codec and, beside them, the tokenizer; the codec folder is its own."""

    tokenizer: object  # None: text is UTF-8 bytes (ids 0..255)


# ---------------------------------------------------------------------------------------------------- build


def _load_codec(model: TtsLmModelSpec, folder: Path, codec_folder: Optional[Path], dtype: torch.dtype):
    source = codec_folder if codec_folder is not None else folder / "codec"
    if not source.is_dir():
        raise FamilyError(
            f"no codec: {source} does not exist. Set model.codec_pretrained to a {model.codec} folder "
            f"({CODEC_CLASSES[model.codec]}) or put one in {folder / 'codec'}."
        )
    return load_codec(model.codec, source, dtype), source


def _codec_problems(layout: dict, facts: dict) -> list[str]:
    """Where a layout and the loaded codec disagree (the codec must make the codes the layout writes)."""
    problems = [
        f"{name} {layout.get(name)!r} != the codec's {facts[name]!r}"
        for name in ("codebook_size", "sampling_rate")
        if layout.get(name) != facts[name]
    ]
    per_frame = layout["codes_per_frame"]
    if len(per_frame) > facts["codebooks"] or any(a != b for a, b in zip(per_frame, facts["codes_per_frame"])):
        problems.append(f"codes_per_frame {per_frame} does not fit the codec's {facts['codes_per_frame']}")
    if abs(float(layout["samples_per_frame"]) - float(facts["samples_per_frame"])) > 1e-6:
        problems.append(f"samples_per_frame {layout['samples_per_frame']} != the codec's {facts['samples_per_frame']}")
    return problems


def _layout_for(model: TtsLmModelSpec, folder: Path, codec, tokenizer) -> dict:
    """The layout: the folder's dstune_tts.json, else the spec's preset, else dstune's layout over this LM and
    codec; checked against the codec and the spec (FamilyError naming both)."""
    facts, path = codec_facts(codec, model.codec), folder / TTS_LAYOUT_FILE
    text = "tokenizer" if tokenizer is not None else "bytes"
    if path.is_file():
        layout = describe(json.loads(path.read_text()))
        if model.token_layout not in (None, layout["name"]):
            raise FamilyError(
                f"{path} holds the {layout['name']!r} layout, not model.token_layout "
                f"{model.token_layout!r}: drop model.token_layout or start from another model"
            )
    elif model.token_layout == "orpheus":
        layout = orpheus_layout(text)
    else:
        wanted = model.num_codebooks or facts["codebooks"]
        if wanted > facts["codebooks"]:
            raise FamilyError(f"model.num_codebooks {wanted}: the codec in use makes only {facts['codebooks']}")
        layout = dstune_layout(
            text,
            _text_vocab_size(folder),
            wanted,
            facts["codebook_size"],
            model.codec,
            facts["sampling_rate"],
            facts["sampling_rate"] / facts["samples_per_frame"],
        )
    problems = _codec_problems(layout, facts) + layout_problems(layout)
    if layout.get("codec") != model.codec:
        problems.append(f"codec {layout.get('codec')!r} != model.codec {model.codec!r}")
    if model.num_codebooks not in (None, layout["num_codebooks"]):
        problems.append(f"num_codebooks {layout['num_codebooks']} != model.num_codebooks {model.num_codebooks}")
    if tokenizer is None and layout["text"] == "tokenizer":
        problems.append("the layout reads text with a tokenizer and the folder has none")
    if problems:
        raise FamilyError(
            f"{path if path.is_file() else folder}: the {layout['name']} token layout does not fit this "
            f"model and codec: {'; '.join(problems)}. Use the codec this LM was trained with."
        )
    return layout


def _text_vocab_size(folder: Path) -> int:
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    if vocab < 256 and not (folder / "tokenizer_config.json").is_file():
        raise FamilyError(f"{folder}: no tokenizer and a vocabulary of {vocab} < 256 byte ids")
    return vocab


def grow_vocabulary(lm, size: int) -> None:
    """Resize the LM's embeddings (and untied head) to `size` ids, the new rows the mean of the old ones: the same
    on every rank without any random draw (transformers' default draws them from the global RNG)."""
    old = lm.config.vocab_size
    lm.resize_token_embeddings(size, mean_resizing=False)
    with torch.no_grad():
        for layer in {
            id(m): m for m in (lm.get_input_embeddings(), lm.get_output_embeddings()) if m is not None
        }.values():
            layer.weight[old:] = layer.weight[:old].mean(0)


def _add_text_tokens(model: TtsLmModelSpec, folder: Path, tokenizer, lm, layout: dict) -> dict:
    """model.added_tokens (a new language's words or characters): added to the tokenizer, the LM's embeddings
    grown to hold their ids (before DeepSpeed partitions anything, so ZeRO-3 sees the final shapes) and the
    layout's vocab_size with them. Ids must not land on audio or special ids."""
    if not model.added_tokens:
        return layout
    if tokenizer is None:
        raise FamilyError(f"model.added_tokens: {folder} has no tokenizer to add text tokens to (its text is bytes)")
    tokenizer.add_tokens(list(model.added_tokens))
    ids = tokenizer.convert_tokens_to_ids(list(model.added_tokens))
    audio_start = layout["audio_offset"]
    audio_stop = audio_start + len(layout["frame_order"]) * layout["codebook_size"]
    taken = set(layout["special_tokens"].values())
    clashes = [f"{t!r} -> {i}" for t, i in zip(model.added_tokens, ids) if audio_start <= i < audio_stop or i in taken]
    if clashes:
        raise FamilyError(
            f"model.added_tokens: the tokenizer of {folder} gives {', '.join(clashes)}, ids the "
            "layout uses for audio or special tokens; extend a tokenizer whose ids end after them"
        )
    needed = max(max(ids) + 1, layout["vocab_size"])
    if lm.config.vocab_size < needed:
        grow_vocabulary(lm, needed)
    return {**layout, "vocab_size": lm.config.vocab_size}


def _json_reader(folder: Path) -> Callable[[str], Optional[dict]]:
    def read(name: str) -> Optional[dict]:
        path = folder / name
        return json.loads(path.read_text()) if path.is_file() else None

    return read


def build(model: TtsLmModelSpec, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32) -> TtsLmBuilt:
    """Load the LM (fp32 in host memory, train mode: the start-up casts and moves it) and the codec (fp32 whatever the frozen dtype, float64 in a float64 run: its tokens must not depend on the
    precision)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = folders["pretrained"]
    if not (folder / "config.json").is_file():
        raise FamilyError(f"{folder}: no config.json, so this is not a transformers causal-LM folder")
    model = model.model_copy(update=model.folder_defaults(_json_reader(folder)))  # model.codec left out: the folder's
    try:
        with quiet_hf_libraries():
            lm = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
        raise FamilyError(
            f"{folder}: cannot load it as a causal LM ({(str(err).strip().splitlines() or [''])[0]})"
        ) from None
    tokenizer = None
    if (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(folder)
    codec, codec_folder = _load_codec(
        model, folder, folders.get("codec_pretrained"), at_least_float32_dtype(dtype_for_frozen)
    )
    layout = _layout_for(model, folder, codec, tokenizer)
    if (folder / TTS_LAYOUT_FILE).is_file() and lm.config.vocab_size != layout["vocab_size"]:
        raise FamilyError(
            f"{folder / TTS_LAYOUT_FILE} does not match this model: vocab_size {layout['vocab_size']} != "
            f"the LM's {lm.config.vocab_size}. Start from the LM this layout was written with."
        )
    if lm.config.vocab_size < layout["vocab_size"]:
        if model.train == "lora":  # the appended audio rows would stay at their start under LoRA: refuse
            raise FamilyError(
                f"{folder}: train: lora needs an LM that already has the layout's {layout['vocab_size']} "
                f"ids (it has {lm.config.vocab_size}); train it fully first, then LoRA from its export"
            )
        grow_vocabulary(lm, layout["vocab_size"])
    layout = _add_text_tokens(model, folder, tokenizer, lm, layout)
    if model.gradient_checkpointing:
        checkpoint_activations(lm)
    device = torch.device(device)
    return TtsLmBuilt(
        folder=folder,
        device=device,
        trainable=lm.train().requires_grad_(True),
        codec=codec.to(device),
        codec_folder=codec_folder,
        codec_kind=model.codec,
        tokenizer=tokenizer,
        layout=layout,
        max_sample_seconds=model.max_sample_seconds,
        temperature=model.sample_temperature,
    )


# ------------------------------------------------------------------------------------------------ codec


def text_ids(built_or_layout, text: str, tokenizer=None) -> list[int]:
    tokenizer = tokenizer if isinstance(built_or_layout, dict) else built_or_layout.tokenizer
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return list(tokenizer(text).input_ids)


def audio_tokens(layout: dict, codes: torch.Tensor) -> torch.Tensor:
    """(positions, frames) codes -> flat frame-major audio token ids."""
    offsets = layout["audio_offset"] + layout["codebook_size"] * torch.arange(codes.shape[0]).unsqueeze(1)
    return (codes + offsets).t().reshape(-1)


# --------------------------------------------------------------------------------------------- train step


def encode_batch(built: TtsLmBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """Token sequences of a collated batch, right-padded. A cached batch holds "codes" already; otherwise every
    clip is encoded alone with the codec (no padding effects, no random draws)."""
    layout = built.layout
    codes = batch.get("codes") or [
        encode_clip(built.codec, built.codec_kind, wave, layout["num_codebooks"], layout["frame_order"])
        for wave in batch["audio"]
    ]
    sequences, label_rows = [], []
    speakers = batch.get("speakers") or [""] * len(batch["texts"])
    for text, speaker, clip_codes in zip(batch["texts"], speakers, codes):
        spoken = spoken_text(layout, text, speaker)  # "ann: Hello." where the layout names voices (orpheus)
        ids, labels = training_ids(layout, text_ids(built, spoken), audio_tokens(layout, clip_codes).tolist())
        sequences.append(torch.tensor(ids, dtype=torch.long))
        label_rows.append(torch.tensor(labels, dtype=torch.long))
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), token(layout, layout["pad"]), dtype=torch.long)
    labels = torch.full((len(sequences), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, (sequence, label) in enumerate(zip(sequences, label_rows)):
        input_ids[row, : len(sequence)], labels[row, : len(label)], attention_mask[row, : len(sequence)] = (
            sequence,
            label,
            1,
        )
    device = built.device
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "labels": labels.to(device),
        "indices": torch.as_tensor(batch["index"], dtype=torch.long),
    }


def loss(built: TtsLmBuilt, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """Cross-entropy over the audio tokens (and audio EOS) of the micro batch; no random draws."""
    out = trainable_forward(
        input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], labels=encoded["labels"]
    )
    return at_least_float32(out.loss)


# ------------------------------------------------------------------------------------------------- sampling


def _allowed_mask(layout: dict, position: int, vocab: int) -> torch.Tensor:
    """Audio token `position` (0-based after BOS) may only be a code of codebook position % Q, or EOS at a frame
    start: the output always decodes, whatever an undertrained model prefers."""
    q, size = position % len(layout["frame_order"]), layout["codebook_size"]
    mask = torch.zeros(vocab, dtype=torch.bool)
    start = layout["audio_offset"] + q * size
    mask[start : start + size] = True
    if q == 0 and position > 0:
        mask[token(layout, layout["stop"])] = True
    return mask


def generate_codes(
    lm, layout: dict, text_ids: list[int], max_frames: int, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    """(positions, frames) codes generated after the layout's prompt around `text_ids`. Always runs max_frames x Q forward steps
    (cut at EOS afterwards), so every rank makes the same number of calls (ZeRO-3 gathers parameters in them)."""
    device = next(lm.parameters()).device
    ids = torch.tensor([prompt_ids(layout, text_ids)], dtype=torch.long, device=device)
    nq, generated, past, ended = len(layout["frame_order"]), [], None, False
    stop_id = token(layout, layout["stop"])
    for position in range(max_frames * nq):
        out = lm(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float().cpu()
        logits[~_allowed_mask(layout, position, logits.numel())] = float("-inf")
        if temperature > 0:
            next_id = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        else:
            next_id = int(logits.argmax())
        if next_id == stop_id:
            ended = True
        if not ended:
            generated.append(next_id)
        ids = torch.tensor([[next_id]], dtype=torch.long, device=device)
    frames = len(generated) // nq
    flat = torch.tensor(generated[: frames * nq], dtype=torch.long).reshape(frames, nq).t()
    return flat - layout["audio_offset"] - layout["codebook_size"] * torch.arange(nq).unsqueeze(1)


def sample(
    built: TtsLmBuilt, lm_module: torch.nn.Module, prompts: list[str], sample_spec: SampleSpec, resolution=None
) -> list[Clip]:
    """One clip per prompt, from sample_spec.seed (the same clips at every step for the same weights)."""
    was_training = lm_module.training
    lm_module.eval()
    max_frames = max(1, int(built.max_sample_seconds * built.layout["frame_rate"]))
    clips = []
    try:
        with torch.no_grad():
            for number, prompt in enumerate(prompts):
                generator = torch.Generator().manual_seed(sample_spec.seed * 1000 + number)
                codes = generate_codes(
                    lm_module, built.layout, text_ids(built, prompt), max_frames, built.temperature, generator
                )
                wave = (
                    decode_codes(built.codec, built.codec_kind, codes, built.layout["frame_order"])
                    if codes.shape[1]
                    else np.zeros(0, np.float32)
                )
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
                raise ValueError(
                    f"trained weights do not fit the LM: missing {sorted(set(missing) - tied)[:5]}, "
                    f"unexpected {sorted(unexpected)[:5]}"
                )
        _write_lm_folder(built, lm, work)
    return out_dir


def _write_lm_folder(built: TtsLmBuilt, lm, work: Path) -> None:
    """The LM, codec/, tokenizer and dstune_tts.json: a folder synthesize and the model's own recipe load."""
    with quiet_hf_libraries():
        lm.save_pretrained(work, safe_serialization=True)
        save_codec(built.codec, built.codec_kind, built.codec_folder, work / "codec")
        if built.tokenizer is not None:
            built.tokenizer.save_pretrained(work)
    (work / TTS_LAYOUT_FILE).write_text(json.dumps(built.layout, indent=2) + "\n")


ADAPTER_FOLDER = "adapter"  # the peft adapter folder inside a LoRA export


def save_lora_weights(built: TtsLmBuilt, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
    """A LoRA export (model.train: lora): the base LM (reloaded from its folder: the trained module may be
    partitioned) with the adapters, written twice: `adapter/` as peft writes it (adapter_config.json naming the base
    folder + adapter_model.safetensors; PeftModel.from_pretrained(base, folder/'adapter') loads it), and the merged
    LM (merge_and_unload) as a full folder, so synthesize and the model's own inference code need nothing new."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    fields = {k: v for k, v in adapter_metadata.items() if k in LoraConfig.__dataclass_fields__ and k != "peft_type"}
    with quiet_hf_libraries():
        base = AutoModelForCausalLM.from_pretrained(built.folder, torch_dtype=torch.float32)
        peft_lm = get_peft_model(base, LoraConfig(**{**fields, "init_lora_weights": False}))
        result = set_peft_model_state_dict(peft_lm, {f"base_model.model.{k}": v for k, v in lora_layers.items()})
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"LoRA weights do not fit the LM: unexpected {sorted(result.unexpected_keys)[:5]}")
        peft_lm.peft_config["default"].base_model_name_or_path = str(built.folder)
        peft_lm.save_pretrained(folder / ADAPTER_FOLDER, safe_serialization=True)
        merged = peft_lm.merge_and_unload()
    _write_lm_folder(built, merged, folder)


def synthesize(folder, text: str, seconds: float = 2.0, temperature: float = 0.8, seed: int = 0) -> Clip:
    """Speech for `text` from an exported folder, using transformers and the codec only (no dstune state)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    layout = describe(json.loads((folder / TTS_LAYOUT_FILE).read_text()))
    with quiet_hf_libraries():
        lm = AutoModelForCausalLM.from_pretrained(folder).eval()
    codec = load_codec(layout["codec"], folder / "codec")
    tokenizer = AutoTokenizer.from_pretrained(folder) if layout["text"] == "tokenizer" else None
    with torch.no_grad():
        codes = generate_codes(
            lm,
            layout,
            text_ids(layout, text, tokenizer),
            max(1, int(seconds * layout["frame_rate"])),
            temperature,
            torch.Generator().manual_seed(seed),
        )
    wave = (
        decode_codes(codec, layout["codec"], codes, layout["frame_order"])
        if codes.shape[1]
        else np.zeros(0, np.float32)
    )
    return Clip(wave, int(layout["sampling_rate"]))


FAMILY = Family(
    name="tts_lm",
    modality="audio",
    pretrained_fields=("pretrained", "codec_pretrained"),
    build=build,
    encode_batch=encode_batch,
    loss=loss,
    sample=sample,
    save_samples=save_wavs,
    export=export,
    save_lora_weights=save_lora_weights,
    speaker=Speaker(lambda folder: (Path(folder) / TTS_LAYOUT_FILE).is_file(), synthesize),
)
