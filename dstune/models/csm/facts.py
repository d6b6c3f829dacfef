"""The torch-free facts of the tts_codebooks family (multi-codebook TTS models trained through their transformers
class; dstune.families.facts describes the contract): which class a folder holds, the parameters DeepSpeed trains
(the class without its codec), the frozen codec, one clip's activations and the codec-token cache.

CSM: the backbone sees one position per audio frame (plus the text), the depth decoder Q positions per frame, each
started from the backbone's hidden state. Their activations are the constants measured on CsmForConditionalGeneration
itself (the "csm" activation case in its builtin module, at CSM-1B's 32 codebooks and its depth decoder half the backbone's
width), evaluated at the folder's backbone width, layer counts and codebook vocabulary; they include the copy of the
depth decoder's per-codebook heads that each forward gathers and keeps for backward.
The family's other classes (dstune.families.codebook_models: declared by their units) count their own codec and
activations; the class itself is counted here, on the meta device, for all of them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from functools import lru_cache

from dstune.families.denoiser_facts import lora_settings
from dstune.families.facts import ModelFacts, SpecIssues
from dstune.hf import quiet_hf_libraries
from dstune.memory.activations import (
    TEXT_TOKENS_PER_SECOND,
    ModelShape,
    codec_frame_rate,
    in_plan_units,
    measured_sample_bytes,
)
from dstune.families.codebook_models import codebooks_models
from dstune.memory.counts import SizesUnknown, config_folder, module_small_tensors, read_config
from dstune.memory.plan import ModelCounts
from dstune.spec.model_sections import LM_LORA_TARGET_MODULES

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds
CODEC_CONFIG = {"CsmForConditionalGeneration": ("codec_config", "codec_model")}  # where a class keeps its codec
ARCHITECTURES = (*CODEC_CONFIG, *codebooks_models())  # CSM's own, then the units' (their codecs outside the class)


def architecture(config: dict) -> str:
    """The class of a tts_codebooks folder's config.json; SizesUnknown when the family does not train it."""
    names = [name for name in config.get("architectures") or [] if name in ARCHITECTURES]
    if not names:
        raise SizesUnknown(
            f"its config.json names {config.get('architectures')}, not one of {', '.join(ARCHITECTURES)}"
        )
    return names[0]


@lru_cache(maxsize=16)
def _meta_counts(config_text: str, targets: tuple, rank: int) -> tuple[int, int, int, int, tuple]:
    """(trained parameters, largest trained layer, LoRA parameters, codec parameters, small tensors) of the class on
    the meta device; the codec is not trained and gets no adapters. The small tensors (with the adapters') are what
    ZeRO-3 keeps whole on every rank (dstune.memory.counts.count_small_tensors)."""
    import torch
    import transformers

    config = json.loads(config_text)
    cls = architecture(config)
    with quiet_hf_libraries(), torch.device("meta"):
        model = getattr(transformers, cls)(transformers.AutoConfig.for_model(**config))
    codec_params = 0
    if cls in CODEC_CONFIG:
        codec_params = sum(p.numel() for p in getattr(model, CODEC_CONFIG[cls][1]).parameters())
        setattr(model, CODEC_CONFIG[cls][1], None)
    params = sum(dict((id(p), p.numel()) for p in model.parameters()).values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    lora = sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    )
    return params, largest, lora, codec_params, module_small_tensors(model, targets, rank)


def _count(spec, num_samples: int, clips=()) -> ModelCounts:
    folder, origin = config_folder(spec.model.pretrained)
    config = read_config(folder / "config.json")
    targets, rank = lora_settings(spec)
    params, largest, lora, codec_params, small = _meta_counts(_config_text(config), targets, rank)
    default_lora = _meta_counts(_config_text(config), LM_LORA_TARGET_MODULES, 16)[2]
    if architecture(config) not in CODEC_CONFIG:
        counts = codebooks_models()[architecture(config)].count(
            spec, num_samples, folder, origin, config, (params, largest, lora, default_lora)
        )
        return counts if counts.small_tensors else replace(counts, small_tensors=small)
    codec_config = config.get(CODEC_CONFIG[architecture(config)][0]) or {}
    frame_rate, codebooks = _frame_rate(codec_config), int(config.get("num_codebooks", 32))
    seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
    frames = seconds * frame_rate + 1  # the EOS frame
    full, checkpointed = _activations(config, frames, seconds * TEXT_TOKENS_PER_SECOND, spec.train.precision)
    cached = ("codec",) if spec.data.cache.codec_tokens else ()
    cache_bytes = int(4 * frame_rate * codebooks * seconds * num_samples) if spec.data.cache.codec_tokens else 0
    return ModelCounts(
        "model",
        params,
        lora or params,
        largest,
        {"codec": codec_params},
        cached,
        int(full),
        int(checkpointed),
        default_lora,
        cache_bytes,
        origin,
        small_tensors=small,
    )


def _activations(config: dict, frames: float, text_tokens: float, precision: str) -> tuple[int, int]:
    depth = config.get("depth_decoder_config") or {}
    layers = {"backbone": config["num_hidden_layers"], "depth": depth.get("num_hidden_layers", 4)}
    shape = ModelShape(config["hidden_size"], layers, vocab=config["vocab_size"])
    return in_plan_units(measured_sample_bytes("csm", shape, frames, text_tokens, precision), precision)


def _frame_rate(codec_config: dict) -> float:
    """Frames per second of the codec; Mimi halves its convolutions' rate with a last stride-2 downsampling
    (24 kHz / (8 * 6 * 5 * 4 * 2) = 12.5 Hz), which its config does not store."""
    if codec_config.get("model_type") == "mimi" and not codec_config.get("frame_rate"):
        hop = 2
        for ratio in codec_config.get("upsampling_ratios", [8, 6, 5, 4]):
            hop *= ratio
        return codec_config.get("sampling_rate", 24000) / hop
    return codec_frame_rate(codec_config)


def _config_text(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def _spec_issues(spec) -> SpecIssues:
    """The folder's class, offline: a folder this family cannot train is named before any download or launch; and
    sample.voice_prompts only for a class that continues a voice, each clip readable with its transcript beside."""
    try:
        folder, _ = config_folder(spec.model.pretrained)
        config = read_config(folder / "config.json")
        cls = architecture(config)
    except SizesUnknown as err:
        return [
            (
                "model.pretrained",
                f"{spec.model.pretrained}: {err}. model.family tts_codebooks trains "
                f"{', '.join(ARCHITECTURES)} folders.",
            )
        ]
    declared = codebooks_models().get(cls)
    problem = declared.config_problem(config) if declared is not None and declared.config_problem else None
    if problem:
        return [("model.pretrained", f"{spec.model.pretrained}: {problem}")]
    return _voice_prompt_issues(spec.sample.voice_prompts, cls)


def _voice_prompt_issues(paths: list[str], cls: str) -> SpecIssues:
    if not paths:
        return []
    takers = [name for name, model in codebooks_models().items() if model.takes_voice_prompts]
    if cls not in takers:
        return [
            (
                "sample.voice_prompts",
                f"{cls} is not given a reference voice here (classes that take one: "
                f"{', '.join(takers) or 'none'}); remove sample.voice_prompts",
            )
        ]
    issues = []
    for number, path in enumerate(paths):
        clip = Path(path).expanduser()
        if not clip.is_file():
            issues.append((f"sample.voice_prompts.{number}", f"{path}: no such file"))
        elif not clip.with_suffix(".txt").is_file():
            issues.append(
                (
                    f"sample.voice_prompts.{number}",
                    f"{path}: its transcript {clip.with_suffix('.txt')} "
                    "is missing (the text the clip says, with its speaker tags)",
                )
            )
    return issues


FACTS = ModelFacts(family="tts_codebooks", modality="audio", count=_count, spec_issues=_spec_issues)
