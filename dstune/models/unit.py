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

from dstune.spec.model_sections import DEFAULT_LORA_TARGET_MODULES

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
    builtins: tuple[str, ...] = ()  # its tiny built-in models (BuiltinModel)
    presets: tuple[ModelPreset, ...] = ()


def load(where: str) -> Any:
    """The value a unit names as "module:ATTRIBUTE" (importing that module on first use)."""
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


def lora(rank: int = 32, targets=DEFAULT_LORA_TARGET_MODULES) -> dict[str, Any]:
    return {"model.train": "lora", "model.lora": {"rank": rank, "alpha": rank, "target_modules": list(targets)},
            "train.optimizer.lr": 1.0e-4}


def image(resolution: int, guidance: float, steps: int, **values) -> dict[str, Any]:
    return {"data.path": "/data/my-images", "data.resolution": resolution, "sample.prompts": IMAGE_PROMPTS,
            "sample.guidance": guidance, "sample.steps": steps, **values}


def video(resolution: int, frames: int, fps: int, guidance: float, **values) -> dict[str, Any]:
    return {"data.path": "/data/my-videos", "data.resolution": resolution,
            "data.video.frames": frames, "data.video.fps": fps, "model.sample_frames": frames,
            "model.gradient_checkpointing": True, "sample.prompts": VIDEO_PROMPTS, "sample.guidance": guidance,
            "sample.steps": 40, **values}


def speech(**values) -> dict[str, Any]:
    return {"data.path": "/data/LJSpeech-1.1", "data.format": "ljspeech", "train.micro_batch_size": 4,
            "train.optimizer.lr": 2.0e-4, "sample.prompts": SPEECH_PROMPTS, **values}
