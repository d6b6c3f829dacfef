"""The model families: `model.family` in the spec -> its models (their cards, dstune.registry), which of them a
folder holds, the family's torch-free facts, and loading a model's class.

    card = card_of(spec.model.family, folder)          # start-up: the folder's model (FamilyError when none)
    model = load_model(card, spec.model, folders, device, frozen_dtype)     # its class, loaded (imports torch)
    facts = get_facts(spec.model.family)               # validate, the memory plan, the video planner: no torch

A family of one model (its spec section is the unit's own) is that model's; a shared core's (flow, video, tts_codebooks)
tells its models apart by the folder's own classes (its card module's `card_of_folder`). This package and the
card modules are torch-free, so `dstune validate` never imports a model's torch side. Adding a family:
docs/architecture.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from dstune import registry
from dstune.card import ModelCard, load
from dstune.families import codebooks_card, flow_card, video_card
from dstune.families.base import FamilyError
from dstune.families.facts import FamilyFacts, SpecIssues
from dstune.memory.counts import SizesUnknown
from dstune.spec.models import FAMILIES, SECTIONS_BY_FAMILY

# The shared cores: their card modules tell a folder's model among the family's cards (card_of_folder at start-up,
# card_of_configs offline) and say what is known of a folder none of their models trains (unknown_model).
CORES = {"flow": flow_card, "video": video_card, "tts_codebooks": codebooks_card}
SPLITS_SEQUENCES = ("flow", "video")  # the families dstune's sequence parallelism splits (flow-matching transformers)


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown model family {name!r}; known families: {', '.join(sorted(FAMILIES))}")


def family_cards(family: str) -> tuple[ModelCard, ...]:
    if family not in FAMILIES:
        raise _unknown(family)
    return registry.family_cards(family)


def card_of(family: str, folder: Path) -> ModelCard:
    """The card of the model `folder` holds, among `family`'s; FamilyError saying why no model of it fits."""
    cards = family_cards(family)
    if family in CORES:
        return CORES[family].card_of_folder(cards, Path(folder))
    return cards[0]


def load_model(card: ModelCard, model_spec, folders: dict, device, frozen_dtype, zero3_config=None, **options):
    """The card's model class, loaded (dstune.families.base.TrainedModel.load)."""
    return load(card.model_class).load(card, model_spec, folders, device, frozen_dtype, zero3_config, **options)


def card_of_spec(spec) -> Optional[ModelCard]:
    """The card of the model spec.model.pretrained holds, from its configs (torch-free); None when they are not here
    or name no model of the family."""
    cards = family_cards(spec.model.family)
    if spec.model.family not in CORES:
        return cards[0]
    try:
        return CORES[spec.model.family].card_of_reference(cards, spec.model.pretrained)
    except (SizesUnknown, OSError, ValueError, FamilyError):
        return None


def _unknown_model(family: str):
    def said(spec, raising: bool) -> SpecIssues:
        if family in CORES:
            return CORES[family].unknown_model(family_cards(family), spec, raising)
        return []

    return said


FAMILY_FACTS: dict[str, FamilyFacts] = {
    family: FamilyFacts(
        family, SECTIONS_BY_FAMILY[family].modality, family in SPLITS_SEQUENCES, card_of_spec, _unknown_model(family)
    )
    for family in FAMILIES
}


def get_facts(name: str) -> FamilyFacts:
    """The torch-free facts of `model.family` == name; ValueError listing the known ones otherwise."""
    if name not in FAMILY_FACTS:
        raise _unknown(name)
    return FAMILY_FACTS[name]


def clip_token_factors(spec):
    """(VAE spatial factor, transformer patch (t, h, w), VAE temporal factor, where they came from) of a video
    model's configs, the common layout where they are not here (dstune.families.video_card.token_factors); None
    for a model that does not train on clips."""
    if get_facts(spec.model.family).modality != "video":
        return None
    return video_card.token_factors(family_cards(spec.model.family), spec.model.pretrained, spec)
