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
from torch.utils.data import Dataset

from dstune.data.audio_index import AudioRecord, index_audio
from dstune.data.synthetic import TONES_SAMPLE_RATE, render_tones
from dstune.resampling import resample  # noqa: F401 - also this module's API (the built-ins resample with it)
from dstune.data.index import DataError
from dstune.spec.models import DataSpec


def load_clip(record: AudioRecord, sample_rate: int) -> np.ndarray:
    """The clip as float32 mono at `sample_rate`; DataError naming the file when it cannot be decoded."""
    if record.audio_path is None:
        return resample(render_tones(record.caption), TONES_SAMPLE_RATE, sample_rate)
    import soundfile

    try:
        wave, rate = soundfile.read(record.audio_path, dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as err:
        raise DataError(
            "data.path", f"audio {record.audio_path} cannot be decoded ({str(err).splitlines()[0]})"
        ) from None
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
        return {
            "index": index,
            "sample_id": record.sample_id,
            "audio": torch.from_numpy(load_clip(record, self.sample_rate)),
            "text": record.caption,
            "speaker": record.speaker,
        }


def collate_speech(samples: list[dict]) -> dict:
    """Clips stay a list (their lengths differ); the family pads what it derives from them."""
    return {
        "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
        "sample_ids": [s["sample_id"] for s in samples],
        "audio": [s["audio"] for s in samples],
        "texts": [s["text"] for s in samples],
        "speakers": [s["speaker"] for s in samples],
    }


def reference_clips(records: list[AudioRecord], per_speaker: int, sample_rate: int) -> dict[str, list]:
    """Each speaker's first `per_speaker` clips in the records' order (clips that name no speaker are one voice,
    ""): speaker -> [(sample id, float32 wave at sample_rate)], for a model conditioned on a voice per speaker."""
    chosen: dict[str, list[AudioRecord]] = {}
    for record in records:
        clips = chosen.setdefault(record.speaker, [])
        if len(clips) < per_speaker:
            clips.append(record)
    return {speaker: [(r.sample_id, load_clip(r, sample_rate)) for r in clips] for speaker, clips in chosen.items()}


def speech_records(data: DataSpec) -> tuple[list[AudioRecord], list[str]]:
    """(records, warnings) for training: the same index `validate` counted, so the plan's numbers hold."""
    result = index_audio(data)
    return result.records, result.warnings
