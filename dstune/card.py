"""A model's card: everything dstune knows of one model without torch, in one frozen dataclass.

    card = families.card_of(spec.model.family, folder)     # the card of the model a pipeline folder holds
    model = load(card.model_class).load(spec.model, folders, device, frozen_dtype)   # its torch side

Each model dstune trains is a card and a class. The card (`models/<unit>/card.py`) holds the model's constants
(its folder's classes, text length, guidance, the names it goes by), its offline checks (what validate says of a spec
and what start-up refuses, written once as methods of the card's type, dstune.families.flow_card and the others)
and its memory facts; the class (`models/<unit>/model.py`, named by `model_class`) is its training step, one level
below its core's base class, reading every constant from the card. `ModelCard` is what every card has: its names,
docs, built-in tiny models, `dstune init` presets and measured activation cases. Torch-free: `dstune validate`
reads cards only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Optional, Protocol

from dstune.spec.section import DEFAULT_LORA_TARGET_MODULES, LM_LORA_TARGET_MODULES  # noqa: F401 - units take them from here

IMAGE_PROMPTS = ["a photo of a dog on the beach", "an oil painting of a lighthouse at dusk"]
VIDEO_PROMPTS = ["a red fox running through fresh snow"]
SPEECH_PROMPTS = ["Printing, in the only sense with which we are at present concerned.", "The quick brown fox."]


@dataclass(frozen=True)
class ClipRule:
    """A video VAE's clip length rule, a fact of the model: it encodes `first + step * k` frames to
    `first_latents + latents * k` latent frames. A causal VAE 4x in time keeps the first frame (4k+1 -> k+1;
    8x: 8k+1 -> k+1); one that encodes chunks of 17 frames to 5 latent frames, 2 of them for the first 5 frames,
    takes 17k+5 -> 5k+2. Validate names the counts a model takes; the token counts of the plan follow it."""

    step: int
    first: int = 1
    latents: int = 1
    first_latents: int = 1

    def takes(self, frames: int) -> bool:
        return frames >= self.first and (frames - self.first) % self.step == 0

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of `frames` (the whole chunks' of a count the VAE does not take)."""
        return self.first_latents + max(0, frames - self.first) // self.step * self.latents

    @property
    def text(self) -> str:
        return f"{self.step}k+{self.first}"

    def nearest(self, frames: int) -> tuple[int, ...]:
        """The counts the VAE takes next to `frames` (one when `frames` is below the first)."""
        below = self.first + max(0, frames - self.first) // self.step * self.step
        return (below,) if frames < self.first else (below, below + self.step)

    def examples(self, count: int = 3) -> str:
        return ", ".join(str(self.first + k * self.step) for k in range(count)) + ", ..."

    def problem(self, frames: int, whose: str) -> str:
        """Why a clip of `frames` is refused, naming the counts `whose` VAE takes (whose: the model's, in words)."""
        return (
            f"{frames} is not {self.text}: {whose} takes {self.text} frames ({self.examples()}, "
            f"{self.latent_frames(self.first + self.step)} latent frames for {self.first + self.step}); use "
            + " or ".join(map(str, self.nearest(frames)))
        )


CAUSAL_4X = ClipRule(4)  # the rule of the video VAEs 4x in time after the first frame


@dataclass(frozen=True)
class PixelRange:
    """The pixels a model's VAE encodes (and decodes to), a fact of the model. The data layer hands every model its
    pixels in [-1, 1] (dstune.data.images, dstune.data.video); a VAE that takes another range gets them mapped
    where they meet it (the training batch's encode and the latent cache's alike): first to [low, high], then
    normalised per RGB channel, `(p - mean) / std`. The default is the [-1, 1] most diffusers VAEs take, given as it
    is (no arithmetic, so no rounding); a VAE may instead take ImageNet-normalised pixels from [0, 1]."""

    low: float = -1.0
    high: float = 1.0
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)

    @property
    def is_data_range(self) -> bool:
        """Whether the VAE takes the data layer's [-1, 1] as they are."""
        return self == DATA_PIXELS

    @property
    def text(self) -> str:
        normalised = "" if self.mean == (0.0, 0.0, 0.0) and self.std == (1.0, 1.0, 1.0) else ", per-channel normalised"
        return f"[{self.low:g}, {self.high:g}]{normalised}"


DATA_PIXELS = PixelRange()  # the data layer's pixels, which most VAEs take as they are
IMAGENET_UNIT_PIXELS = PixelRange(0.0, 1.0, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # ImageNet-normalised [0, 1]


@dataclass(frozen=True)
class ModelPreset:
    """One `dstune init --model NAME` spec: the published checkpoint and its real defaults."""

    name: str  # the `--model` value
    title: str  # what the model is, for the spec's first line and the README
    family: str  # model.family
    pretrained: str  # the published checkpoint (a Hugging Face hub id, downloaded beforehand)
    builtin: str  # the built-in tiny model with the same layout (`builtin:` + this)
    values: dict[str, Any] = field(default_factory=dict)  # dotted spec key -> value, over the shared defaults
    # the GPUs the spec is sized for (its header names them; tests/unit/test_model_presets.py checks that
    # `dstune validate` says the spec fits them): memory per GPU as --gpu-memory reads it, and GPUs per node
    gpu_memory: str = "80GB"
    num_gpus: int = 8


# The memory of common training GPUs as their datasheets give it (GB = 10^9 bytes, as --gpu-memory reads it): the
# cards a preset names in its header, and the one-line verdict `dstune validate` prints without --gpu-memory.
COMMON_GPUS: tuple[tuple[str, str], ...] = (
    ("24GB", "RTX 4090, L4, A10"),
    ("40GB", "A100 40GB"),
    ("48GB", "L40S, RTX 6000 Ada"),
    ("80GB", "A100 80GB, H100"),
    ("141GB", "H200"),
    ("192GB", "B200, MI300X"),
)


def gpu_words(size: str) -> str:
    """'80GB' -> '80 GB (A100 80GB, H100)'."""
    cards = dict(COMMON_GPUS).get(size)
    number = size.removesuffix("GB")
    return f"{number} GB ({cards})" if cards else size


class SingleFileLayout(Protocol):
    """How a model's single checkpoint file (original, non-diffusers key layout) is laid out, for dstune.pretrained,
    which converts it with diffusers' `from_single_file` into a pipeline folder (a card that reads single files
    gives one: ModelCard.single_file_layout)."""

    denoiser: str  # the pipeline component the file must hold ("unet")
    denoiser_prefixes: tuple[str, ...]  # key prefixes of the denoiser in the original layout
    companions: dict  # component -> key prefixes that show the file holds it; a component it lacks comes from the base


@dataclass(frozen=True, kw_only=True)
class ModelCard:
    """What every card says of its model (see the module docstring); a core's card type adds its facts."""

    key: str  # short lower-case name, for messages, docs and test names
    name: str  # the model's name as people write it
    family: str  # the spec's model.family
    unit: str  # its folder under dstune/models/
    model_class: str  # "module:Class" of its torch side, loaded on first use (`load`)
    docs: str  # its docs page, relative to the repository
    # a regular expression of the model's names, matched case-insensitively as whole words: they may appear in no
    # dstune module outside its unit (tests/unit/test_model_units.py)
    names: str
    summary: str  # one line on what it is and how a folder is recognised, for the spec reference and docs
    # the classes of the folders it trains (a pipeline's model_index.json _class_name, or a transformers
    # architecture) -> the default sampling guidance of that pipeline or class (None: it samples without guidance)
    folder_classes: dict[str, Optional[float]]
    # what the spec reference says of this model's own default for a spec key ({"model.max_sequence_length": ...})
    spec_notes: dict[str, str] = field(default_factory=dict)
    builtins: dict[str, str] = field(default_factory=dict)  # its tiny built-in models: name -> "module:BuiltinModel"
    # "module:ATTRIBUTE" of its activation measurement cases (dstune.memory.activation_cases.Case tuples)
    activation_cases: str = ""
    presets: tuple[ModelPreset, ...] = ()
    # key prefixes of its original single-file checkpoints -> what such a file is, so that a file given to
    # another family is named (dstune.pretrained)
    checkpoint_layouts: dict[str, str] = field(default_factory=dict)
    # how a speech model's transcripts become tokens, for validate's unknown-token check (a dataset in a language
    # its tokenizer does not cover: dstune.families.text_coverage): "files" (its folder's tokenizer files), "utf8"
    # (one token per UTF-8 byte), "" (not checked)
    text_tokenizer: str = ""
    # its load builds the trainable module partitioned under ZeRO-3 (deepspeed.zero.Init), all ranks together, so
    # that no rank holds a whole copy of it; else each rank loads it whole
    builds_partitioned: ClassVar[bool] = False
    # its start-up can load its text encoders on one rank per node, with the text cache (dstune.text_once)
    text_once: ClassVar[bool] = False
    # it trains a clip's sound track beside its frames (validate counts the clips with and without sound)
    trains_sound: ClassVar[bool] = False
    # diffusers' names of a transformer block's layers -> the names in the model's original checkpoints, which
    # ComfyUI's loader maps: the LoRA file of output.lora_format comfyui where that format is the original names
    # (the video models'); empty: the model has no such format (validate and start-up refuse it)
    original_lora_names: ClassVar[Mapping[str, str]] = MappingProxyType({})

    # ------------------------------------------------------------------ what validate and the memory plan ask

    def count(self, spec, num_samples: int, clips=()):
        """The run's ModelCounts (dstune.memory.plan): parameters, activations, cache bytes, from the configs of
        spec.model.pretrained; SizesUnknown (dstune.memory.counts) with the reason when they are not here."""
        raise NotImplementedError(f"{self.name}'s card counts nothing")

    def spec_issues(self, spec) -> list[tuple[str, str]]:
        """[(dotted key, message)]: what start-up would refuse of this spec on the folder, found offline (validate
        and start-up both ask it)."""
        return []

    def pairs(self, spec) -> Optional[str]:
        """The pipeline class when the model trains on (source, target) pairs (validate then checks the data gives
        them), else None."""
        return None

    def attention(self, spec):
        """The heads a sequence-parallel split divides (dstune.families.facts.Attention); None: its sequences are
        not split."""
        return None

    def voices(self, model_spec, names):
        """How a speech model hears a dataset's speakers: `names` are the data's speakers in their order (sorted, ""
        first for clips without one; at least one); a dstune.families.speakers.Voices (each name -> what the model
        is given), or SpeakersRefused with the reason where it cannot tell them apart."""
        raise NotImplementedError(f"{self.name} trains no speech")

    def text_tokenizer_kind(self, folder) -> str:
        """How this folder's transcripts become tokens (`text_tokenizer`'s words), for the unknown-token check."""
        return self.text_tokenizer

    def added_tokens_hint(self) -> str:
        """How a user extends this model's tokenizer for a new language, or why dstune cannot (the unknown-token
        check's last fix)."""
        return (
            f"dstune cannot add tokens to {self.name}'s tokenizer (new tokens need new embedding rows trained with "
            "them; model.added_tokens does this for model.family tts_lm only)"
        )

    def takes_speaker(self, text: str) -> bool:
        """Whether a clip of this transcript is given its speaker (False: the transcript names its own turns, a
        dialogue's, and its speaker column is not used)."""
        return True

    def original_transformer_names(self, shapes: dict, config: dict):
        """For model.transformer_file: diffusers' parameter name -> (the file's name, its rows), a
        dstune.families.quantized_file.OriginalNames, where the file (`shapes`: its parameter names and shapes) is
        in this model's original checkpoint naming; None where it is not, or the model has no such map."""
        return None

    def single_file_layout(self) -> Optional[SingleFileLayout]:
        """How its single checkpoint files are laid out; None: model.pretrained must be a folder (or a hub id, a
        built-in)."""
        return None

    def sample_guidance(self, index: dict) -> tuple[float, str] | None:
        """(the guidance its pipeline samples with by default, why), for a folder whose model_index.json (or
        config.json) is `index`; None when the folder is none of this model's."""
        pipeline = index.get("_class_name", "")
        if self.folder_classes.get(pipeline) is not None:
            return self.folder_classes[pipeline], f"{pipeline}'s default"
        return None

    def reference_size(self, index: dict) -> str | None:
        """data.reference_size where the spec leaves it out, for a folder whose model_index.json is `index`: "own"
        (each reference keeps its aspect ratio and the target's area), "target" (resized and cropped with its
        target), or None when the folder is none of this model's."""
        return "target" if index.get("_class_name", "") in self.folder_classes else None

    def native_size(self, index: dict) -> tuple[int, str] | None:
        """(the frame side its pipeline fixes in its code whatever the folder's configs say, why); None: the
        folder's configs say it (the model section reads them: dstune.model_defaults)."""
        return None


def load(where: str) -> Any:
    """The value named as "module:ATTRIBUTE" (importing the module on first use)."""
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


# -------------------------------------------------------------------------------------------- preset values


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
