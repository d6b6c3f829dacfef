"""What dstune knows about a family's models without torch: the half of a model unit that `dstune validate`, the
memory plan and the video planner read. Each family declares one `ModelFacts` value, `FACTS`, in its
`<family>_facts.py` module beside its torch side (`<family>.py`); the registry (dstune.families) maps
`model.family` to it. Nothing here imports torch, diffusers or transformers: configs are JSON, counts come from
the stored table or the meta device (dstune.memory.counts, which imports torch only inside a function).

    facts = get_facts(spec.model.family)
    counts = facts.count(spec, num_samples, clips)       # ModelCounts: parameters, activations, cache bytes
    issues = facts.spec_issues(spec)                      # [(dotted key, message)]: the spec against the folder
    spatial, patch, temporal, origin = facts.token_factors(spec.model.pretrained)   # video families

Central modules ask these; they never branch on a family's name or guess a model from its config keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Protocol, Sequence

Clip = tuple[int, int, int, int]  # (frames, width, height, clips): one bucket of a video dataset
SpecIssues = list[tuple[str, str]]  # (dotted key, message): an error about the spec, found from the model's configs


class CountModel(Protocol):
    def __call__(self, spec, num_samples: int, clips: Sequence[Clip] = ()):  # -> dstune.memory.plan.ModelCounts
        ...


def no_spec_issues(spec) -> SpecIssues:
    return []


# The transformer classes that carry a context-parallel plan (`_cp_plan`) in diffusers 0.42.1, the plan sequence
# parallelism splits their sequences with (dstune.families.ulysses); tests/unit/test_sequence_parallel_plan.py
# checks this table against the installed diffusers. A transformer class outside it cannot be split unless its
# model unit gives it a plan (FlowRecipe.sequence_split), whose facts then answer the attention facts.
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
    pictures: int = 1


@dataclass(frozen=True)
class ModelFacts:
    """One family's torch-free facts (see the module docstring)."""

    family: str  # model.family
    modality: Literal["image", "video", "audio"]
    # (spec, num_samples, clips) -> ModelCounts, or raises dstune.memory.counts.SizesUnknown with the reason
    count: CountModel
    # spec -> [(key, message)]: what startup would refuse about this spec on this folder, found offline from its
    # configs (nothing when they are not on this machine: startup checks the folder itself)
    spec_issues: Callable = no_spec_issues
    # video: pretrained reference -> (VAE spatial factor, transformer patch (t, h, w), VAE temporal factor, origin)
    token_factors: Optional[Callable] = None
    # spec -> the pipeline class when the model trains on (source, target) pairs (an edit model), else None:
    # validate then checks that the data gives the pairs
    pairs: Callable = lambda spec: None
    # spec -> Attention (heads, head width, origin) or None when the configs
    # are not here; None (the field): the family has no sequence-parallel attention (deepspeed.sequence_parallel_size
    # is refused for it)
    attention: Optional[Callable] = None
