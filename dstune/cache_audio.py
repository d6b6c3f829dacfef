"""The codec-token cache (data.cache.codec_tokens, family tts_lm): every clip's codes, encoded once before training.

Same machinery and guarantees as the latent cache (dstune.cache): one safetensors entry per clip, written
atomically (`write_entry`), named by a sha256 key over everything that decides its content: the clip's identity
and bytes (for builtin:tones its text and the renderer version), the codec's folder (config and weights), the rate
the clip is resampled to and how many codebooks are kept. A changed clip, codec or setting misses; nothing is
looked up by position. Ranks that see the same cache folder split the entries (every k-th of the fixed list);
after a barrier every rank checks every entry it will read, so training never starts on a partial cache.

Codes do not depend on the rank count: each clip is encoded alone, in fp32 (dstune.families.tts_lm.encode_clip).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from dstune.cache import Entry, bytes_sha256, entry_problem, file_sha256, folder_fingerprint, key_of, read_entry, write_entry
from dstune.data.audio_index import AudioRecord

CODEC_TENSORS = ("codes",)
_TONES_RENDERER = "tones-v1"  # bump when dstune.data.audio_index.render_tones changes


def codec_key(sample_id: str, content_sha256: str, codec_fingerprint: str, sample_rate: int, num_codebooks: int,
              codec_kind: str) -> str:
    return key_of({"kind": "codec", "sample_id": sample_id, "content": content_sha256, "codec": codec_fingerprint,
                   "codec_kind": codec_kind, "sample_rate": int(sample_rate), "num_codebooks": int(num_codebooks)})


def content_sha256(record: AudioRecord) -> str:
    if record.audio_path is None:
        return bytes_sha256(f"{_TONES_RENDERER}\0{record.caption}".encode())
    return file_sha256(record.audio_path)


def plan_codec_entries(records: list[AudioRecord], built) -> list[Entry]:
    """One entry per clip, in record order: the same list on every rank and for every world size."""
    fingerprint = folder_fingerprint(built.codec_folder)
    layout = built.layout
    return [Entry("codec", codec_key(r.sample_id, content_sha256(r), fingerprint, layout["sampling_rate"],
                                     layout["num_codebooks"], built.codec_kind),
                  r.sample_id, sample_id=r.sample_id, tensors=CODEC_TENSORS) for r in records]


def encode_entries(built, entries: list[Entry], by_id: dict[str, AudioRecord], folder: Path) -> tuple[int, int]:
    """Write every entry of `entries` that is not already complete in `folder`: (built now, already cached)."""
    from dstune.data.audio import load_clip
    from dstune.families.tts_lm import encode_clip

    built_now = cached = 0
    for entry in entries:
        if entry_problem(folder / entry.relpath, entry, full=False) is None:
            cached += 1
            continue
        wave = torch.from_numpy(load_clip(by_id[entry.sample_id], built.sample_rate))
        codes = encode_clip(built.codec, built.codec_kind, wave, built.layout["num_codebooks"])
        write_entry(folder / entry.relpath, entry, {"codes": codes.to(torch.int32)})
        built_now += 1
    return built_now, cached


def prepare_codec_cache(run, spec, built, records: list[AudioRecord]) -> tuple[dict[str, Path] | None, str]:
    """Collective. ({sample_id: entry path}, summary) when every entry is complete, else (None, the error)."""
    from dstune.cache_build import _monitored_barrier, _sharing_group, resolve_cache_dir
    from dstune.distributed import all_gather_object

    started = time.perf_counter()
    folder = resolve_cache_dir(spec.data.cache.dir, spec.output.cache_dir, run.rank, run.node_rank)
    folder.mkdir(parents=True, exist_ok=True)
    group = _sharing_group(run, folder)
    entries = plan_codec_entries(records, built)
    mine = entries[group.index(run.rank)::len(group)]
    built_now, cached = encode_entries(built, mine, {r.sample_id: r for r in records}, folder)
    error = _monitored_barrier(run, spec.data.cache.barrier_timeout_minutes)
    missing = [f"{e.name}: {p}" for e in entries if (p := entry_problem(folder / e.relpath, e, full=False))]
    reports = all_gather_object((built_now, cached, missing, error))
    problems = [m for _, _, rank_missing, _ in reports for m in rank_missing] + [e for *_, e in reports if e]
    if problems:
        return None, "codec-token cache incomplete:\n  " + "\n  ".join(problems[:20])
    total_built = sum(r[0] for r in reports)
    summary = (f"codec-token cache {folder}: {len(entries)} clips, built now {total_built}, already cached "
               f"{len(entries) - total_built} ({time.perf_counter() - started:.2f} s)")
    return {e.sample_id: folder / e.relpath for e in entries}, summary


class CachedSpeechDataset(Dataset):
    """Like dstune.data.audio.SpeechDataset, but each item carries its cached `codes` instead of the audio."""

    def __init__(self, records: list[AudioRecord], paths: dict[str, Path]):
        self.records = [r for r in records for _ in range(r.repeats)]
        self.paths = paths

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        codes = read_entry(self.paths[record.sample_id])["codes"].long()
        return {"index": index, "sample_id": record.sample_id, "codes": codes, "text": record.caption,
                "speaker": record.speaker}

    @staticmethod
    def collate(samples: list[dict]) -> dict:
        return {"index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
                "sample_ids": [s["sample_id"] for s in samples], "codes": [s["codes"] for s in samples],
                "texts": [s["text"] for s in samples], "speakers": [s["speaker"] for s in samples]}


def run_codec_cache(run, spec, verify_only: bool) -> int:
    """`dstune cache SPEC [--verify]` / `train.py SPEC --cache-only` for data.cache.codec_tokens: build (or fully
    check, checksums included) every entry, the ranks sharing the work; exit code 0 when complete."""
    from dstune.cache_build import resolve_cache_dir
    from dstune.data.audio import speech_records_for_run
    from dstune.distributed import all_gather_object
    from dstune.session import _build

    _, built = _build(run, spec)
    records = speech_records_for_run(run, spec.data)
    if not verify_only:
        paths, text = prepare_codec_cache(run, spec, built, records)
        if run.is_main:
            print(text, flush=True)
        return 0 if paths is not None else 1
    folder = resolve_cache_dir(spec.data.cache.dir, spec.output.cache_dir, run.rank, run.node_rank)
    entries = plan_codec_entries(records, built)
    mine = entries[run.rank::run.world_size]
    problems = [f"{e.name}: {p}" for e in mine if (p := entry_problem(folder / e.relpath, e, full=True))]
    problems = [p for share in all_gather_object(problems) for p in share]
    if run.is_main:
        print(f"codec-token cache verify {folder}: {len(entries)} clips, {len(problems)} bad or missing"
              + "".join(f"\n  {p}" for p in problems[:20]), flush=True)
    return 1 if problems else 0
