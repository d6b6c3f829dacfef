"""The codec-token cache (data.cache.codec_tokens, the speech models trained on a codec's codes): every clip's codes,
encoded once before training.

Same machinery and guarantees as the latent cache (dstune.cache): one safetensors entry per clip, written
atomically (`write_entry`), named by a sha256 key over everything that decides its content: the clip's identity
and bytes (for builtin:tones its text and the renderer version), the codec's folder (config and weights), the rate
the clip is resampled to and how many codebooks are kept. A changed clip, codec or setting misses; nothing is
looked up by position. Ranks that see the same cache folder split the entries (every k-th of the fixed list);
after a barrier every rank checks every entry it will read, so training never starts on a partial cache.

Codes do not depend on the rank count: each clip is encoded alone, in fp32 (the model's encode_clip,
dstune.families.speech.CodecTokensModel; a model whose codes are continuous latents has them stored as float32).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dstune.cache.entries import (
    Entry,
    bytes_sha256,
    entry_problem,
    file_sha256,
    folder_fingerprint,
    key_of,
    write_entry,
)
from dstune.cache.share import monitored_barrier, sharing_group
from dstune.data.audio import load_clip
from dstune.data.audio_index import AudioRecord
from dstune.distributed import all_gather_object
from dstune.spec.models import CacheSpec

CODEC_TENSORS = ("codes",)
_TONES_RENDERER = "tones-v1"  # bump when dstune.data.synthetic.render_tones changes


def codec_key(
    sample_id: str, content_sha256: str, codec_fingerprint: str, sample_rate: int, num_codebooks: int, codec_kind: str
) -> str:
    return key_of(
        {
            "kind": "codec",
            "sample_id": sample_id,
            "content": content_sha256,
            "codec": codec_fingerprint,
            "codec_kind": codec_kind,
            "sample_rate": int(sample_rate),
            "num_codebooks": int(num_codebooks),
        }
    )


def content_sha256(record: AudioRecord) -> str:
    if record.audio_path is None:
        return bytes_sha256(f"{_TONES_RENDERER}\0{record.caption}".encode())
    return file_sha256(record.audio_path)


def plan_codec_entries(records: list[AudioRecord], model) -> list[Entry]:
    """One entry per clip, in record order: the same list on every rank and for every world size."""
    fingerprint = folder_fingerprint(model.codec_folder)
    layout = model.layout
    return [
        Entry(
            "codec",
            codec_key(
                r.sample_id,
                content_sha256(r),
                fingerprint,
                layout["sampling_rate"],
                layout["num_codebooks"],
                model.codec_kind,
            ),
            r.sample_id,
            sample_id=r.sample_id,
            tensors=CODEC_TENSORS,
        )
        for r in records
    ]


def encode_entries(model, entries: list[Entry], by_id: dict[str, AudioRecord], folder: Path) -> tuple[int, int]:
    """Write every entry of `entries` that is not already complete in `folder`: (built now, already cached)."""
    built_now = cached = 0
    for entry in entries:
        if entry_problem(folder / entry.relpath, entry, full=False) is None:
            cached += 1
            continue
        codes = model.encode_clip(torch.from_numpy(load_clip(by_id[entry.sample_id], model.sample_rate)))
        codes = codes.to(torch.float32 if codes.is_floating_point() else torch.int32)
        write_entry(folder / entry.relpath, entry, {"codes": codes})
        built_now += 1
    return built_now, cached


def prepare_codec_cache(
    run, cache_spec: CacheSpec, folder: Path, model, records: list[AudioRecord]
) -> tuple[dict[str, Path] | None, str]:
    """Collective. ({sample_id: entry path}, summary) when every entry is complete, else (None, the error)."""
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    group = sharing_group(run, folder)
    entries = plan_codec_entries(records, model)
    mine = entries[group.index(run.rank) :: len(group)]
    built_now, cached = encode_entries(model, mine, {r.sample_id: r for r in records}, folder)
    error = monitored_barrier(run, cache_spec.barrier_timeout_minutes)
    missing = [f"{e.name}: {p}" for e in entries if (p := entry_problem(folder / e.relpath, e, full=False))]
    reports = all_gather_object((built_now, cached, missing, error))
    problems = [m for _, _, rank_missing, _ in reports for m in rank_missing] + [e for *_, e in reports if e]
    if problems:
        return None, "codec-token cache incomplete:\n  " + "\n  ".join(problems[:20])
    total_built = sum(r[0] for r in reports)
    summary = (
        f"codec-token cache {folder}: {len(entries)} clips, built now {total_built}, already cached "
        f"{len(entries) - total_built} ({time.perf_counter() - started:.2f} s)"
    )
    return {e.sample_id: folder / e.relpath for e in entries}, summary


def verify_codec_cache(run, folder: Path, model, records: list[AudioRecord]) -> tuple[bool, str]:
    """Collective: fully check (checksums included) every entry, each rank a share. (complete, report text)."""
    entries = plan_codec_entries(records, model)
    mine = entries[run.rank :: run.world_size]
    problems = [f"{e.name}: {p}" for e in mine if (p := entry_problem(folder / e.relpath, e, full=True))]
    problems = [p for share in all_gather_object(problems) for p in share]
    text = f"codec-token cache verify {folder}: {len(entries)} clips, {len(problems)} bad or missing" + "".join(
        f"\n  {p}" for p in problems[:20]
    )
    return not problems, text
