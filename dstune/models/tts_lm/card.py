"""The codec-token TTS language models' card (torch-free, `model.family tts_lm`): a transformers causal LM over text
tokens then audio-codec tokens (dstune's own layout, Orpheus's over SNAC). What validate and the memory plan know of
it: parameters, the codec, one clip's tokens and activations, the codec-token cache, and the token layout of a local
folder checked offline (dstune.models.tts_lm.token_layouts)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Optional

from dstune.card import LM_LORA_TARGET_MODULES, ModelCard, ModelPreset, lora, speech
from dstune.families.denoiser_facts import lora_settings
from dstune.memory.activations import (
    ModelShape,
    codec_frame_rate,
    figure,
    in_plan_units,
    lm_sample_bytes,
    measured_sample_bytes,
    tts_tokens,
)
from dstune.memory.counts import SizesUnknown, config_folder, count_component, count_small_tensors, read_config
from dstune.memory.plan import ModelCounts
from dstune.models.tts_lm.spec import TTS_LAYOUT_FILE, TtsLmModelSpec
from dstune.families.speakers import Voices, one_voice
from dstune.models.tts_lm import token_layouts
from dstune.models.tts_lm.token_layouts import describe, layout_problems, orpheus_layout, spec_layout_name

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds
CODEC = TtsLmModelSpec.COMPANION_FOLDERS["codec_pretrained"]  # the codec's subfolder (model.codec_pretrained unset)


def codec_reference(spec, folder) -> Optional[str]:
    if spec.model.codec_pretrained:
        return spec.model.codec_pretrained
    return str(folder / CODEC) if (folder / CODEC / "config.json").exists() else None


def activations(config: dict, tokens: float, precision: str) -> tuple[int, int]:
    """A Llama-class LM (Llama 3.2, Orpheus): the measured constants at its width, MLP width, vocabulary (the
    logits and their fp32 copies for the loss) and layers; another architecture: the generic formula."""
    if config.get("model_type") != "llama":
        return lm_sample_bytes(config, tokens)
    shape = ModelShape(
        config["hidden_size"],
        {"layers": config["num_hidden_layers"]},
        ffn=config["intermediate_size"],
        vocab=config["vocab_size"],
    )
    return in_plan_units(measured_sample_bytes("llama", shape, tokens, 0, precision), precision)


def added_rows(config: dict, added_tokens) -> int:
    """The parameters model.added_tokens adds: a row of the embeddings per token, and of the LM head where it is not
    tied to them (trained with the rest: a full fine-tune)."""
    rows = len(added_tokens or ())
    text = config.get("text_config") or config
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return rows * int(text.get("hidden_size", 0)) * (1 if tied else 2)


@dataclass(frozen=True, kw_only=True)
class TtsLmCard(ModelCard):
    def text_tokenizer_kind(self, folder) -> str:
        """The folder's tokenizer where it has one (what start-up loads), else UTF-8 bytes (ids 0..255)."""
        return "files" if (Path(folder) / "tokenizer_config.json").is_file() else "utf8"

    def added_tokens_hint(self) -> str:
        return (
            "or add the missing characters (or words) to the tokenizer with model.added_tokens: new embedding rows, "
            "trained with the rest in a full fine-tune (the plan counts them; not with train: lora)"
        )

    def count(self, spec, num_samples: int, clips=()) -> ModelCounts:
        folder, origin = config_folder(spec.model.pretrained)
        targets, rank = lora_settings(spec)  # train: lora puts adapters on the LM's attention (q/k/v/o_proj)
        params, largest, lora_params = count_component(str(folder / "config.json"), targets, rank)
        default_lora = count_component(str(folder / "config.json"), LM_LORA_TARGET_MODULES, 16)[2]
        config = read_config(folder / "config.json")
        added = added_rows(config, spec.model.added_tokens)  # model.added_tokens: new embedding (and head) rows
        params += added
        companions, frame_rate, codebooks = {}, 75.0, spec.model.num_codebooks or 8
        layout = read_config(folder / TTS_LAYOUT_FILE) if (folder / TTS_LAYOUT_FILE).exists() else {}
        if layout.get("frame_rate"):  # a described layout (token_layouts) states its codec's frames and codes
            frame_rate = float(layout["frame_rate"])
            codebooks = spec.model.num_codebooks or layout.get("num_codebooks", 8)
        codec_ref = codec_reference(spec, folder)
        if codec_ref:
            codec_folder, _ = config_folder(codec_ref)
            try:
                companions["codec"] = count_component(str(codec_folder / "config.json"))[0]
            except SizesUnknown:  # SNAC's config names no class to build on meta; it is small (~20 M) and frozen
                pass
            codec_config = read_config(codec_folder / "config.json")
            frame_rate = codec_frame_rate(codec_config)
            if not spec.model.num_codebooks:
                saved = folder / TTS_LAYOUT_FILE
                codebooks = (
                    read_config(saved).get("num_codebooks", 8)
                    if saved.exists()
                    else codec_config.get("num_quantizers", 8)
                )
        seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
        tokens = tts_tokens(seconds, frame_rate, codebooks)
        full, checkpointed = activations(config, tokens, spec.train.precision)
        with figure("transients"):  # the backward's: the fp32 logits gradient over the vocabulary
            transient = activations(config, tokens, spec.train.precision)
        transients = transient[1] if spec.model.gradient_checkpointing else transient[0]
        cached = ("codec",) if spec.data.cache.codec_tokens and "codec" in companions else ()
        # int32 codes; an upper bound (every clip at the longest length)
        cache_bytes = int(4 * frame_rate * codebooks * seconds * num_samples) if spec.data.cache.codec_tokens else 0
        return ModelCounts(
            "lm",
            params,
            lora_params or params,
            largest,
            companions,
            cached,
            int(full),
            int(checkpointed),
            default_lora,
            cache_bytes,
            origin,
            small_tensors=count_small_tensors(str(folder / "config.json"), targets, rank),
            transient_sample_bytes=int(transients * (2 if spec.train.precision == "fp32" else 1)),  # units -> bytes
        )

    def voices(self, model_spec, names) -> Voices:
        """A layout that names the voice (Orpheus: "ann: Hello.") takes every speaker by its name; another has one
        voice."""
        layout = spec_layout_name(model_spec)
        prompts = token_layouts.SPEAKER_PROMPTS  # (read through the module: the layouts' table, not a card constant)
        if layout in prompts:
            how = prompts[layout].format(speaker="NAME", text="text")
            return Voices(
                self.name,
                f"the {layout!r} layout names the voice: each clip's prompt is {how!r} (a text that starts with "
                "its speaker's name keeps it)",
                {name: name for name in names},
            )
        fix = (
            "Train one speaker's clips per run (a .list or metadata.jsonl per speaker), or use a model whose layout "
            f"names the voice ({', '.join(f'model.token_layout: {n}' for n in prompts)}, prompts like "
            '"ann: Hello."). '
        )
        return one_voice(self.name, names, f"the {layout!r} token layout has no place for a speaker", fix)

    def spec_issues(self, spec) -> list[tuple[str, str]]:
        """The token layout of a local model folder (its dstune_tts.json, else model.token_layout's preset) against
        the folder's config.json vocabulary, offline: ids in range, codec frames vs sample rate, the template."""
        model = spec.model
        if model.pretrained.startswith("builtin:"):
            return []
        folder = os.path.expanduser(model.pretrained)
        layout_path, config_path = os.path.join(folder, TTS_LAYOUT_FILE), os.path.join(folder, "config.json")
        try:
            if os.path.isfile(layout_path):
                with open(layout_path) as handle:
                    layout = describe(json.load(handle))
            elif model.token_layout == "orpheus":
                layout = orpheus_layout()
            else:
                return []  # dstune's layout is made from the LM and codec when training starts
            vocab_size = None
            if os.path.isfile(config_path):
                with open(config_path) as handle:
                    vocab_size = int(json.load(handle)["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            return [("model.pretrained", f"{layout_path}: not a readable token layout ({err})")]
        problems = layout_problems(layout, vocab_size if os.path.isfile(layout_path) else None)
        if os.path.isfile(layout_path) and model.token_layout not in (None, layout["name"]):
            problems.append(f"it holds the {layout['name']!r} layout, not model.token_layout {model.token_layout!r}")
        if not problems:
            return []
        return [
            (
                "model.token_layout" if model.token_layout else "model.pretrained",
                f"the token layout of {folder} does not hold: {'; '.join(problems)}. Fix {TTS_LAYOUT_FILE} or start "
                "from the model it was written for.",
            )
        ]


TTS_LM_CARD = TtsLmCard(
    key="tts_lm",
    name="Codec-token TTS LMs",
    family="tts_lm",
    text_tokenizer="files",  # its folder's tokenizer; without one, UTF-8 bytes (text_tokenizer_kind)
    unit="tts_lm",
    model_class="dstune.models.tts_lm.model:TtsLm",
    docs="docs/tts.md",
    names=r"orpheus\w*",
    summary="Codec-token TTS language models (a transformers causal LM, Llama/Qwen-class, over text then "
    "EnCodec / DAC / Mimi / SNAC tokens; Orpheus's layout)",
    folder_classes={"*ForCausalLM": None},  # its samples take no guidance
    activation_cases="dstune.models.tts_lm.builtin:ACTIVATION_CASES",
    builtins={
        "tiny-tts-lm": "dstune.models.tts_lm.builtin:TINY_TTS_LM",
        "tiny-orpheus": "dstune.models.tts_lm.builtin_orpheus:TINY_ORPHEUS",
    },
    presets=(
        ModelPreset(
            "llama-tts",
            "Llama-3.2-1B learning speech as EnCodec 24 kHz tokens (4 codebooks)",
            "tts_lm",
            "meta-llama/Llama-3.2-1B",
            "tiny-tts-lm",
            speech(
                **{
                    "model.codec": "encodec",
                    "model.codec_pretrained": "facebook/encodec_24khz",
                    "model.num_codebooks": 4,
                    "model.gradient_checkpointing": True,
                    "data.cache.codec_tokens": True,
                    # micro 2 x accumulation 2 (the global batch of micro 4): the step's logits gradient fits 40 GB
                    "train.micro_batch_size": 2,
                    "train.gradient_accumulation_steps": 2,
                }
            ),
            gpu_memory="40GB",
        ),
        ModelPreset(
            "orpheus",
            "Orpheus 3B TTS (Llama with SNAC 24 kHz tokens), LoRA on its attention",
            "tts_lm",
            "canopylabs/orpheus-3b-0.1-ft",
            "tiny-orpheus",
            speech(
                **lora(16, LM_LORA_TARGET_MODULES),
                **{
                    "model.codec": "snac",
                    "model.token_layout": "orpheus",
                    "model.codec_pretrained": "hubertsiuzdak/snac_24khz",
                    "model.gradient_checkpointing": True,  # 214 GB of activations per GPU without, at 10 s clips
                    # micro 2 x accumulation 2 (the global batch of micro 4): the step's logits gradient fits 80 GB
                    "train.micro_batch_size": 2,
                    "train.gradient_accumulation_steps": 2,
                },
            ),
        ),
    ),
)
