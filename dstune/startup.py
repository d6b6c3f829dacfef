"""What every rank does before step 1, shared by training and `dstune cache` / `train.py --cache-only`.

    folders = resolve_model_folders(run, spec)       rank 0 first (a built-in model is made once), then the rest
    model = load_trained_model(run, spec, folders=folders)      its card's class, loaded on every rank
    records = checked_records(run, spec, model.modality)     the dataset's samples, unreadable files named on every rank
    caches = prepare_caches(run, spec, model, records)       build (or verify) what data.cache asks for
    loader, sampler = make_training_loader(spec, plan, run.rank, model, records, caches, epoch, step)

Whether a run reads a cache, and which, is decided here and only here (`Caches`): the data layer knows nothing of
caches and the cache layer nothing of the spec as a whole. Every failure that can differ between ranks is agreed
on (dstune.distributed.agree_or_stop) before the next collective, so all ranks stop together with one message.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from dstune.cache.codec_tokens import prepare_codec_cache, verify_codec_cache
from dstune.cache.datasets import CachedDataset, CachedSpeechDataset, CachedVideoDataset, collate_cached
from dstune.cache.latents import CacheIndex, LatentCacheJob, offload_frozen, prepare_cache
from dstune.cache.share import cache_folder
from dstune.checkpoints.layout import STATE_FILE
from dstune.card import CAUSAL_4X, ClipRule
from dstune.data.audio import SpeechDataset, collate_speech, reference_clips, speech_records
from dstune.data.audio_index import duration_keys, speaker_keys
from dstune.data.clips import index_clips, is_grouped, read_header
from dstune.data.images import find_bad_images
from dstune.data.index import DataError, index_dataset, list_samples
from dstune.data.loader import build_loader, make_loader
from dstune.data.video import VideoCaptionDataset, collate_video, find_bad_clips
from dstune.distributed import (
    device_memory_bytes,
    Run,
    agree_or_stop,
    all_gather_object,
    init_run,
    launcher_rank,
    rank0_first,
    shutdown,
    stop,
)
from dstune.ds_json.fill_spec import merged_spec
from dstune.engine import PRECISION_DTYPES, place_trainable
from dstune.families import card_of, get_facts
from dstune.families.lora import apply_train_mode
from dstune.families.speakers import SpeakersRefused, resumed_map_problem, voices_for
from dstune.memory.working import MAX_CHUNK_ENTRIES
from dstune.model_defaults import with_model_defaults
from dstune.pretrained import build_model, partitioned_build_config, resolve_folders, resolve_pretrained
from dstune.spec.load import SpecError, load_spec
from dstune.spec.models import Spec
from dstune.validate import plan_memory, validate_spec
from dstune.text_once import (
    drop_text_encoders,
    once_per_node,
    report_text_ranks,
    sample_captions,
    text_encoders_here,
)

BAD_FILES_LISTED = 20  # unreadable files named one per line; the rest counted


@dataclass
class Caches:
    """The caches a run reads: the latent/text index (image families), the codec-token entries (tts_lm), and the
    frozen encoders moved off the accelerator because a cache replaces them (brought back for sampling)."""

    images: Optional[CacheIndex] = None
    codec_paths: Optional[dict[str, Path]] = None
    offloaded: list[str] = field(default_factory=list)


def resolve_model_folders(run: Run, spec: Spec) -> dict:
    """The model's folders on every rank, rank 0 first: a built-in model is made once into the cache, a single
    checkpoint file converted once; then the other ranks find them there."""
    folders, error = rank0_first(run, lambda: resolve_folders(spec.model, spec.output.cache_dir))
    agree_or_stop(run, error and f"model.pretrained {spec.model.pretrained!r}: {error}")
    return folders


def model_card(run: Run, spec: Spec, folder: Path):
    """The card of the model `folder` holds (dstune.families.card_of), the same verdict on every rank."""
    card, error = None, None
    try:
        card = card_of(spec.model.family, folder)
    except (ValueError, OSError) as err:
        error = str(err)
    agree_or_stop(run, error and f"model.pretrained {spec.model.pretrained!r}: {error}")
    return card


def load_trained_model(
    run: Run, spec: Spec, train_mode: bool = True, ds_config: Optional[dict] = None, folders: Optional[dict] = None
):
    """The model (its card's class, loaded) on this rank's device; with train_mode, made trainable as model.train
    says (LoRA adapters added before DeepSpeed sees the module). The trainable module is loaded in host memory and
    reaches the device only in its training dtype, after a quantized base is quantized (engine.place_trainable).
    `folders` from resolve_model_folders (resolved here when not given). Under ZeRO-3 (`ds_config`), a model whose
    card says so builds its trainable module partitioned, all ranks together."""
    folders = folders if folders is not None else resolve_model_folders(run, spec)
    card = model_card(run, spec, folders["pretrained"])
    frozen_dtype = PRECISION_DTYPES[spec.train.precision][1]
    zero3_config = partitioned_build_config(spec.model, ds_config) if train_mode else None
    model, error = None, None
    here = text_encoders_here(run, once_per_node(spec, card))  # with the text cache: a rank a node
    try:  # collective under ZeRO-3 (zero.Init), so every rank builds at once
        model = build_model(
            spec.model, spec.output.cache_dir, run.device, frozen_dtype, zero3_config, folders, text_encoders=here
        )
    except (ValueError, OSError) as err:
        error = str(err)
    agree_or_stop(run, error and f"model.pretrained {spec.model.pretrained!r}: {error}")
    report_text_ranks(run, here)
    if zero3_config is not None and run.is_main:
        params = list(model.trainable.parameters())
        mine, total = sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params)
        print(
            f"loading: {type(model.trainable).__name__} built partitioned (ZeRO-3, deepspeed.zero.Init): "
            f"{mine:,} of its {total:,} parameters on this rank",
            flush=True,
        )
    if not train_mode:
        place_trainable(model.trainable, run.device, spec.train.precision)
        return model
    summary, error = None, None
    # an int8 base under ZeRO-3: quantized into Int8Linear layers on the host, then partitioned from the host
    zero3 = int((ds_config or {}).get("zero_optimization", {}).get("stage", 0)) == 3
    int8_zero3 = getattr(spec.model, "base_precision", None) == "int8" and zero3
    # a base stored in 1-byte integers (the int8 base, a quantized file's layers) is partitioned from host memory
    quantized_zero3 = zero3 and (int8_zero3 or bool(getattr(spec.model, "transformer_file", None)))
    partitioned_dtype = PRECISION_DTYPES[spec.train.precision][0] if int8_zero3 else None
    try:  # on the host: a quantized base reaches the device quantized, layer by layer
        summary = apply_train_mode(
            model, spec.model, spec.train.seed, spec.output.lora_format, run.device, partitioned_dtype
        )
    except ValueError as err:
        error = str(err)
    agree_or_stop(run, error)
    # cast on the host, then moved (or partitioned: a quantized base under ZeRO-3)
    place_trainable(model.trainable, run.device, spec.train.precision, ds_config if quantized_zero3 else None)
    if run.is_main:
        print(summary, flush=True)
    _attach_sampling_denoiser(run, spec, model, folders)
    return model


def _attach_sampling_denoiser(run: Run, spec: Spec, model, folders: dict) -> None:
    """sample.pretrained (or, with model.training_adapter, the base folder without it): the transformer the samples
    render with the trained LoRA on it, loaded beside the trained one (families/flow_distilled.py)."""
    adapter = getattr(spec.model, "training_adapter", None)
    if not spec.sample.prompts or not (spec.sample.pretrained or adapter):
        return
    key = "sample.pretrained" if spec.sample.pretrained else "model.pretrained"
    if not model.samples_with_another_denoiser:
        stop(run, f"{key}: {model.card.name} cannot sample with another transformer than the trained one", 1)
    folder, error = (
        rank0_first(run, lambda: resolve_pretrained(spec.sample.pretrained, spec.output.cache_dir, key))
        if spec.sample.pretrained
        else (folders["pretrained"], None)
    )
    agree_or_stop(run, error)
    try:
        model.attach_sampling_denoiser(folder, spec.model, key)
    except (ValueError, OSError) as err:
        error = str(err)
    agree_or_stop(run, error)
    if run.is_main:
        print(
            f"samples: {folder}'s transformer with the trained LoRA"
            + (" (the training adapter left out)" if adapter else ""),
            flush=True,
        )


def checked_records(run: Run, spec: Spec, modality: str, sound_rate: Optional[int] = None) -> list:
    """The dataset's samples (the same index `validate` counted, so the plan's numbers hold), checked before
    step 1: speech clips were filtered by the length rules; image files are opened, each rank a share.

    Bad image files stop the run with their names, or with data.skip_bad_files are counted and replaced at load
    time by the next readable sample, so the plan (and every number validate printed) stays the same."""
    data = spec.data
    if modality == "audio":
        try:
            records, warnings = speech_records(data)
        except DataError as err:
            stop(run, str(err), 1)
        if run.is_main and warnings:
            print("data: " + "\ndata: ".join(warnings), flush=True)
        return records
    if modality == "video":
        return _checked_clips(run, spec, sound_rate)
    records = list_samples(data)
    mine = [(r.sample_id, reason) for r, reason in find_bad_images(records, run.rank, run.world_size)]
    bad = [item for share in all_gather_object(mine) for item in share]
    if bad:
        listing = "\n".join(f"  {sample_id}: {reason}" for sample_id, reason in bad[:BAD_FILES_LISTED])
        more = f"\n  ... and {len(bad) - BAD_FILES_LISTED} more" if len(bad) > BAD_FILES_LISTED else ""
        if not data.skip_bad_files:
            stop(
                run,
                f"data.path: {len(bad)} unreadable image(s):\n{listing}{more}\nFix or remove them, or set "
                "data.skip_bad_files: true to train without them.",
                1,
            )
        if run.is_main:
            print(
                f"data: {len(bad)} unreadable image(s) skipped (each replaced by the next readable sample):\n"
                f"{listing}{more}",
                flush=True,
            )
    return records


def give_voices(model, records: list) -> None:
    """A model conditioned on a voice per speaker gets each speaker's first reference clips of the data (the same on
    every rank and every resume: the records' order)."""
    if model.voice_references:
        model.take_voices(reference_clips(records, model.voice_references, model.sample_rate))


def _checked_clips(run: Run, spec: Spec, sound_rate: Optional[int] = None) -> list:
    """A video family's clips (dstune.data.clips.index_clips: what `validate` counted), every video decoded (each
    rank a share of the files; with `sound_rate`, the rate of a model that trains on sound, its sound track too)
    before step 1: one message names every video that is too short, cannot be read or cannot be decoded; without
    grouped batches a micro batch cannot mix stills with clips."""
    data = spec.data
    try:
        clips = index_clips(data)
    except DataError as err:
        stop(run, str(err), 1)
    mine = [reason for _, reason in find_bad_clips(clips.records, data, run.rank, run.world_size, sound_rate)]
    bad = clips.problems + [item for share in all_gather_object(mine) for item in share]
    if bad:
        listing = "\n".join(f"  {reason}" for reason in bad[:BAD_FILES_LISTED])
        more = f"\n  ... and {len(bad) - BAD_FILES_LISTED} more" if len(bad) > BAD_FILES_LISTED else ""
        stop(
            run,
            f"data.path: {len(bad)} unusable video(s):\n{listing}{more}\nFix or remove them (video "
            "datasets are checked whole before step 1; data.skip_bad_files does not apply to them).",
            1,
        )
    unresampled = not all(one.video.fps for one in data.set_specs())  # a set whose files keep their own rates
    if sound_rate and unresampled and (spec.train.micro_batch_size or 1) > 1:
        _one_frame_rate(run, clips.records)
    lengths = sorted({record.frames for record in clips.records})
    if len(lengths) > 1 and not is_grouped(data) and (spec.train.micro_batch_size or 1) > 1:
        stop(
            run,
            f"data.path mixes still images (one-frame clips) with {lengths[-1]}-frame videos, which "
            "cannot share a micro batch: set train.micro_batch_size: 1 (with gradient accumulation for the "
            "global batch), turn on data.buckets (every global batch then comes from one frame count), or "
            "train the stills and the videos separately.",
            1,
        )
    return clips.records


def _one_frame_rate(run: Run, records: list) -> None:
    """A model that trains on sound takes frames / fps seconds of each clip's track: clips of one micro batch at
    different frame rates carry tracks of different lengths, which cannot be stacked. Without data.video.fps every
    file keeps its own rate, so the run stops here, before step 1, when the files' rates differ (the headers were
    read for the clip index; built-in clips have no file and share one rate)."""
    rates = sorted({read_header(record.image_path).fps for record in records if record.image_path})
    if len(rates) > 1:
        shown = ", ".join(f"{rate:g}" for rate in rates[:6]) + (" ..." if len(rates) > 6 else "")
        stop(
            run,
            f"data.path: the videos have {len(rates)} frame rates ({shown} fps), and the model trains on each clip's "
            "sound, frames / fps seconds of it: clips of one micro batch would carry sound tracks of different "
            "lengths. Set data.video.fps (e.g. 24) so that every clip is resampled to one rate, or "
            "train.micro_batch_size: 1.",
            1,
        )


def hear_speakers(run: Run, spec: Spec, model, records: list, resumed: Optional[Path] = None) -> None:
    """A speech model is given how to hear the data's speakers (`model.voices`: the map validate printed, from the
    same rule); a refusal validate could not make (its configs were not here), or a resumed checkpoint (`resumed`,
    its folder) trained with another map, stops every rank with the reason."""
    if model.modality != "audio":
        return
    error = None
    try:
        speakers, texts = [r.speaker for r in records], [r.caption for r in records]
        model.voices = voices_for(model.card, spec.model, spec.data.speakers, speakers, texts)
    except SpeakersRefused as err:
        error = f"{err.key}: {err.message}"
    if error is None and resumed is not None:
        saved = json.loads((resumed / STATE_FILE).read_text()).get("speakers")
        error = resumed_map_problem(saved, model.voices, f"checkpoint {resumed}")
    agree_or_stop(run, error)


def held_out_records(run: Run, spec: Spec) -> list:
    """data.eval's samples (index_dataset's `held_out`; none without data.eval), their images opened on every rank
    like the training images: a bad one stops the run, or with data.skip_bad_files is replaced when read."""
    if spec.data.eval is None:
        return []
    records = index_dataset(spec.data).held_out
    mine = [(r.sample_id, reason) for r, reason in find_bad_images(records, run.rank, run.world_size)]
    bad = [item for share in all_gather_object(mine) for item in share]
    if bad and not spec.data.skip_bad_files:
        listing = "\n".join(f"  {sample_id}: {reason}" for sample_id, reason in bad[:BAD_FILES_LISTED])
        stop(
            run,
            f"data.eval: {len(bad)} unreadable held-out image(s):\n{listing}\nFix or remove them, or set "
            "data.skip_bad_files: true.",
            1,
        )
    return records


# what tiled latents are keyed by (model.vae_tiling): the VAE's own enable_tiling() (diffusers' tiles and overlap)
VAE_TILING_KEY = "enable_tiling defaults"


def agreed_entries(run: Run, encoding: Optional[dict]) -> int:
    """Collective. The entries per encoder pass every rank uses: the fewest any rank's plan chose (for its GPU's
    memory), so that every rank deals the same chunks."""
    return min(all_gather_object(encoding["entries_per_pass"] if encoding else MAX_CHUNK_ENTRIES))


def _latent_job(run: Run, spec: Spec, card, model_folder: Path, once: bool, tiled: bool = False) -> LatentCacheJob:
    """What the latent/text cache build needs (the model's card: a pipeline model's; the spec refuses these caches
    for the others); `once`: the text encoders load once per node (dstune.text_once); `tiled`: the VAE encodes
    through its tiled encode (its latents are keyed apart: they differ from untiled ones)."""
    text = spec.data.cache.text_embeddings
    refusal = card.text_cache_refusal(model_folder) if text else None
    if refusal:
        stop(run, refusal, 1)
    folder = cache_folder(spec.data.cache.dir, spec.output.cache_dir, run.rank, run.node_rank)
    latent_settings, latent_folders, latent_tensors = card.latent_cache_key(spec.model, model_folder)
    return LatentCacheJob(
        spec.data,
        folder,
        model_folder,
        tuple(card.text_cache_folders),
        tuple(card.text_tensors) if text else (),
        card.text_cache_settings(spec.model),
        spec.train.seed,
        PRECISION_DTYPES[spec.train.precision][1],
        video=get_facts(card.family).modality == "video",
        latent_settings=latent_settings,
        latent_folders=tuple(latent_folders),
        latent_tensors=tuple(latent_tensors),
        vae_tiling=VAE_TILING_KEY if tiled else "",
        text_here=text_encoders_here(run, once),
        extra_captions=sample_captions(spec, card) if once else (),
    )


def prepare_caches(
    run: Run,
    spec: Spec,
    model,
    records: list,
    verify_only: bool = False,
    card=None,
    model_folder: Optional[Path] = None,
    encoding: Optional[dict] = None,
) -> tuple[Caches, int]:
    """Collective. Build (or fully verify) every cache entry the run reads: (caches, 0), or (caches, 1) after rank 0
    printed what is missing. `model` may be None when verifying latents (`card` and `model_folder`: the pretrained
    folder's). `encoding`: the memory plan's cache_encoding (entries per encoder pass, chosen for this GPU's memory
    by dstune.memory.verdict.choose_encoding); None: the most entries. With model.vae_tiling the VAE tiles from here
    on (the cache's encode, a run's encode without the cache, the samples' decode)."""
    cache = spec.data.cache
    caches = Caches()
    entries = agreed_entries(run, encoding)
    tiled = bool(getattr(spec.model, "vae_tiling", False))
    if tiled and getattr(model, "vae", None) is not None:  # the cache's encode, the step's and the samples' decode
        model.vae.enable_tiling()
    if cache.codec_tokens:
        folder = cache_folder(cache.dir, spec.output.cache_dir, run.rank, run.node_rank)
        if verify_only:
            complete, text = verify_codec_cache(run, folder, model, records)
            caches.codec_paths = {} if complete else None
        else:
            caches.codec_paths, text = prepare_codec_cache(run, cache, folder, model, records)
        if run.is_main:
            print(text, file=sys.stdout if caches.codec_paths is not None else sys.stderr, flush=True)
        return caches, 0 if caches.codec_paths is not None else 1
    if cache.latents or cache.text_embeddings:  # the summary is printed by prepare_cache
        card = card if model is None else model.card
        once = once_per_node(spec, card)
        job = _latent_job(run, spec, card, model_folder if model is None else model.folder, once, tiled)
        job = replace(job, chunk_entries=entries)
        caches.images, code = prepare_cache(run, job, model, records, verify_only)
        if code == 0 and model is not None:
            if once:  # no rank reads a text encoder from here on
                drop_text_encoders(model, caches.images, job.extra_captions)
            caches.offloaded = offload_frozen(model, caches.images)
        return caches, code
    return caches, 0


def loader_clip_rule(spec: Spec, model) -> ClipRule:
    """The rule a clip's latent frames follow: a video model's own (by its VAE), which the loader and the batch check
    both hold clips to; the causal 4x rule for the other modalities, whose batches hold no clips."""
    return model.clip_rule() if get_facts(spec.model.family).modality == "video" else CAUSAL_4X


def make_training_loader(
    spec: Spec, plan, rank: int, model, records: list, caches: Caches, start_epoch: int, start_step: int
):
    """This rank's loader and sampler: one factory (dstune.data.loader.make_loader) over the dataset kind the
    model's modality and the caches decide. `model` (the rate of a speech model's clips, of a video model's sound)
    may be None for images."""
    data, seed = spec.data, spec.train.seed
    modality = get_facts(spec.model.family).modality
    if modality == "audio":
        keys = duration_keys(records, data)
        speakers = speaker_keys(records, data)
        if caches.codec_paths is not None:
            dataset = CachedSpeechDataset(records, caches.codec_paths)
            return make_loader(
                dataset, dataset.collate, keys, data, plan, rank, seed, start_epoch, start_step, speakers
            )
        dataset = SpeechDataset(records, model.sample_rate)
        return make_loader(dataset, collate_speech, keys, data, plan, rank, seed, start_epoch, start_step, speakers)
    if modality == "video":
        if caches.images is not None:
            dataset, collate = CachedVideoDataset(data, records, seed, caches.images, model.sound_rate), collate_cached
        else:  # the sound too, where the model trains on it
            dataset, collate = VideoCaptionDataset(data, records, seed, model.sound_rate), collate_video
        keys, rule = dataset.group_keys(), loader_clip_rule(spec, model)
        return make_loader(dataset, collate, keys, data, plan, rank, seed, start_epoch, start_step, clip_rule=rule)
    if caches.images is not None:
        dataset = CachedDataset(data, records, seed, caches.images)
        return make_loader(
            dataset,
            collate_cached,
            dataset.group_keys(),
            data,
            plan,
            rank,
            seed,
            start_epoch,
            start_step,
            sets=dataset.set_numbers(),
            set_places=dataset.set_places(),
        )
    return build_loader(data, plan, rank, seed, records, start_epoch, start_step)


# ------------------------------------------------------------------------------------- `dstune cache` command


def load_spec_or_report(spec_path: str, overrides: list[str]) -> Optional[Spec]:
    """The spec, or None after rank 0 printed why it is invalid (every rank reads the same file: same verdict)."""
    try:
        spec, source = merged_spec(*load_spec(spec_path, overrides))  # precision may come from deepspeed.config
        for warning in source.warnings if launcher_rank() == 0 else ():  # an ambiguous relative path
            print(f"warning: {warning}", file=sys.stderr)
        return with_model_defaults(spec)[0]  # data.resolution, sample.guidance left out: the model's, as in training
    except SpecError as err:
        if launcher_rank() == 0:
            print(f"invalid spec:\n{err}", file=sys.stderr)
        return None


def _cache_command_encoding(run: Run, spec_path: str, overrides: list[str]) -> Optional[dict]:
    """The cache's entries per encoder pass the memory plan chooses for this GPU (as a training run's start-up
    does); None (the most) on the CPU accelerator or where the run cannot be planned for this world."""
    if device_memory_bytes(run) is None:
        return None
    try:
        spec, source = merged_spec(*load_spec(spec_path, overrides))
        resolved = validate_spec(spec, source, run.world, accelerator=run.accelerator)
    except SpecError:
        return None
    memory = plan_memory(
        resolved.spec,
        resolved.plan,
        resolved.ds_config,
        device_memory_bytes(run),
        accelerator=run.accelerator,
        clips=resolved.clips,
    )
    return memory.get("cache_encoding")


def run_cache_command(spec_path: str, overrides: list[str], verify_only: bool) -> int:
    """`dstune cache SPEC [--verify]` (one process) and `train.py SPEC --cache-only` (under the launcher): build
    (or fully check, checksums included) every entry data.cache asks for, the ranks sharing the work."""
    spec = load_spec_or_report(spec_path, overrides)
    if spec is None:
        return 1
    cache = spec.data.cache
    if not (cache.latents or cache.text_embeddings or cache.codec_tokens):
        if launcher_rank() == 0:
            print(
                f"{spec_path}: data.cache: nothing to cache. Set data.cache.latents: true and/or "
                "data.cache.text_embeddings: true (images), or data.cache.codec_tokens: true (tts_lm).",
                file=sys.stderr,
            )
        return 1
    run = init_run(spec.deepspeed.timeout_minutes)
    try:
        modality = get_facts(spec.model.family).modality
        records = checked_records(run, spec, modality)
        if verify_only and modality in ("image", "video"):  # latents are checked against the folder: no encoders
            folder, error = None, None
            try:
                folder = resolve_pretrained(spec.model.pretrained, spec.output.cache_dir)
            except (ValueError, OSError) as err:
                error = f"model.pretrained {spec.model.pretrained!r}: {err}"
            agree_or_stop(run, error)
            card = model_card(run, spec, folder)
            return prepare_caches(run, spec, None, records, verify_only=True, card=card, model_folder=folder)[1]
        model = load_trained_model(run, spec, train_mode=False)
        encoding = _cache_command_encoding(run, spec_path, overrides)
        return prepare_caches(run, spec, model, records, verify_only, encoding=encoding)[1]
    finally:
        shutdown()
