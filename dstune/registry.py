"""The registry of the models dstune trains: one line per model, naming its card (dstune.card), in the order of the
docs and of `dstune init` (images: the UNets, then the flow-matching transformers; video; speech).

Everything else that lists models is derived from it: the families' model choices (dstune.families.card_of), the
built-in tiny models (dstune.builtin), the `dstune init --model` presets, the single-file checkpoint layouts, the
spec reference and the docs' model lists. Adding a model adds its unit folder and one line here
(docs/architecture.md, "How to add a model").

The lines are "module:ATTRIBUTE" text and the cards are read on first use, so this module imports nothing of a unit:
any layer may ask it (the cores, the built-ins, validate) without an import circle. Torch-free, like the cards.
"""

from __future__ import annotations

from functools import cache
from typing import Optional

from dstune.card import ModelCard, ModelPreset, load

CARDS: tuple[str, ...] = (
    "dstune.models.sd.card:SD_CARD",
    "dstune.models.sdxl.card:SDXL_CARD",
    "dstune.models.sd3_flux.card:SD3_CARD",
    "dstune.models.sd3_flux.card:FLUX_CARD",
    "dstune.models.sd3_flux.card:FLUX_KONTEXT_CARD",
    "dstune.models.qwen_image.card:QWEN_IMAGE_CARD",
    "dstune.models.qwen_image.card:QWEN_IMAGE_EDIT_CARD",
    "dstune.models.qwen_image.card:QWEN_IMAGE_EDIT_PLUS_CARD",
    "dstune.models.zimage.card:Z_IMAGE_CARD",
    "dstune.models.flux2.card:FLUX2_KLEIN_CARD",
    "dstune.models.flux2.card:FLUX2_DEV_CARD",
    "dstune.models.ideogram4.card:IDEOGRAM4_CARD",
    "dstune.models.krea2.card:KREA2_CARD",
    "dstune.models.qwen_image_21.card:QWEN_IMAGE_21_CARD",
    "dstune.models.ernie_image.card:ERNIE_IMAGE_CARD",
    "dstune.models.wan.card:WAN_CARD",
    "dstune.models.hunyuan_video15.card:HUNYUAN_VIDEO15_CARD",
    "dstune.models.ltx2.card:LTX2_CARD",
    "dstune.models.minimax_h3.card:MINIMAX_H3_CARD",
    "dstune.models.kandinsky6.card:KANDINSKY6_CARD",
    "dstune.models.tts_lm.card:TTS_LM_CARD",
    "dstune.models.csm.card:CSM_CARD",
    "dstune.models.dia.card:DIA_CARD",
    "dstune.models.vibevoice.card:VIBEVOICE_CARD",
    "dstune.models.pocket_tts.card:POCKET_TTS_CARD",
    "dstune.models.gradium_phonon.card:GRADIUM_PHONON_CARD",
    "dstune.models.speecht5.card:SPEECHT5_CARD",
)

# The `model` sections of the families a unit owns (its model is the whole family), which dstune.spec.models joins
# to the shared cores' sections in the spec's union on model.family.
FAMILY_SECTIONS: tuple[str, ...] = (
    "dstune.models.sd.spec:SdModelSpec",
    "dstune.models.sdxl.spec:SdxlModelSpec",
    "dstune.models.tts_lm.spec:TtsLmModelSpec",
    "dstune.models.speecht5.spec:SpeechT5ModelSpec",
)


@cache
def cards() -> tuple[ModelCard, ...]:
    """Every model's card, in the registry's order."""
    return tuple(map(load, CARDS))


def family_cards(family: str) -> tuple[ModelCard, ...]:
    """The cards of the models of `model.family` == family."""
    return tuple(card for card in cards() if card.family == family)


def card(key: str) -> ModelCard:
    """The card whose key is `key` (KeyError naming the known keys otherwise)."""
    for found in cards():
        if found.key == key:
            return found
    raise KeyError(f"no model card {key!r}; known: {', '.join(c.key for c in cards())}")


def builtins() -> dict[str, str]:
    """Every built-in tiny model: name -> "module:ATTRIBUTE" of its BuiltinModel."""
    return {name: where for card in cards() for name, where in card.builtins.items()}


def builtin_names() -> tuple[str, ...]:
    """Every built-in tiny model's name (`builtin:` + it), without loading any build."""
    return tuple(builtins())


def presets() -> tuple[ModelPreset, ...]:
    """Every `dstune init --model` preset, in the registry's order."""
    return tuple(preset for card in cards() for preset in card.presets)


def preset(name: str) -> ModelPreset:
    """The `dstune init --model` preset called `name` (KeyError when there is none)."""
    for found in presets():
        if found.name == name:
            return found
    raise KeyError(name)


def checkpoint_layouts() -> dict[str, tuple[str, str]]:
    """Key prefixes of the models' original single-file checkpoints -> (model.family, what the file is)."""
    return {prefix: (card.family, what) for card in cards() for prefix, what in card.checkpoint_layouts.items()}


def activation_cases() -> tuple[str, ...]:
    """The models' activation measurement cases, as "module:ATTRIBUTE" of tuples of activation_cases.Case (the
    cards of one unit may name the same tuple)."""
    return tuple(dict.fromkeys(card.activation_cases for card in cards() if card.activation_cases))  # a unit's once


def family_classes(family: str) -> dict[str, Optional[float]]:
    """The folder classes the models of `family` train (shell patterns: a pipeline class, a transformers
    architecture) -> their default sampling guidance (dstune.card.ModelCard.folder_classes)."""
    return {name: guidance for card in family_cards(family) for name, guidance in card.folder_classes.items()}


def spec_notes(family: str, key: str) -> str:
    """What the models of `family` say of their own default for the spec key `key`, one model after another."""
    return " / ".join(card.spec_notes[key] for card in family_cards(family) if key in card.spec_notes)
