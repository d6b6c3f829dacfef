"""What one model unit declares (`ModelUnit`), and the `dstune init --model` presets it brings (`ModelPreset`).

A unit is a folder `dstune/models/<name>/`: its torch-free facts, its torch side (a family of its own, or recipes on
a shared core: dstune.families.flow for images, dstune.families.video for video), its tiny built-in models, its
presets, and the names of its docs page. The unit says where each part is as "module:ATTRIBUTE" text, loaded on
first use, so that reading the registry imports neither torch nor any unit's torch side. Torch-free.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


# LoRA's usual targets in diffusers UNets and transformers: the attention projections (diffusers' LoRA examples),
DEFAULT_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
LM_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")  # and in a Llama-class causal LM
IMAGE_PROMPTS = ["a photo of a dog on the beach", "an oil painting of a lighthouse at dusk"]
VIDEO_PROMPTS = ["a red fox running through fresh snow"]
SPEECH_PROMPTS = ["Printing, in the only sense with which we are at present concerned.", "The quick brown fox."]


@dataclass(frozen=True)
class ModelPreset:
    name: str  # the `--model` value
    title: str  # what the model is, for the spec's first line and the README
    family: str  # model.family
    pretrained: str  # the published checkpoint (a Hugging Face hub id, downloaded beforehand)
    builtin: str  # the built-in tiny model with the same layout (`builtin:` + this)
    values: dict[str, Any] = field(default_factory=dict)  # dotted spec key -> value, over the shared defaults


@dataclass(frozen=True)
class ModelUnit:
    """One model or model group (see the module docstring). Every "module:ATTRIBUTE" names a value in the unit."""

    name: str  # its folder under dstune/models/
    title: str  # what it trains, for the docs' model lists
    docs: str  # its docs page, relative to the repository
    # a regular expression of the model's names (matched case-insensitively as whole words): the names that may
    # appear in no dstune module outside this unit and the registry (tests/unit/test_model_units.py)
    names: str
    families: dict[str, str] = field(default_factory=dict)  # model.family -> module of the Family it owns
    facts: tuple[str, ...] = ()  # ModelFacts of the families it owns
    recipes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # shared core family -> its recipes on it
    flow_models: tuple[str, ...] = ()  # its rows of the flow core's torch-free table ({transformer class: FlowModel})
    video_facts: tuple[str, ...] = ()  # its VideoFacts for the video core's torch-free facts
    spec_sections: tuple[str, ...] = ()  # the `model` sections of the families it owns (spec.py, torch-free)
    # On a shared core: what the core's spec section says of it (one line of `model.family`'s description), the
    # pipeline classes it trains with their own sampling guidance defaults (model_index.json's _class_name ->
    # the pipeline's __call__ default), the guidance of a distilled (is_distilled) folder of a pipeline, and the
    # frame size a pipeline fixes in its code when the folder's configs do not say it ({class: (side, why)}).
    summary: str = ""
    pipelines: dict[str, float] = field(default_factory=dict)
    distilled_guidance: dict[str, float] = field(default_factory=dict)
    native_sizes: dict[str, tuple[int, str]] = field(default_factory=dict)
    # What the core's spec reference says of this model's own defaults, per spec key (e.g. {"model.max_sequence_length":
    # "77 (SD3-class)"}); tests check them against the recipes
    spec_notes: dict[str, str] = field(default_factory=dict)
    # its measured models (dstune.memory.activation_cases.Case tuples, beside its built-ins): bench/activation_table.py
    # counts what their classes save for backward, and the memory plan uses the constants fitted to that
    activation_cases: tuple[str, ...] = ()
    builtins: dict[str, str] = field(default_factory=dict)  # its tiny built-in models: name -> its BuiltinModel
    presets: tuple[ModelPreset, ...] = ()
    # key prefixes of its original single-file checkpoints -> (the family that reads them, what such a file is), so
    # that a file given to another family is named (dstune.pretrained)
    checkpoint_layouts: dict[str, tuple[str, str]] = field(default_factory=dict)


# The spec's `model.family` of the video core (dstune.families.video): named after the first video model it trained,
# and kept so that every spec that says it keeps working. Other modules say VIDEO_FAMILY.
VIDEO_FAMILY = "wan"


def load(where: str) -> Any:
    """The value a unit names as "module:ATTRIBUTE" (importing that module on first use)."""
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


def lora(rank: int = 32, targets=DEFAULT_LORA_TARGET_MODULES) -> dict[str, Any]:
    return {
        "model.train": "lora",
        "model.lora": {"rank": rank, "alpha": rank, "target_modules": list(targets)},
        "train.optimizer.lr": 1.0e-4,
    }


def image(resolution: int, guidance: float, steps: int, **values) -> dict[str, Any]:
    return {
        "data.path": "/data/my-images",
        "data.resolution": resolution,
        "sample.prompts": IMAGE_PROMPTS,
        "sample.guidance": guidance,
        "sample.steps": steps,
        **values,
    }


def video(resolution: int, frames: int, fps: int, guidance: float, **values) -> dict[str, Any]:
    return {
        "data.path": "/data/my-videos",
        "data.resolution": resolution,
        "data.video.frames": frames,
        "data.video.fps": fps,
        "model.sample_frames": frames,
        "model.gradient_checkpointing": True,
        "sample.prompts": VIDEO_PROMPTS,
        "sample.guidance": guidance,
        "sample.steps": 40,
        **values,
    }


def speech(**values) -> dict[str, Any]:
    return {
        "data.path": "/data/LJSpeech-1.1",
        "data.format": "ljspeech",
        "train.micro_batch_size": 4,
        "train.optimizer.lr": 2.0e-4,
        "sample.prompts": SPEECH_PROMPTS,
        **values,
    }
