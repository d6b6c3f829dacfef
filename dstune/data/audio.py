"""Speech data for the audio families: decode, resample to the model's rate, the torch Dataset, collate, loader.

Clips are decoded with soundfile (mixed down to mono) and resampled with a band-limited FFT resampler (numpy only,
deterministic, the same on every rank) to the rate the family asks for (the codec's). The dataset returns whole
clips: a family turns a batch into what its model needs (codec tokens, mel frames) and pads there.

Batching: a fixed micro batch of utterances (the plan's micro_batch_size), like the image families, so the plan,
the DeepSpeed batch triad and the batch checker need nothing new. With data.duration_bucket_seconds every global
batch comes from one duration bucket (dstune.data.groups, the core the aspect buckets use), so a micro batch holds
clips of similar length and padding stays small. (The alternative, a token budget per micro batch with DeepSpeed
micro batch 1 as CosyVoice does, makes samples per step vary, which the LR arithmetic, the resume position and the
batch checker would all have to learn; not done.)

The records come from dstune.data.audio_index, where the length rules and bad-file rules were already applied.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dstune.data.audio_index import AudioRecord, TONES_SAMPLE_RATE, duration_keys, index_audio, render_tones
from dstune.data.index import DataError
from dstune.spec.models import DataSpec


def resample(wave: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Band-limited resampling by zero-padding / truncating the spectrum (what scipy.signal.resample does)."""
    if from_rate == to_rate:
        return wave.astype(np.float32, copy=False)
    length = max(1, round(len(wave) * to_rate / from_rate))
    spectrum = np.fft.rfft(wave.astype(np.float64))
    bins = length // 2 + 1
    if bins <= len(spectrum):
        spectrum = spectrum[:bins]
    else:
        spectrum = np.concatenate([spectrum, np.zeros(bins - len(spectrum), dtype=spectrum.dtype)])
    return (np.fft.irfft(spectrum, n=length) * (length / len(wave))).astype(np.float32)


def load_clip(record: AudioRecord, sample_rate: int) -> np.ndarray:
    """The clip as float32 mono at `sample_rate`; DataError naming the file when it cannot be decoded."""
    if record.audio_path is None:
        return resample(render_tones(record.caption), TONES_SAMPLE_RATE, sample_rate)
    import soundfile

    try:
        wave, rate = soundfile.read(record.audio_path, dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as err:
        raise DataError("data.path", f"audio {record.audio_path} cannot be decoded ({str(err).splitlines()[0]})") from None
    return resample(wave.mean(axis=1), rate, sample_rate)


class SpeechDataset(Dataset):
    """records -> {"index", "sample_id", "audio" (float32 1-D tensor at sample_rate), "text", "speaker"}."""

    def __init__(self, records: list[AudioRecord], sample_rate: int):
        self.records = [r for r in records for _ in range(r.repeats)]
        self.sample_rate = sample_rate
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # the loader calls it; clips have no per-epoch randomness
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        return {"index": index, "sample_id": record.sample_id, "audio": torch.from_numpy(load_clip(record, self.sample_rate)),
                "text": record.caption, "speaker": record.speaker}


def collate_speech(samples: list[dict]) -> dict:
    """Clips stay a list (their lengths differ); the family pads what it derives from them."""
    return {"index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
            "sample_ids": [s["sample_id"] for s in samples], "audio": [s["audio"] for s in samples],
            "texts": [s["text"] for s in samples], "speakers": [s["speaker"] for s in samples]}


def speech_records(data: DataSpec) -> tuple[list[AudioRecord], list[str]]:
    """(records, warnings) for training: the same index `validate` counted, so the plan's numbers hold."""
    result = index_audio(data)
    return result.records, result.warnings


def build_speech_loader(data: DataSpec, plan, rank: int, seed: int, records: list[AudioRecord], sample_rate: int,
                        start_epoch: int = 0, start_step: int = 0, dataset: Dataset | None = None):
    """This rank's loader and sampler, positioned at (start_epoch, start_step). `dataset` replaces the decoding
    dataset (the codec-token cache); it must have the same indices."""
    from dstune.data.loader import EpochDataLoader, _one_thread_per_worker
    from dstune.data.sampler import GlobalBatchSampler

    dataset = dataset if dataset is not None else SpeechDataset(records, sample_rate)
    sampler = GlobalBatchSampler(len(dataset), plan, rank, seed, start_epoch, start_step,
                                 group_keys=duration_keys(records, data))
    loader = EpochDataLoader(
        dataset, batch_sampler=sampler, collate_fn=getattr(dataset, "collate", collate_speech),
        num_workers=data.num_workers, persistent_workers=False,
        worker_init_fn=_one_thread_per_worker if data.num_workers > 0 else None,
        generator=torch.Generator().manual_seed(seed))
    return loader, sampler


def speech_records_for_run(run, data: DataSpec) -> list[AudioRecord]:
    """Every rank indexes the clips (deterministic: all agree); rank 0 prints the skip counts; a bad dataset stops
    all ranks with its message."""
    from dstune.distributed import stop

    try:
        records, warnings = speech_records(data)
    except DataError as err:
        stop(run, str(err), 1)
    if run.is_main and warnings:
        print("data: " + "\ndata: ".join(warnings), flush=True)
    return records


def speech_training_loader(run, spec, plan, built, records: list[AudioRecord], start_epoch: int, start_step: int):
    """The loader training uses: from the codec-token cache with data.cache.codec_tokens (built first, on all
    ranks together), else decoding clips on the fly."""
    dataset = None
    if spec.data.cache.codec_tokens:
        from dstune.cache_audio import CachedSpeechDataset, prepare_codec_cache
        from dstune.distributed import stop

        paths, text = prepare_codec_cache(run, spec, built, records)
        if paths is None:
            stop(run, text, 1)
        if run.is_main:
            print(text, flush=True)
        dataset = CachedSpeechDataset(records, paths)
    return build_speech_loader(spec.data, plan, run.rank, spec.train.seed, records, built.sample_rate,
                               start_epoch, start_step, dataset)
