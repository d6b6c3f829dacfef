"""The torch-free facts of the tts_lm family (a causal LM over audio-codec tokens: dstune's own layout, Orpheus over
SNAC): parameters, one clip's tokens and activations, the codec-token cache, and the token layout of a local folder
checked offline (dstune.models.tts_lm.token_layouts); dstune.families.facts describes the contract."""

from __future__ import annotations

import json
import os
from typing import Optional

from dstune.memory.activations import (
    ModelShape,
    codec_frame_rate,
    in_plan_units,
    lm_sample_bytes,
    measured_sample_bytes,
    tts_tokens,
)
from dstune.families.denoiser_facts import lora_settings
from dstune.families.facts import ModelFacts, SpecIssues
from dstune.memory.plan import ModelCounts
from dstune.memory.counts import SizesUnknown, config_folder, count_component, count_small_tensors, read_config
from dstune.spec.model_sections import LM_LORA_TARGET_MODULES
from dstune.models.tts_lm.token_layouts import TTS_LAYOUT_FILE, describe, layout_problems, orpheus_layout

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds


def _codec_reference(spec, folder) -> Optional[str]:
    if spec.model.codec_pretrained:
        return spec.model.codec_pretrained
    return str(folder / "codec") if (folder / "codec" / "config.json").exists() else None


def _count(spec, num_samples: int, clips=()) -> ModelCounts:
    folder, origin = config_folder(spec.model.pretrained)
    targets, rank = lora_settings(spec)  # train: lora puts adapters on the Llama's attention (q/k/v/o_proj by default)
    params, largest, lora = count_component(str(folder / "config.json"), targets, rank)
    default_lora = count_component(str(folder / "config.json"), LM_LORA_TARGET_MODULES, 16)[2]
    config = read_config(folder / "config.json")
    companions, frame_rate, codebooks = {}, 75.0, spec.model.num_codebooks or 8
    layout = read_config(folder / TTS_LAYOUT_FILE) if (folder / TTS_LAYOUT_FILE).exists() else {}
    if layout.get(
        "frame_rate"
    ):  # a described layout (dstune.models.tts_lm.token_layouts) states its codec's frames and codes
        frame_rate, codebooks = float(layout["frame_rate"]), spec.model.num_codebooks or layout.get("num_codebooks", 8)
    codec_ref = _codec_reference(spec, folder)
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
                read_config(saved).get("num_codebooks", 8) if saved.exists() else codec_config.get("num_quantizers", 8)
            )
    seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
    full, checkpointed = _activations(config, tts_tokens(seconds, frame_rate, codebooks), spec.train.precision)
    cached = ("codec",) if spec.data.cache.codec_tokens and "codec" in companions else ()
    cache_bytes = (
        int(4 * frame_rate * codebooks * seconds * num_samples) if spec.data.cache.codec_tokens else 0
    )  # int32 codes; an upper bound (every clip at the longest length)
    return ModelCounts(
        "lm",
        params,
        lora or params,
        largest,
        companions,
        cached,
        int(full),
        int(checkpointed),
        default_lora,
        cache_bytes,
        origin,
        small_tensors=count_small_tensors(str(folder / "config.json"), targets, rank),
    )


def _activations(config: dict, tokens: float, precision: str) -> tuple[int, int]:
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


def _spec_issues(spec) -> SpecIssues:
    """The token layout of a local model folder (its dstune_tts.json, else model.token_layout's preset) against the
    folder's config.json vocabulary, offline: ids in range, codec frames vs sample rate, the template."""
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


FACTS = ModelFacts(family="tts_lm", modality="audio", count=_count, spec_issues=_spec_issues)
