"""The latent and text-embedding cache (data.cache.latents / text_embeddings): build or verify every entry a run
reads, on every rank together, then report once.

    index, code = prepare_cache(run, job, model, records)    # dstune.startup: training and `dstune cache` alike

Ranks that share a folder split its entries (dstune.cache.share). Entries are grouped into fixed chunks of the one
global entry list, and chunk j goes to member j % group_size, so the encoder sees the same batches whatever the
rank count (entries are then identical, bit for bit, to a one-rank build with the same chunk). A chunk holds
LatentCacheJob.chunk_entries entries: the memory plan's choice for the GPU's memory (dstune.memory.verdict.
choose_encoding), from dstune.memory.working.MAX_CHUNK_ENTRIES down to one, the same on every rank.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dstune.cache.entries import (
    Entry,
    bytes_sha256,
    entry_problem,
    file_sha256,
    folder_fingerprint,
    plan_entries,
    write_entry,
)
from dstune.cache.share import monitored_barrier, sharing_group
from dstune.data.buckets import header_size, sample_buckets
from dstune.data.clips import set_side, set_video
from dstune.data.images import BadSampleError, ImageCaptionDataset
from dstune.data.index import control_records
from dstune.data.pairs import own_reference_size, reference_suffix, target_of
from dstune.data.synthetic import render_shape
from dstune.data.video import VideoCaptionDataset, stack_sounds
from dstune.distributed import agree_or_stop, all_gather_object
from dstune.families.diffusion import vae_posterior
from dstune.families.loss_terms import mask_at_latents
from dstune.memory.working import MAX_CHUNK_ENTRIES
from dstune.spec.models import DataSpec


@dataclass(frozen=True)
class LatentCacheJob:
    """What one latent/text cache build or verify needs besides the ranks, the encoders and the records."""

    data: DataSpec
    folder: Path  # this rank's cache folder (dstune.cache.share.cache_folder)
    model_folder: Path  # the pretrained folder whose encoders key the entries
    text_folders: tuple[str, ...]  # its subfolders that decide a caption's tensors (their fingerprint keys them)
    text_tensors: tuple[str, ...]  # what a text entry stores (the model's encode_text gives them)
    text_settings: str  # the model's settings that shape the text tensors (flow: the sequence length), or ""
    seed: int
    dtype: torch.dtype  # the frozen encoders' dtype (dstune.engine.PRECISION_DTYPES)
    video: bool = False  # a video model: entries are clips (dstune.data.video), keyed by data.video's choices too
    # what the model stores beside each posterior in this run (its card's latent_cache_key: settings and subfolders
    # key the latent entries; the model's condition_tensors give the tensors); "": the posterior only
    latent_settings: str = ""
    latent_folders: tuple[str, ...] = ()
    latent_tensors: tuple[str, ...] = ()
    text_here: bool = True  # this rank loaded the text encoders (dstune.text_once): text entries go to such ranks
    extra_captions: tuple[str, ...] = ()  # captions cached beside the dataset's (sample prompts: dstune.text_once)
    chunk_entries: int = MAX_CHUNK_ENTRIES  # entries per encoder pass (the memory plan's cache_encoding)
    vae_tiling: str = ""  # model.vae_tiling: the tiles the VAE encodes through (its latents are keyed apart)


@dataclass
class CacheIndex:
    """What training reads: the folder, and the entry of each (sample, flip) and caption."""

    folder: Path
    latents: bool
    text: bool
    latent_paths: dict[tuple[str, bool], Path] = field(default_factory=dict)
    text_paths: dict[str, Path] = field(default_factory=dict)
    failed_samples: set[str] = field(default_factory=set)  # unreadable images (with data.skip_bad_files)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fingerprints(folder: Path, text_folders: tuple[str, ...]) -> dict[str, str]:
    """The VAE's fingerprint, and one over every component that decides a caption's embedding (the card's
    text_cache_folders; for SD text_encoder + tokenizer)."""
    text = bytes_sha256("".join(folder_fingerprint(folder / name) for name in text_folders).encode())
    return {"vae": folder_fingerprint(folder / "vae"), "text": text}


def _content_hash(record, data: DataSpec, clips, file_hashes: dict) -> str:
    """The file's sha256 (`file_hashes`: those already computed, by path: a video's sliding chunks share one), or
    for built-in samples the rendered pixels'; for clips (`clips`: the video dataset that reads them, None for
    images) data.video's choices (frames, sampling, fps, stride) are part of it, since they change what is encoded
    (a chunk's own place is in its sample id)."""
    video = clips is not None
    if record.image_path is not None:
        if record.image_path not in file_hashes:
            file_hashes[record.image_path] = file_sha256(record.image_path)
        content = file_hashes[record.image_path]
    elif video:
        content = bytes_sha256(b"builtin-clip\0" + clips.load_clip(record).numpy().tobytes())
    else:
        number = int(record.sample_id.rsplit("/", 1)[1])
        side = data.set_specs()[record.set_index].resolution  # data.resolution, or the set's
        content = bytes_sha256(b"builtin-render\0" + render_shape(number, side)[0].tobytes())
    if video:
        content = bytes_sha256(f"{content}/{set_video(data, record.set_index)!r}".encode())  # the set's frames
    return _with_mask(record, data, content, file_hashes)


def _with_mask(record, data: DataSpec, content: str, file_hashes: dict) -> str:
    """A masked run's latent entries hold the loss mask too: its content joins the key (the mask file's bytes, or
    the alpha channel's file, which is the image's), so adding, editing or removing a mask rebuilds the entry. An
    unmasked run's key is what it was before masks existed."""
    if not data.masked:
        return content
    if record.mask_path is not None:
        if record.mask_path not in file_hashes:
            file_hashes[record.mask_path] = file_sha256(record.mask_path)
        return bytes_sha256(f"{content}/mask:{file_hashes[record.mask_path]}".encode())
    alpha = data.set_specs()[record.set_index].alpha_mask
    return bytes_sha256(f"{content}/mask:{'alpha' if alpha else 'none'}".encode())


def _content_hashes(run, records, data: DataSpec, video: bool) -> tuple[dict[str, str], dict[str, str]]:
    """sample_id -> content sha256 for all records (each rank hashes a share), and sample_id -> reason for files
    that could not be read."""
    mine, bad, share, file_hashes = {}, {}, records[run.rank :: run.world_size], {}
    clips = VideoCaptionDataset(data, share, 0) if video and share else None
    for record in share:
        try:
            mine[record.sample_id] = _content_hash(record, data, clips, file_hashes)
        except OSError as err:
            bad[record.sample_id] = err.strerror or str(err)
    hashes, unreadable = {}, {}
    for share_hashes, share_bad in all_gather_object((mine, bad)):
        hashes.update(share_hashes)
        unreadable.update(share_bad)
    return hashes, unreadable


def _with_sources(records) -> list:
    """Edit pairs: each target's source image as a record of its own (dstune.data.index.control_records), so its
    latents are cached beside the target's, keyed by its own content, at the target's size and flip."""
    return list(records) + control_records(records)


def _sizes(targets, data, video: bool) -> dict | None:
    """sample_id -> bucket with data.buckets; a reference takes its target's bucket (the pair stays together), or
    with data.reference_size own its own size for that bucket (dstune.spec.reference_sizes.own_reference_size); a clip's
    (dstune.data.clips.ClipRecord) was chosen from its header when the clips were listed."""
    if video and data.sets is not None:  # each clip's bucket, or its set's square (a set's resolution keys it)
        return _with_references({r.sample_id: r.size or (set_side(data, r.set_index),) * 2 for r in targets}, targets)
    if video:  # a reference clip (in-context control) is read at its clip's size
        return _with_references({r.sample_id: r.size for r in targets}, targets) if data.buckets.enabled else None
    sizes = sample_buckets(targets, data)
    own = data.reference_size == "own" and any(r.control_paths for r in targets)
    if sizes is None and not own:
        return None
    if sizes is None:  # every target at data.resolution's square (its entry keeps the key it had)
        sizes = {}
    references = {}
    for r in targets:
        target = sizes.get(r.sample_id) or (data.resolution, data.resolution)
        found = _own_sizes(r, target) if own else [target] * len(r.control_paths)
        references.update({r.sample_id + reference_suffix(k): size for k, size in enumerate(found)})
    return {**sizes, **references}


def _with_references(sizes: dict, targets) -> dict:
    """`sizes` with each target's references at the target's size."""
    found = {
        r.sample_id + reference_suffix(k): sizes[r.sample_id] for r in targets for k in range(len(r.control_paths))
    }
    return {**sizes, **found}


def _own_sizes(record, target) -> list:
    """Each reference's own size (from its header); None for an unreadable one (its entry fails when encoded)."""
    found = []
    for path in record.control_paths:
        try:
            found.append(own_reference_size(header_size(path), target))
        except (OSError, ValueError, SyntaxError):
            found.append(None)
    return found


def _encode_latents(
    model, dataset, by_id: dict, entries: list[Entry], resolution: int, extras: bool = False
) -> tuple[dict, dict]:
    pixels, sounds, masks, ok, failed = [], [], [], [], {}
    masked = isinstance(dataset, ImageCaptionDataset) and dataset.masked
    for entry in entries:
        record, size = by_id[entry.sample_id], entry.size or resolution
        try:  # an entry joins the lists only once all it needs was read (a bad mask or sound drops it whole)
            pixel = dataset.cache_pixels(record, size, entry.flip)
            mask = dataset.cache_mask(record, size, entry.flip) if masked else None
            if getattr(dataset, "sound_rate", None):
                sound, heard = dataset.clip_sound(record)
                sounds.append({"sample_id": entry.name, "sound": sound, "has_sound": heard})
        except BadSampleError as err:
            failed[entry.name] = err.message
            continue
        pixels.append(pixel)
        masks.append(mask)
        ok.append(entry)
    tensors = {}
    for shape in dict.fromkeys(p.shape for p in pixels):  # one pass per shape: stills beside clips (video)
        same = [i for i, p in enumerate(pixels) if p.shape == shape]
        stacked = torch.stack([pixels[i] for i in same]).to(model.device, model.vae.dtype)
        mean, std = vae_posterior(model.vae, stacked)
        more = model.condition_tensors(stacked) if extras else {}
        if sounds:  # a model that trains on sound: its latents beside the posterior (silence's where a clip has none)
            heard = stack_sounds([sounds[i] for i in same])
            more["sound_latent"] = model.encode_sound(heard["sound"].to(model.device))
            more["has_sound"] = heard["has_sound"].float().unsqueeze(1)
        if masked:  # the loss masks at the latent grid (a clip's: frames x h x w)
            more["loss_mask"] = mask_at_latents(torch.stack([masks[i] for i in same]), tuple(mean.shape[2:]))
        tensors.update(
            {
                ok[i].key: {
                    "latent_mean": mean[j].cpu(),
                    "latent_std": std[j].cpu(),
                    **{name: value[j].cpu() for name, value in more.items()},
                }
                for j, i in enumerate(same)
            }
        )
    return tensors, failed


def _encode_texts(model, entries: list[Entry]) -> tuple[dict, dict]:
    with torch.no_grad():
        tensors = {name: value.cpu() for name, value in model.encode_text([e.caption for e in entries]).items()}
    return {e.key: {name: value[i] for name, value in tensors.items()} for i, e in enumerate(entries)}, {}


def _chunks(entries: list[Entry], per_chunk: int) -> list[list[Entry]]:
    out = []
    for kind in ("latent", "text"):
        for size in dict.fromkeys(e.size for e in entries if e.kind == kind):  # one size per encoder batch (buckets)
            same = [e for e in entries if e.kind == kind and e.size == size]
            out += [same[i : i + per_chunk] for i in range(0, len(same), per_chunk)]
    return out


def chunks_of_rank(chunks: list[list[Entry]], group: list[int], text_group: list[int], rank: int) -> list[list[Entry]]:
    """This rank's chunks: latent chunks dealt in turn to the ranks sharing the folder, text chunks to those of them
    that loaded the text encoders (all of them, or the first of each node: dstune.text_once)."""
    mine, dealt = [], {"latent": 0, "text": 0}
    for chunk in chunks:
        kind = chunk[0].kind
        members = text_group if kind == "text" else group
        if rank in members and dealt[kind] % len(members) == members.index(rank):
            mine.append(chunk)
        dealt[kind] += 1
    return mine


def _build_share(model, dataset, by_id: dict, folder: Path, chunks, resolution: int, extras: bool = False) -> dict:
    """Encode and write every entry of these chunks that is not already a complete, checksummed file.
    A chunk is encoded whole (same batches as any other world size) but only its bad entries are written."""
    counts = {"built": 0, "cached": 0, "failed": {}}
    for chunk in chunks:
        todo = [e for e in chunk if entry_problem(folder / e.relpath, e, full=True) is not None]
        counts["cached"] += len(chunk) - len(todo)
        if not todo:
            continue
        if chunk[0].kind == "latent":
            tensors, failed = _encode_latents(model, dataset, by_id, chunk, resolution, extras)
        else:
            tensors, failed = _encode_texts(model, chunk)
        counts["failed"].update(failed)
        for entry in todo:
            if entry.key in tensors:
                write_entry(folder / entry.relpath, entry, tensors[entry.key])
                counts["built"] += 1
    return counts


def _verify_share(folder: Path, chunks) -> dict:
    """--verify: fully check (checksums) this rank's share without building anything."""
    counts = {"built": 0, "cached": 0, "failed": {}}
    for chunk in chunks:
        for entry in chunk:
            problem = entry_problem(folder / entry.relpath, entry, full=True)
            if problem:
                counts["failed"][entry.name] = problem
            else:
                counts["cached"] += 1
    return counts


def _summary(
    folder_reports, entries_total: int, unreadable: dict, verify_only: bool, seconds: float
) -> tuple[str, list[str]]:
    """One text over all ranks, per cache folder, and the failures."""
    lines, failures = [], []
    for folder, ranks, built, cached, failed in folder_reports:
        lines.append(
            f"  {folder} (ranks {', '.join(map(str, ranks))}): {entries_total} entries, "
            f"{'checked' if verify_only else 'built now'} {cached if verify_only else built}, "
            f"{'' if verify_only else f'already cached {cached}, '}failed {len(failed)}"
        )
        failures += [f"  {folder}: {name}: {reason}" for name, reason in sorted(failed.items())]
    failures += [f"  {sample_id}: cannot read the file ({reason})" for sample_id, reason in sorted(unreadable.items())]
    head = "cache verify" if verify_only else "cache"
    return f"{head}: {entries_total} entries per folder ({seconds:.2f} s)\n" + "\n".join(lines), failures


def _index(folder: Path, entries: list[Entry], cache_spec, failed_samples: set[str]) -> CacheIndex:
    index = CacheIndex(folder, cache_spec.latents, cache_spec.text_embeddings, failed_samples=failed_samples)
    for entry in entries:
        if entry.kind == "latent":
            index.latent_paths[(entry.sample_id, entry.flip)] = folder / entry.relpath
        else:
            index.text_paths[entry.caption] = folder / entry.relpath
    return index


def _job_fingerprints(job: LatentCacheJob) -> dict[str, str]:
    """The fingerprints that key the entries: the VAE's and the text side's, with the job's settings folded in."""
    fingerprints = _fingerprints(job.model_folder, job.text_folders)
    if job.text_settings:  # e.g. flow's max_sequence_length: same encoders, other tensors
        fingerprints["text"] = bytes_sha256((fingerprints["text"] + job.text_settings).encode())
    if job.latent_settings:  # e.g. image-to-video: the first frame's condition (and its encoders) beside the posterior
        extra = "".join(folder_fingerprint(job.model_folder / name) for name in job.latent_folders)
        fingerprints["vae"] = bytes_sha256((fingerprints["vae"] + job.latent_settings + extra).encode())
    if job.vae_tiling:  # tiled latents are not the untiled ones
        fingerprints["vae"] = bytes_sha256((fingerprints["vae"] + "/vae tiled: " + job.vae_tiling).encode())
    return fingerprints


def _text_group(run, job: LatentCacheJob, group: list[int], entries: list[Entry], verify_only: bool) -> list[int]:
    """Collective. The ranks of this folder's group that encode text entries: those that loaded the text encoders
    (dstune.text_once); a verify reads entries only, so every member."""
    text_group = [rank for rank, here in enumerate(all_gather_object(job.text_here)) if here and rank in group]
    error = None
    if not (verify_only or text_group) and any(e.kind == "text" for e in entries):
        error = (
            f"cache build: no rank sharing {job.folder} loaded the text encoders; this is a bug of dstune's start-up"
        )
    agree_or_stop(run, error)
    return group if verify_only else text_group


def prepare_cache(run, job: LatentCacheJob, model, records, verify_only: bool = False) -> tuple[CacheIndex | None, int]:
    """Build (or with verify_only, check) every entry this run reads, on every rank together; print one summary.
    Returns (index, 0) or, when incomplete, (None, exit code 1) after printing why. Never returns an index with a
    missing entry: after the barrier each rank checks every entry it will read. `model` may be None to verify."""
    data, cache_spec, folder = job.data, job.data.cache, job.folder
    started = time.perf_counter()
    error = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        error = f"data.cache.dir {folder}: cannot create it ({err.strerror or err}) on rank {run.rank}"
    agree_or_stop(run, error)
    group = sharing_group(run, folder)
    targets, records = records, _with_sources(records) if cache_spec.latents else records
    hashes, unreadable = _content_hashes(run, records, data, job.video)
    entries = plan_entries(
        records,
        hashes,
        _job_fingerprints(job),
        data.resolution,
        data.random_flip,
        max(one.caption_dropout for one in data.set_specs()),  # the empty caption, where any set drops captions
        _dtype_name(job.dtype),
        cache_spec.latents,
        cache_spec.text_embeddings,
        _sizes(targets, data, job.video),
        job.text_tensors,
        job.latent_tensors + (("loss_mask",) if data.masked else ()),
        job.extra_captions,
    )
    mine = chunks_of_rank(
        _chunks(entries, job.chunk_entries), group, _text_group(run, job, group, entries, verify_only), run.rank
    )
    if verify_only:
        counts = _verify_share(folder, mine)
    else:
        if job.video:  # with the clips' sound where the model trains on it
            dataset = VideoCaptionDataset(data, targets, job.seed, model.sound_rate)
        else:
            dataset = ImageCaptionDataset(data, targets, job.seed)
        by_id = {r.sample_id: r for r in records}
        counts = _build_share(model, dataset, by_id, folder, mine, data.resolution, bool(job.latent_settings))
    agree_or_stop(run, monitored_barrier(run, cache_spec.barrier_timeout_minutes))
    missing = (
        {} if verify_only else {e.name: p for e in entries if (p := entry_problem(folder / e.relpath, e, full=False))}
    )
    reports = all_gather_object((str(folder), tuple(group), counts, missing))
    seconds = time.perf_counter() - started  # the same on every rank: the barrier waited for the slowest
    return _conclude(run, data, folder, entries, reports, unreadable, verify_only, seconds)


def _conclude(run, data: DataSpec, folder, entries, reports, unreadable, verify_only, seconds):
    per_folder: dict[tuple, list] = {}
    for folder_text, group, counts, missing in reports:
        slot = per_folder.setdefault((folder_text, group), [0, 0, {}])
        slot[0] += counts["built"]
        slot[1] += counts["cached"]
        slot[2].update(counts["failed"])
        slot[2].update({name: f"{why} after the build" for name, why in missing.items() if name not in slot[2]})
    folder_reports = [(f, g, b, c, failed) for (f, g), (b, c, failed) in per_folder.items()]
    text, failures = _summary(folder_reports, len(entries), unreadable, verify_only, seconds)
    usable = sum(b + c for _, _, b, c, _ in folder_reports)
    bad_names = set(unreadable) | {name for *_, failed in folder_reports for name in failed}
    failed = {e.sample_id for e in entries if e.kind == "latent" and e.name in bad_names} | set(unreadable)
    failed_samples = {target_of(sample_id) for sample_id in failed}  # a bad reference: its target
    only_bad_images = all(e.kind == "latent" for e in entries if e.name in bad_names) and not any(
        "after the build" in why or "checksum" in why for *_, failed in folder_reports for why in failed.values()
    )
    code = 0
    if failures:
        listing = "\n".join(failures[:20]) + (f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else "")
        text += f"\nfailed:\n{listing}"
        if verify_only or not (data.skip_bad_files and only_bad_images):
            code = 1
    if not verify_only and (not entries or usable == 0):
        text += "\nnothing could be cached: every entry failed (see above). Fix the data or the encoders."
        code = 1
    if run.is_main:
        print(text, file=sys.stderr if code else sys.stdout, flush=True)
    if code:
        if run.is_main and not verify_only:
            print("the cache is incomplete: stopped before training.", file=sys.stderr, flush=True)
        return None, code
    return _index(folder, entries, data.cache, failed_samples), 0


def offload_frozen(model, index: CacheIndex) -> list[str]:
    """Move the encoders the cache replaces off the accelerator (kept in host memory for sampling): the model's
    latent parts (the VAE, an image encoder whose embeddings are stored beside the latents, a sound encoder) with
    cached latents, every other frozen part (the text encoders) with cached text."""
    moved = []
    latent_parts = model.latent_parts()
    for name, module in model.frozen.items():
        cached = index.latents if name in latent_parts else index.text
        if cached and model.device.type != "cpu":
            module.to("cpu")
            moved.append(name)
    return moved


@contextmanager
def frozen_on_device(model, moved: list[str]):
    """Bring offloaded encoders back to the device for the duration (sampling), then off again."""
    for name in moved:
        model.frozen[name].to(model.device)
    try:
        yield
    finally:
        for name in moved:
            model.frozen[name].to("cpu")
        if moved and torch.cuda.is_available():
            torch.cuda.empty_cache()
