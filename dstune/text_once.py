"""Text encoders once per node: with the text cache, the ranks after the first of a node never load them.

    once = once_per_node(spec, card)                         the rule, decided once per stage
    here = text_encoders_here(run, once)                     before the load: whether this rank loads them
    load_model(..., text_encoders=here)
    prepare_cache(...)                                       the text entries go to the ranks that loaded them,
                                                             with sample_captions(...) beside the dataset's
    drop_text_encoders(model, index, captions)               after the cache, with `once`: every rank

Why: a text encoder is often the largest frozen part (a 12 B one is 24 GB in bf16), and every rank loading its own
copy into host memory at start-up is the most reported start-up failure of the largest video models. With data.cache.text_embeddings
no training step reads a text encoder: captions come from the cache. So local rank 0 of each node loads them, encodes
the text entries (split between those ranks where they share a cache folder), and drops them once the cache is
complete; the sample prompts (and "", the negative prompt) are cache entries too, and samples render from their
cached text. Where that cannot hold (dstune.families.denoiser_facts.text_once_per_node says why: no text cache, a
cache folder per rank, held-out evaluation, samples of a model that needs its encoders) every rank loads them, as
before. The memory plan counts the same rule (dstune.memory.plan: ModelCounts.once_per_node).
"""

from __future__ import annotations

import gc

import torch

from dstune.cache.entries import read_entry
from dstune.distributed import Run, all_gather_object
from dstune.families.denoiser_facts import text_once_per_node


def once_per_node(spec, card) -> bool:
    """Whether this run loads its text encoders on one rank per node (the model's card: a model whose start-up can,
    by the rule of dstune.families.denoiser_facts.text_once_per_node)."""
    if not card.text_once:  # a speech model, or one whose encoders every rank keeps
        return False
    return text_once_per_node(spec, card.samples_from_cached_text) is None


def text_encoders_here(run: Run, once: bool) -> bool:
    """Whether this rank loads the text encoders: every rank, or with `once` (once_per_node) the first of each node."""
    return run.local_rank == 0 or not once


def report_text_ranks(run: Run, here: bool) -> None:
    """Collective. Rank 0 says which ranks loaded the text encoders, where not all did (from what each rank did)."""
    loaded = [rank for rank, flag in enumerate(all_gather_object(bool(here))) if flag]
    if run.is_main and len(loaded) < run.world_size:
        print(
            f"text encoders: loaded on rank{'s' if len(loaded) > 1 else ''} {', '.join(map(str, loaded))} only "
            f"(the first of each node; {len(loaded)} of {run.world_size} ranks), for the text cache; dropped once "
            "it is built (samples render from their prompts' cached text)",
            flush=True,
        )


def sample_captions(spec, card) -> tuple[str, ...]:
    """The captions the text cache holds beside the dataset's where the samples render from cached text (with
    once_per_node): the sample prompts and the negative prompt the samples encode ("", which the pipelines encode
    when given none, or the model's own)."""
    if not spec.sample.prompts:
        return ()
    return tuple(dict.fromkeys([*spec.sample.prompts, card.negative_caption()]))


def drop_text_encoders(model, index, captions: tuple[str, ...]) -> None:
    """After a complete text cache (`index`, with once_per_node): free this rank's text encoders (if it loaded them)
    and keep the cached text of `captions` (sample_captions) for the samples."""
    model.prompt_text = {caption: read_entry(index.text_paths[caption]) for caption in captions}
    loaded = any(encoder is not None for encoder in model.text_encoders.values())
    model.text_encoders = {name: None for name in model.text_encoders}
    gc.collect()
    if loaded and torch.cuda.is_available():
        torch.cuda.empty_cache()
