"""What the tts_codebooks family asks of a multi-codebook TTS class it trains beside the one its own unit holds:
one `CodebooksModel`, declared by the model's unit as its recipe on that family (dstune.models.registry.recipes
("tts_codebooks")) and told apart by the folder's `architectures`. Torch-free: validate and the memory plan read it
without importing the torch side, which the family loads by name on first use.

The torch side is a module with
    build(model_spec, folders, device, dtype_for_frozen) -> a CodecTokensBuilt with `architecture` and `processor`
    encode_batch(built, batch, dtype) / loss(built, forward, encoded, seed, step) / sample(built, module, prompts,
    sample_spec, resolution) / synthesize(folder, text, seconds=, temperature=, seed=)
and a trained module that holds the whole class under `model.` (so that the family's export and LoRA code, which
load the class by its name and put the trained weights in, serve it unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from dstune.models import registry
from dstune.models.unit import load


@dataclass(frozen=True)
class CodebooksModel:
    title: str  # the model's name in messages
    architecture: str  # the transformers class its folder's config.json names
    torch_side: str  # the module of its build, encode_batch, loss, sample and synthesize
    # (spec, num_samples, folder, where its configs came from, config.json, (params, largest layer, LoRA params,
    # default-target LoRA params) of the class) -> ModelCounts; the class counted without its codec
    count: Callable
    takes_voice_prompts: bool = False  # its sample() continues sample.voice_prompts (reference clip + transcript)
    # parts of the class (dotted names, parameters or modules) that its trained module holds frozen: a full export
    # takes them from the pretrained folder, since the trained weights DeepSpeed consolidates leave them out
    frozen_parts: tuple[str, ...] = ()
    # config.json -> why the class cannot train this folder (None: it can); validate reports it at model.pretrained
    config_problem: Optional[Callable[[dict], Optional[str]]] = None


def codebooks_models() -> dict[str, CodebooksModel]:
    """{architecture: CodebooksModel} of every unit's recipe on the tts_codebooks family."""
    return {model.architecture: model for model in map(load, registry.recipes("tts_codebooks"))}
