"""data.sets in validate's plan (torch-free): each set's files and samples per epoch (`set_rows`, from the index),
the Sets group's rows (`set_table_rows`) and what a preservation set adds to the Memory group
(`preservation_rows`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dstune.data.clips import index_clips
from dstune.data.groups import weighted_places
from dstune.data.index import DataError, index_dataset, set_counts


def _fmt(value: float) -> str:
    """3 significant digits, as the rest of the plan prints numbers."""
    return f"{value:.3g}"


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"


@dataclass(frozen=True)
class SetRow:
    """One set of data.sets as validate prints it."""

    label: str
    role: str
    files: int
    repeats: int
    samples: int  # per epoch, repeats counted (with set weights: the set's places)
    loss_weight: float
    weight: Optional[float] = None  # the set's sampling weight (data.sets.N.weight), or None with repeats
    files_samples: int = 0  # with set weights: the set's samples (kohya folder repeats counted)
    size: str = ""  # what the set trains at: "64 px", "buckets around 64 px"


def set_rows(data, video: bool = False) -> Optional[tuple[SetRow, ...]]:
    """data.sets' rows (files listed, not opened; a video family's clips from the headers, as the count reads
    them), or None with data.path or when a set cannot be indexed (its error is reported by the count)."""
    if data.sets is None:
        return None
    try:
        records = index_clips(data, read_captions=False).records if video else index_dataset(data, False).records
    except DataError:
        return None
    counts = set_counts(records, len(data.sets))
    weights = [item.weight for item in data.sets] if all(item.weight is not None for item in data.sets) else None
    places = weighted_places([samples for _, samples in counts], weights)
    return tuple(
        SetRow(
            item.label, item.role, files, item.repeats, place, item.loss_weight, item.weight, samples, _size(one, video)
        )
        for item, one, (files, samples), place in zip(data.sets, data.set_specs(), counts, places)
    )


def _size(one, video: bool = False) -> str:
    size = f"buckets around {one.resolution} px" if one.buckets.enabled else f"{one.resolution} px"
    if not video:
        return size
    frames = one.video.frame_counts
    return f"{frames[0] if len(frames) == 1 else '/'.join(map(str, frames))} frames at {size}"


def set_table_rows(plan, sets) -> list[tuple[str, str]]:
    """One row per set of data.sets: files, repeats, samples per epoch, its share of an epoch and of each global
    batch, role and loss weight; then what an epoch is."""
    total = sum(row.samples for row in sets) or 1
    rows = []
    for row in sets:
        share = row.samples / total
        rows.append(
            (
                row.label,
                (
                    f"{_count(row.files, 'file', 'files')} ({row.files_samples} samples), weight {_fmt(row.weight)}: "
                    if row.weight is not None
                    else f"{_count(row.files, 'file', 'files')} x {row.repeats} = "
                )
                + f"{row.samples} samples per epoch "
                f"({share:.0%}; {share * plan.global_batch_size:.3g} of each global batch of "
                f"{plan.global_batch_size}), {row.size}, {row.role}, loss weight {_fmt(row.loss_weight)}"
                + ("; target: the base model's output (adapters off)" if row.role == "preservation" else ""),
            )
        )
    rows.append(
        (
            "an epoch",
            (
                f"all sets' samples ({total}) as places, shared by weight (a set repeats or leaves out samples to "
                "fill its places, others each epoch)"
                if sets[0].weight is not None
                else f"every set's samples x repeats ({total}), each once"
            )
            + ", the sets spread evenly through it"
            + (" (within each bucket by chance)" if plan.groups else ""),
        )
    )
    return rows


def preservation_rows(spec) -> list[tuple[str, str]]:
    """A preservation set (DOP): the extra forward each micro batch holding one runs, and why the peak holds."""
    sets = getattr(spec.data, "sets", None) or []
    if not any(item.role == "preservation" for item in sets):
        return []
    return [
        (
            "  preservation",
            "+1 forward without gradients per micro batch holding a preservation sample (the base's prediction, "
            "adapters off), run before the trained forward: its activations are freed before those above exist, "
            "its output (one latent per sample) is held; the peak above holds",
        )
    ]


def at_largest_set(spec):
    """The spec the memory plan counts: with data.sets, data.resolution is the largest set's (a sample's
    activations, latents and tokens grow with it; the sets' buckets keep the area of their resolution), and
    data.video the set's with the most frames (a video family's clips; the clips counted from the files, where
    they are here, give their own buckets)."""
    if spec.data.sets is None:
        return spec
    specs = spec.data.set_specs()
    largest = max(one.resolution for one in specs)
    longest = max(specs, key=lambda one: one.video.max_frames).video
    if largest == spec.data.resolution and longest.max_frames == spec.data.video.max_frames:
        return spec
    return spec.model_copy(update={"data": spec.data.model_copy(update={"resolution": largest, "video": longest})})
