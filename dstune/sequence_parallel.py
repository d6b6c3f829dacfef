"""Sequence parallelism (deepspeed.sequence_parallel_size, DeepSpeed Ulysses) as `dstune validate` sees it: which
rank holds which part of a sample, what the spec must satisfy, and what one rank holds of a sample's tokens.
Torch-free; the attention split itself is dstune.families.ulysses.

The world is data-parallel x sequence-parallel: rank r = dp * N + sp (dstune.distributed.Run), so the N ranks of one sequence group are
consecutive (DeepSpeed's deepspeed.runtime.sequence_parallel.parallel_state_sp builds the same groups). Every rank of
a group receives the same samples (the loader is keyed by the data-parallel rank), and each holds 1/N of every
sequence between the attention all-to-alls, so N must divide the attention heads (the all-to-all trades the
sequence split for a head split) and each bucket's tokens per sample (no padding: the split is exact).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from dstune.spec.section import VIDEO_FAMILY
from dstune.families import clip_token_factors, get_facts
from dstune.data.clips import latent_tokens
from dstune.families.facts import Attention
from dstune.plan import key_label
from dstune.spec.load import SpecIssue, SpecSource

KEY = "deepspeed.sequence_parallel_size"
ASSUMED_PX_PER_TOKEN = 16  # an image model's configs not here: an 8x VAE and 2x2 latent patches per token
ALL_TO_ALL_TENSORS = 4  # query, key and value in, the attention output back: each re-laid out through a buffer


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def attention_of(spec) -> Optional[Attention]:
    """The model's attention heads from its configs, None when they are not on this machine."""
    facts = get_facts(spec.model.family)
    return facts.attention(spec) if facts.splits_sequences else None


def sequence_issues(spec, source: SpecSource, world_size: int, bucket_tokens: dict[str, int]) -> list[SpecIssue]:
    """The spec's sequence_parallel_size against the model, the world and the buckets' tokens per sample
    ({label: tokens}): one error naming the key, every rule it breaks and the sizes that would work."""
    size = spec.deepspeed.sequence_parallel_size
    if size == 1:
        return []
    facts = get_facts(spec.model.family)
    if not facts.splits_sequences:
        return [
            source.issue(
                KEY,
                f"{size}: model.family {spec.model.family} has no sequence-parallel attention in "
                "dstune (the split is made on the flow-matching transformers of model.family flow and "
                f"{VIDEO_FAMILY}; docs/sequence-parallel.md lists them). Remove the key "
                "(sequence_parallel_size: 1), or "
                "shrink activations with model.gradient_checkpointing or a smaller micro batch.",
            )
        ]
    problems = []  # one issue for the key (validate keeps one per key and place), every broken rule in it
    if spec.deepspeed.zero_stage == 0:
        problems.append(
            "it needs ZeRO (deepspeed.zero_stage 1, 2 or 3): without ZeRO, DeepSpeed's gradient clipping "
            "adds the norms of a sequence group's identical gradients"
        )
    if world_size % size:
        problems.append(
            f"it does not divide the {world_size} ranks (the ranks form groups of {size} that share each "
            f"sample): use one of {', '.join(map(str, _divisors(world_size)))}, or launch a multiple of "
            f"{size} ranks"
        )
    attention = facts.attention(spec)
    if attention is not None and attention.refusal:
        return [
            source.issue(
                KEY,
                f"{size}: {attention.refusal}. Remove the key (sequence_parallel_size: 1), or "
                "shrink activations with model.gradient_checkpointing or a smaller micro batch.",
            )
        ]
    if attention is not None and attention.heads % size:
        problems.append(
            f"it does not divide the transformer's {attention.heads} attention heads ({attention.origin}; "
            "the all-to-all gives each rank heads / N whole heads): use one of "
            f"{', '.join(map(str, _divisors(attention.heads)))}"
        )
    uneven = {label: tokens for label, tokens in bucket_tokens.items() if tokens % size}
    if uneven:
        listing = ", ".join(f"{label}: {tokens}" for label, tokens in uneven.items())
        problems.append(
            f"it does not divide the tokens per sample of {len(uneven)} bucket(s) ({listing}; each rank "
            "holds exactly tokens / N of a sequence, dstune pads none): change data.resolution / "
            "data.video.frames (model.sample_frames for the samples; model.max_sequence_length for the "
            "text) so that the tokens divide, or the size"
        )
    if not problems:
        return []
    working = [
        n
        for n in _divisors(world_size)
        if (attention is None or attention.heads % n == 0)
        and all(tokens % n == 0 for tokens in bucket_tokens.values())
        and (n == 1 or spec.deepspeed.zero_stage > 0)
    ]
    return [
        source.issue(
            KEY,
            f"{size}: " + "; and ".join(problems) + ". Sizes that keep every rule on "
            f"{world_size} rank(s): {', '.join(map(str, working))}.",
        )
    ]


def bucket_tokens(
    spec, clips: Optional[dict], image_groups: Optional[dict] = None, pictures: Optional[list] = None
) -> dict[str, int]:
    """{bucket label: transformer tokens per sample}: a video family's clip buckets, or without them (the files are
    not here) the clip the plan assumes, data.video's longest frame count at data.resolution square, and the
    samples' clip (model.sample_frames) when sample.prompts render; {} for a family without token factors."""
    facts = get_facts(spec.model.family)
    if facts.modality == "image" and facts.splits_sequences:
        return _image_tokens(spec, image_groups, pictures)
    factors = clip_token_factors(spec)
    if factors is None:
        return {}
    spatial, patch, temporal, _ = factors
    card = get_facts(spec.model.family).card(spec)
    split = getattr(card, "split_tokens", None) or (lambda spec, frames, tokens: (tokens, ""))

    def tokens_of(label: str, frames: int, video: int) -> tuple[str, int]:
        tokens, what = split(spec, frames, video)
        return (f"{label}: {what}" if what else label), tokens

    if clips:
        tokens = dict(
            tokens_of(label, bucket["frames"], bucket["tokens"]) for label, bucket in clips["buckets"].items()
        )
    else:
        key = (spec.data.video.max_frames, spec.data.resolution, spec.data.resolution)
        tokens = dict([tokens_of(key_label(key), key[0], latent_tokens(key, spatial, patch, temporal))])
    frames = getattr(spec.model, "sample_frames", None)
    if spec.sample.prompts and frames:  # samples render split too, at data.resolution square
        key = (frames, spec.data.resolution, spec.data.resolution)
        label, count = tokens_of(f"samples ({key_label(key)})", frames, latent_tokens(key, spatial, patch, temporal))
        tokens[label] = count
    return tokens


def _image_tokens(spec, image_groups: Optional[dict], own_pictures: Optional[list] = None) -> dict[str, int]:
    """An image model's image tokens per bucket ({"WxH": samples} with data.buckets, else data.resolution square),
    at the pixels per token of its configs (VAE factor x latent patch; 16 when the configs are not here: the 8x VAE
    and 2x2 patches of most models), an edit model's target and source together, and the text tokens split with
    them. `own_pictures`: references at their own sizes, every distinct (target, reference, ...) size the data
    holds (dstune.data.buckets.own_size_pictures), each picture counted at its own size."""
    attention = attention_of(spec)
    px = (attention.px_per_token if attention is not None else 0) or ASSUMED_PX_PER_TOKEN
    if own_pictures:
        tokens = {
            " + ".join(f"{w}x{h}" for w, h in sizes): sum((w // px) * (h // px) for w, h in sizes)
            for sizes in own_pictures
        }
        return {
            **tokens,
            **({"text": attention.text_tokens} if attention is not None and attention.text_tokens else {}),
        }
    pictures = attention.pictures if attention is not None else 1
    sizes = list(image_groups or {}) or [f"{spec.data.resolution}x{spec.data.resolution}"]
    tokens = {}
    for label in sizes:
        width, height = (int(side) for side in str(label).split("x"))
        tokens[label if pictures == 1 else f"{label} (target and source)"] = round(
            pictures * (width // px) * (height // px)
        )
    if attention is not None and attention.text_tokens:
        tokens["text"] = attention.text_tokens
    return tokens


def all_to_all_bytes(micro_batch: int, tokens: int, attention: Attention, size: int, bytes_per_element: float) -> float:
    """Bytes one rank holds at once for an attention all-to-all: query, key, value and output of its micro batch,
    each a (tokens / N) x heads x head_dim slice sent and its re-laid-out copy received."""
    if size == 1:
        return 0.0
    per_tensor = micro_batch * tokens / size * attention.heads * attention.head_dim * bytes_per_element
    return 2.0 * ALL_TO_ALL_TENSORS * per_tensor


def with_all_to_all(setup, spec, clips: Optional[dict]):
    """The memory plan's Setup with the all-to-all buffers of the largest bucket's sample (unchanged at N = 1, or
    when the model's configs or the tokens are not known here)."""
    training = [
        tokens
        for label, tokens in bucket_tokens(spec, clips).items()
        if not label.startswith("samples") and label != "text"
    ]
    attention, tokens = attention_of(spec), max(training, default=0)
    if setup.sequence_parallel == 1 or attention is None or not tokens:
        return setup
    return replace(
        setup,
        all_to_all_bytes=all_to_all_bytes(
            setup.micro_batch, tokens, attention, setup.sequence_parallel, setup.weight_bytes
        ),
    )


def report_rows(spec, plan, clips: Optional[dict]) -> list[tuple[str, str]]:
    """validate's rows for the world's two degrees and what one rank holds of a sample (none at N = 1)."""
    size = plan.sequence_parallel_size
    if size == 1:  # data-parallel only: the World and Batch rows say it all
        return []
    rows = [
        ("parallelism", f"{plan.data_parallel_size} data-parallel x {size} sequence-parallel ({plan.world_size} ranks)")
    ]
    rows.append(
        (
            "per data-parallel rank",
            f"{plan.micro_batch_size} sample(s) per forward pass, shared by the {size} ranks of its sequence group",
        )
    )
    image_groups = {key_label(group.key): group.samples for group in plan.groups} or None
    for label, tokens in bucket_tokens(spec, clips, image_groups).items():
        rows.append((f"  {label}", f"{tokens} tokens per sample -> {tokens // size} per rank"))
    return rows
