"""The codec-token TTS LMs' class (`model.family tts_lm`): a transformers causal LM over text tokens followed by
audio-codec tokens (VALL-E / GPT-SoVITS-s1 / Orpheus style), with a frozen codec (EnCodec, DAC, Mimi or SNAC) turning
audio into tokens and back. Its loss is the LM's cross-entropy from labels (the token mean over the micro batch);
its export a transformers folder with codec/ and dstune_tts.json beside it, which `dstune synthesize` speaks from
with transformers and the codec only.

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
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.families.precision import at_least_float32, at_least_float32_dtype
from dstune.families.speakers import write_voices
from dstune.families.speech import Clip, CodecTokensModel, checkpoint_activations
from dstune.families.speech_codecs import CODEC_CLASSES, codec_facts, decode_codes, load_codec, save_codec
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries
from dstune.models.tts_lm.card import CODEC, TtsLmCard
from dstune.models.tts_lm.spec import TtsLmModelSpec
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

ADAPTER_FOLDER = "adapter"  # the peft adapter folder inside a LoRA export


class TtsLm(CodecTokensModel):
    """`trainable` is the causal LM; `tokenizer` beside it (None: text is UTF-8 bytes, ids 0..255)."""

    card: TtsLmCard

    @classmethod
    def load(cls, card, model_spec, folders: dict, device, frozen_dtype=torch.float32, zero3_config=None, **_):
        """The LM (fp32 in host memory, train mode: the start-up casts and moves it) and the codec (fp32 whatever
        the frozen dtype, float64 in a float64 run: its tokens must not depend on the precision)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = folders["pretrained"]
        if not (folder / "config.json").is_file():
            raise FamilyError(f"{folder}: no config.json, so this is not a transformers causal-LM folder")
        # model.codec left out: the folder's
        model_spec = model_spec.model_copy(update=model_spec.folder_defaults(json_reader(folder)))
        try:
            with quiet_hf_libraries():
                lm = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
            raise FamilyError(
                f"{folder}: cannot load it as a causal LM ({(str(err).strip().splitlines() or [''])[0]})"
            ) from None
        model = cls(card, model_spec, folder, device)
        model.tokenizer = (
            AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").is_file() else None
        )
        codec, model.codec_folder = load_folder_codec(
            model_spec, folder, folders.get("codec_pretrained"), at_least_float32_dtype(frozen_dtype)
        )
        model.codec_kind = model_spec.codec
        layout = layout_for(model_spec, folder, codec, model.tokenizer)
        if (folder / TTS_LAYOUT_FILE).is_file() and lm.config.vocab_size != layout["vocab_size"]:
            raise FamilyError(
                f"{folder / TTS_LAYOUT_FILE} does not match this model: vocab_size {layout['vocab_size']} != "
                f"the LM's {lm.config.vocab_size}. Start from the LM this layout was written with."
            )
        if lm.config.vocab_size < layout["vocab_size"]:
            if model_spec.train == "lora":  # the appended audio rows would stay at their start under LoRA: refuse
                raise FamilyError(
                    f"{folder}: train: lora needs an LM that already has the layout's {layout['vocab_size']} "
                    f"ids (it has {lm.config.vocab_size}); train it fully first, then LoRA from its export"
                )
            grow_vocabulary(lm, layout["vocab_size"])
        model.layout = add_text_tokens(model_spec, folder, model.tokenizer, lm, layout)
        if model_spec.gradient_checkpointing:
            checkpoint_activations(lm)
        model.trainable = lm.train().requires_grad_(True)
        model.codec = codec.to(model.device)
        return model

    def text_ids(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text)

    # ------------------------------------------------------------------------------------------ the train step

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """Token sequences of a collated batch, right-padded. A cached batch holds "codes" already; otherwise every
        clip is encoded alone with the codec (no padding effects, no random draws)."""
        layout = self.layout
        sequences, label_rows = [], []
        speakers = self.clip_voices(batch)  # the names a layout that names voices puts in the prompt
        for text, speaker, clip_codes in zip(batch["texts"], speakers, self.clip_codes(batch)):
            spoken = spoken_text(layout, text, speaker)  # "ann: Hello." where the layout names voices (orpheus)
            ids, labels = training_ids(layout, self.text_ids(spoken), audio_tokens(layout, clip_codes).tolist())
            sequences.append(torch.tensor(ids, dtype=torch.long))
            label_rows.append(torch.tensor(labels, dtype=torch.long))
        length = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), length), token(layout, layout["pad"]), dtype=torch.long)
        labels = torch.full((len(sequences), length), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, (sequence, label) in enumerate(zip(sequences, label_rows)):
            input_ids[row, : len(sequence)], labels[row, : len(label)] = sequence, label
            attention_mask[row, : len(sequence)] = 1
        return {
            "input_ids": input_ids.to(self.device),
            "attention_mask": attention_mask.to(self.device),
            "labels": labels.to(self.device),
            "indices": torch.as_tensor(batch["index"], dtype=torch.long),
        }

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """Cross-entropy over the labelled tokens of the micro batch (dstune's layout: the audio and its EOS;
        Orpheus's: every token); no random draws."""
        out = forward(
            input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], labels=encoded["labels"]
        )
        return at_least_float32(out.loss)

    # ------------------------------------------------------------------------------------------------ samples

    def speak(self, module, prompt: str, seed: int, voice) -> Clip:
        codes = generate_codes(
            module,
            self.layout,
            self.text_ids(prompt),
            self.max_frames(),
            self.temperature,
            torch.Generator().manual_seed(seed),
        )
        return Clip(layout_wave(self.codec, self.codec_kind, self.layout["frame_order"], codes), self.sample_rate)

    @classmethod
    def speaks_from(cls, card, folder: Path) -> bool:
        return (Path(folder) / TTS_LAYOUT_FILE).is_file()

    @classmethod
    def synthesize(
        cls, folder, text: str, seconds: float, temperature: float, seed: int, speaker: Optional[str] = None
    ) -> Clip:
        """Speech for `text` from an exported folder, using transformers and the codec only (no dstune state), its
        prompt naming `speaker` where the layout names voices."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = Path(folder)
        layout = describe(json.loads((folder / TTS_LAYOUT_FILE).read_text()))
        with quiet_hf_libraries():
            lm = AutoModelForCausalLM.from_pretrained(folder).eval()
        codec = load_codec(layout["codec"], folder / CODEC)
        tokenizer = AutoTokenizer.from_pretrained(folder) if layout["text"] == "tokenizer" else None
        frames = max(1, int(seconds * layout["frame_rate"]))
        with torch.no_grad():
            ids = text_ids(tokenizer, spoken_text(layout, text, speaker or ""))
            codes = generate_codes(lm, layout, ids, frames, temperature, torch.Generator().manual_seed(seed))
        return Clip(layout_wave(codec, layout["codec"], layout["frame_order"], codes), int(layout["sampling_rate"]))

    # ------------------------------------------------------------------------------------------------- export

    def export(self, state_dict: dict, out_dir, pretrained_folder: Optional[Path] = None) -> Path:
        """A folder AutoModelForCausalLM loads, with codec/ and dstune_tts.json beside it (and the tokenizer)."""
        from transformers import AutoModelForCausalLM

        out_dir = Path(out_dir)
        with folder_written_atomically(out_dir, "export") as work:
            with quiet_hf_libraries():
                lm = AutoModelForCausalLM.from_config(self.trainable.config)
                missing, unexpected = lm.load_state_dict(state_dict, strict=False)
                tied = {"lm_head.weight"} if getattr(lm.config, "tie_word_embeddings", False) else set()
                if set(missing) - tied or unexpected:
                    raise ValueError(
                        f"trained weights do not fit the LM: missing {sorted(set(missing) - tied)[:5]}, "
                        f"unexpected {sorted(unexpected)[:5]}"
                    )
            self.write_lm_folder(lm, work)
        return out_dir

    def write_lm_folder(self, lm, work: Path) -> None:
        """The LM, codec/, tokenizer and dstune_tts.json: a folder synthesize and the model's own recipe load."""
        with quiet_hf_libraries():
            lm.save_pretrained(work, safe_serialization=True)
            save_codec(self.codec, self.codec_kind, self.codec_folder, work / CODEC)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(work)
        (work / TTS_LAYOUT_FILE).write_text(json.dumps(self.layout, indent=2) + "\n")
        write_voices(self.voices, work)

    def save_lora_weights(self, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
        """A LoRA export (model.train: lora): the base LM (reloaded from its folder: the trained module may be
        partitioned) with the adapters, written twice: `adapter/` as peft writes it (adapter_config.json naming the
        base folder + adapter_model.safetensors; PeftModel.from_pretrained(base, folder/'adapter') loads it), and the
        merged LM (merge_and_unload) as a full folder, so synthesize and the model's own inference code need nothing
        new."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        folder = Path(folder)
        fields = {
            k: v for k, v in adapter_metadata.items() if k in LoraConfig.__dataclass_fields__ and k != "peft_type"
        }
        with quiet_hf_libraries():
            base = AutoModelForCausalLM.from_pretrained(self.folder, torch_dtype=torch.float32)
            peft_lm = get_peft_model(base, LoraConfig(**{**fields, "init_lora_weights": False}))
            result = set_peft_model_state_dict(peft_lm, {f"base_model.model.{k}": v for k, v in lora_layers.items()})
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"LoRA weights do not fit the LM: unexpected {sorted(result.unexpected_keys)[:5]}")
            peft_lm.peft_config["default"].base_model_name_or_path = str(self.folder)
            peft_lm.save_pretrained(folder / ADAPTER_FOLDER, safe_serialization=True)
            merged = peft_lm.merge_and_unload()
        self.write_lm_folder(merged, folder)


# ---------------------------------------------------------------------------------------- the token layout


def load_folder_codec(model: TtsLmModelSpec, folder: Path, codec_folder: Optional[Path], dtype: torch.dtype):
    """(the codec, its folder): model.codec_pretrained, else the model folder's codec/."""
    source = codec_folder if codec_folder is not None else folder / CODEC
    if not source.is_dir():
        raise FamilyError(
            f"no codec: {source} does not exist. Set model.codec_pretrained to a {model.codec} folder "
            f"({CODEC_CLASSES[model.codec]}) or put one in {folder / CODEC}."
        )
    return load_codec(model.codec, source, dtype), source


def codec_problems(layout: dict, facts: dict) -> list[str]:
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


def layout_for(model: TtsLmModelSpec, folder: Path, codec, tokenizer) -> dict:
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
            text_vocab_size(folder),
            wanted,
            facts["codebook_size"],
            model.codec,
            facts["sampling_rate"],
            facts["sampling_rate"] / facts["samples_per_frame"],
        )
    problems = codec_problems(layout, facts) + layout_problems(layout)
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


def text_vocab_size(folder: Path) -> int:
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


def add_text_tokens(model: TtsLmModelSpec, folder: Path, tokenizer, lm, layout: dict) -> dict:
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


def json_reader(folder: Path) -> Callable[[str], Optional[dict]]:
    def read(name: str) -> Optional[dict]:
        path = folder / name
        return json.loads(path.read_text()) if path.is_file() else None

    return read


def audio_tokens(layout: dict, codes: torch.Tensor) -> torch.Tensor:
    """(positions, frames) codes -> flat frame-major audio token ids."""
    offsets = layout["audio_offset"] + layout["codebook_size"] * torch.arange(codes.shape[0]).unsqueeze(1)
    return (codes + offsets).t().reshape(-1)


# ------------------------------------------------------------------------------------------------- sampling


def allowed_mask(layout: dict, position: int, vocab: int) -> torch.Tensor:
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
        logits[~allowed_mask(layout, position, logits.numel())] = float("-inf")
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


def text_ids(tokenizer, text: str) -> list[int]:
    """A text's ids: its tokenizer's, or its UTF-8 bytes for a model without one."""
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return list(tokenizer(text).input_ids)


def layout_wave(codec, kind: str, frame_order: list, codes: torch.Tensor) -> np.ndarray:
    """The float32 waveform of (positions, frames) codes (none for no frames)."""
    if not codes.shape[1]:
        return np.zeros(0, np.float32)
    return decode_codes(codec, kind, codes, frame_order)
