"""What dstune knows about a family's models without torch, for `dstune validate`, the memory plan and the video
planner: `FamilyFacts`, one per `model.family`, whose answers are those of the card of the spec's folder (found from
its configs: a built-in's stored ones, a local folder, the local Hugging Face cache, the configs stored with dstune).
Nothing here imports torch, diffusers or transformers: configs are JSON, counts come from the stored table or the
meta device (dstune.memory.counts, which imports torch only inside a function).

    facts = dstune.families.get_facts(spec.model.family)
    counts = facts.count(spec, num_samples, clips)       # ModelCounts: parameters, activations, cache bytes
    issues = facts.spec_issues(spec)                      # [(dotted key, message)]: the spec against the folder
    attention = facts.attention(spec)                     # families that split sequences: the heads, or None

Central modules ask these; they never branch on a family's name or guess a model from its config keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from dstune.families.speakers import Voices, voices_for
from dstune.memory.activations import adapters

Clip = tuple[int, int, int, int]  # (frames, width, height, clips): one bucket of a video dataset
SpecIssues = list[tuple[str, str]]  # (dotted key, message): an error about the spec, found from the model's configs


class CardOfSpec(Protocol):
    def __call__(self, spec):  # -> the card of the spec's folder (dstune.card.ModelCard), None when unknown here
        ...


class UnknownModel(Protocol):
    def __call__(self, spec, raising: bool) -> SpecIssues:
        """What to say of a folder whose model is not known here: the spec issues to report, or with `raising`
        SizesUnknown (the plan cannot count it)."""


# The transformer classes that carry a context-parallel plan (`_cp_plan`) in diffusers 0.42.1, the plan sequence
# parallelism splits their sequences with (dstune.families.ulysses); tests/unit/test_sequence_parallel_plan.py
# checks this table against the installed diffusers. A transformer class outside it cannot be split unless its
# model gives it a plan (its class's own_split_plan), whose card then answers the attention facts.
CONTEXT_PARALLEL_CLASSES = frozenset(
    {"WanTransformer3DModel", "FluxTransformer2DModel", "QwenImageTransformer2DModel", "Flux2Transformer2DModel"}
)


def no_plan_refusal(transformer_class: str) -> str:
    """Why a transformer class outside CONTEXT_PARALLEL_CLASSES cannot be split ("" when it can)."""
    if transformer_class in CONTEXT_PARALLEL_CLASSES:
        return ""
    return (
        f"its transformer class {transformer_class} has no context-parallel plan (_cp_plan) in the installed "
        "diffusers, so its sequence cannot be split"
    )


def lora_run_targets(model_spec) -> Optional[frozenset]:
    """The adapter targets of plain LoRA over an unquantized base: the runs the LoRA measurements are
    (dstune.memory.activations.adapters, which reads a model's LoRA table only where it was measured with these
    targets or more); None for any other adapter, base or full fine-tuning, which keep the full figure, an upper
    bound."""
    lora = getattr(model_spec, "lora_settings", None) if getattr(model_spec, "train", "full") == "lora" else None
    if (
        lora is None
        or getattr(lora, "type", "lora") != "lora"
        or getattr(model_spec, "base_precision", None) is not None
    ):
        return None
    return frozenset(lora.target_modules)


@dataclass(frozen=True)
class Attention:
    """A transformer's attention as a sequence-parallel split needs it (dstune.sequence_parallel): its heads, their
    width, and the configs they were read from."""

    heads: int
    head_dim: int
    origin: str
    refusal: str = ""  # why this model's sequences cannot be split ("" when they can)
    text_tokens: int = 0  # text tokens split with the image's (a joint sequence), 0 when the text stays whole
    # an image model's token geometry: pixels per image token along a side (the VAE's spatial factor x the latent
    # patch a token packs, from the model's configs), and the pictures in one sample's sequence (an edit model's
    # target and source: 2)
    px_per_token: int = 0
    pictures: float = 1  # in target areas: own-size references at their bound (FlowCard.picture_areas)


class FamilyFacts:
    """One model.family's facts: the family's own (its modality, whether it splits sequences) and, through `card`,
    its models' (each card answers for the folders of its model)."""

    def __init__(self, family: str, modality: str, splits_sequences: bool, card: CardOfSpec, unknown: UnknownModel):
        self.family, self.modality, self.splits_sequences = family, modality, splits_sequences
        self._card, self._unknown = card, unknown

    def card(self, spec):
        """The card of the spec's folder, or None when its configs are not here (or name no model of the family)."""
        return self._card(spec)

    def count(self, spec, num_samples: int, clips: Sequence[Clip] = ()):
        """The model's ModelCounts; SizesUnknown (dstune.memory.counts) with the reason when its configs are not
        here."""
        card = self.card(spec)
        if card is None:
            self._unknown(spec, raising=True)
        with adapters(lora_run_targets(spec.model)):
            return card.count(spec, num_samples, clips)

    def spec_issues(self, spec) -> SpecIssues:
        """What start-up would refuse of this spec on this folder, found offline from its configs (nothing when they
        are not here: start-up checks the folder itself)."""
        card = self.card(spec)
        return card.spec_issues(spec) if card is not None else self._unknown(spec, raising=False)

    def pairs(self, spec) -> Optional[str]:
        """The pipeline class when the model trains on (source, target) pairs (validate then checks the data gives
        them), else None."""
        card = self.card(spec)
        return card.pairs(spec) if card is not None else None

    def voices(self, spec, speakers: Sequence[str], texts: Sequence[str]) -> Optional[Voices]:
        """How the model hears the clips' `speakers` (one name per clip, `texts` their transcripts:
        dstune.families.speakers.voices_for); None where no clip names one or the model's configs are not here.
        SpeakersRefused with the reason."""
        card = self.card(spec)
        return voices_for(card, spec.model, spec.data.speakers, speakers, texts) if card is not None else None

    def attention(self, spec) -> Optional[Attention]:
        """The heads a sequence-parallel split divides, from the configs; None when they are not here."""
        card = self.card(spec)
        return card.attention(spec) if card is not None else None

    def trains_sound(self, spec) -> Optional[bool]:
        """Whether the model trains a clip's sound track beside its frames; None when its configs are not here
        (validate then counts the clips with and without sound: dstune.video_plan)."""
        card = self.card(spec)
        return card.trains_sound if card is not None else None
