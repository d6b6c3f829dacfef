"""The speech dataset index: which clips exist, their text, speaker and duration. No torch, no audio decoding.

`dstune validate` counts clips through this module: it lists files and reads only audio headers (soundfile's
`info`), so it knows every clip's duration and can apply the length rules before training, with counts.

Layouts (the audio families):
  - ljspeech: `metadata.csv` with `id|text|normalized` lines (normalized may be missing or empty: then `text`),
    the audio in `wavs/<id>.wav`.
  - jsonl: `metadata.jsonl`, one `{"audio": "rel/path.wav", "text": ..., "speaker": optional}` per line.
  - gptsovits: a GPT-SoVITS annotation list, `metadata.list` (or data.path naming a `.list` file), lines
    `audio path|speaker|language|text`; the path is absolute or relative to the list's folder.
  - f5csv: F5-TTS's `metadata.csv` with the header `audio_file|text`, then `audio path|text` lines (paths as above).
  - builtin:tones: synthetic "speech": the text is a digit string, the audio one tone per digit (its pitch is the
    digit), rendered on the fly from the sample number. Small enough that a CPU run shows the loss falling.

Length rules: a clip shorter than data.min_clip_seconds or longer than data.max_clip_seconds is left out by rule
(not an error); how many, and which, is reported as a warning by `validate` and at the start of training.
Speech rate: a clip whose transcript has more than MAX_SPEECH_RATE letters and digits a second cannot hold it (a WAV
cut short behind an intact header) and is refused with every such file named (left out with data.skip_bad_files);
clips of several seconds with almost no text are named in a warning. Missing and unreadable files are all named
at once too.
Length grouping (data.duration_bucket_seconds): clip i's group key is its bucket's lower edge in seconds, used by the
shared grouped-batching core (dstune.data.groups) exactly as image aspect buckets are.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


from dstune.data.index import DataError, IndexResult, builtin_name
from dstune.data.synthetic import TONES_NUM_SAMPLES, tones_duration, tones_text
from dstune.plan import group_counts, key_label
from dstune.spec.models import DataSpec
from dstune.spec.section import BUILTIN_PREFIX

LJSPEECH_METADATA = "metadata.csv"
JSONL_METADATA = "metadata.jsonl"
GPTSOVITS_METADATA = "metadata.list"
F5_HEADER = "audio_file|text"
_EXAMPLES = 3
LISTED = 20  # files named one per line in an error; the rest counted
# Letters and digits of the transcript per second of audio: speech has about 10 to 20 (fast speech 25). Above
# MAX_SPEECH_RATE a clip cannot hold its text (refused); below MIN_SPEECH_RATE over SLOW_CHECK_SECONDS or more it
# holds almost none (warned).
MAX_SPEECH_RATE = 100
MIN_SPEECH_RATE = 0.5
SLOW_CHECK_SECONDS = 2.0


@dataclass(frozen=True)
class AudioRecord:
    sample_id: str  # path relative to the dataset root (posix), or "tones/000123"
    audio_path: str | None  # None for built-in clips, which are rendered rather than read
    caption: str  # the text spoken (named like the image records' field so shared code reads both)
    speaker: str  # "" when the data names none
    duration_seconds: float
    repeats: int = 1


# ------------------------------------------------------------------------------------------------------- index


def index_audio(data: DataSpec) -> IndexResult:
    """Every usable clip in a deterministic order, with warnings (length-rule and bad-file counts). Raises DataError
    for an unusable dataset or, without data.skip_bad_files, a missing or unreadable audio file."""
    name = builtin_name(data.path)
    if name is not None:
        if name != "tones":
            raise DataError(
                "data.path", f"unknown built-in speech dataset '{data.path}'. Known: {BUILTIN_PREFIX}tones."
            )
        records = [_tones_record(i) for i in range(TONES_NUM_SAMPLES)]
        return _apply_length_rules(records, data, [], [])
    given = Path(os.path.expanduser(data.path))
    if given.is_file() and given.suffix == ".list":
        root, rows = given.parent, _gptsovits_rows(given)
    elif given.is_dir():
        root, layout = given, _layout(given, data.format)
        rows = {
            "ljspeech": _ljspeech_rows,
            "jsonl": _jsonl_rows,
            "f5csv": _f5_rows,
            "gptsovits": lambda folder: _gptsovits_rows(folder / GPTSOVITS_METADATA),
        }[layout](root)
    else:
        raise DataError(
            "data.path",
            f"{data.path} is neither a folder nor a .list file. Give a speech dataset folder "
            f"(LJSpeech: {LJSPEECH_METADATA} + wavs/; {JSONL_METADATA}; {GPTSOVITS_METADATA}; F5-TTS's "
            f"{LJSPEECH_METADATA} headed {F5_HEADER}), a GPT-SoVITS .list file, or {BUILTIN_PREFIX}tones.",
        )
    records, problems, warnings = [], [], []
    for where, rel, text, speaker in rows:
        record, problem = _record(root, where, rel, text, speaker)
        if problem is None:
            records.append(record)
        else:
            problems.append(problem)
    if problems and not data.skip_bad_files:  # every one named at once, as images and videos are
        raise DataError(
            "data.path",
            f"{len(problems)} clip(s) missing or unreadable:{_listing(problems)}\nFix or remove them, or set "
            "data.skip_bad_files: true to leave such clips out.",
        )
    if problems:
        warnings.append(
            f"{len(problems)} clip(s) missing or unreadable and left out (data.skip_bad_files): "
            f"{'; '.join(problems[:_EXAMPLES])}"
        )
    result = _apply_length_rules(records, data, warnings, problems)
    return _apply_speech_rate(result, data)


def _listing(lines: list[str]) -> str:
    """Lines as an indented list, at most LISTED of them, the rest counted."""
    shown = "".join(f"\n  {line}" for line in lines[:LISTED])
    return shown + (f"\n  ... and {len(lines) - LISTED} more" if len(lines) > LISTED else "")


def speech_rate(record: AudioRecord) -> float:
    """The transcript's letters and digits per second of the clip (speech: about 10 to 20)."""
    return sum(character.isalnum() for character in record.caption) / max(record.duration_seconds, 1e-9)


def _apply_speech_rate(result: IndexResult, data: DataSpec) -> IndexResult:
    """Clips too short for their transcript (a file cut short behind an intact header reads as a few milliseconds
    carrying a sentence) are refused with their names, or left out with data.skip_bad_files; clips of several
    seconds with almost no text (silence, music, a wrong line) are named in a warning."""
    too_fast = [r for r in result.records if speech_rate(r) > MAX_SPEECH_RATE]
    fast_ids = {r.sample_id for r in too_fast}
    too_slow = [
        r for r in result.records if r.duration_seconds >= SLOW_CHECK_SECONDS and speech_rate(r) < MIN_SPEECH_RATE
    ]

    def described(record: AudioRecord) -> str:
        letters = sum(character.isalnum() for character in record.caption)
        return (
            f"{record.audio_path or record.sample_id}: {record.duration_seconds:.3g} s for {letters} letters and "
            f"digits ({speech_rate(record):.{0 if speech_rate(record) >= 100 else 2}f} a second) of "
            f"{record.caption[:40]!r}"
        )

    if too_fast and not data.skip_bad_files:
        raise DataError(
            "data.path",
            f"{len(too_fast)} clip(s) are too short for their transcript (more than {MAX_SPEECH_RATE} letters "
            f"and digits a second; speech has about 10 to 20):{_listing([described(r) for r in too_fast])}\n"
            "A file cut short keeps its header's promise of a whole sentence: replace the audio, or fix its line, "
            "or set data.skip_bad_files: true to leave such clips out.",
        )
    warnings, skipped = list(result.warnings), list(result.skipped)
    if too_fast:
        warnings.append(
            f"{len(too_fast)} clip(s) too short for their transcript left out (data.skip_bad_files): "
            f"{'; '.join(described(r) for r in too_fast[:_EXAMPLES])}"
        )
        skipped += [f"{described(r)}: too short for its transcript" for r in too_fast]
    if too_slow:
        warnings.append(
            f"{len(too_slow)} clip(s) of {SLOW_CHECK_SECONDS:g} s or more hold fewer than {MIN_SPEECH_RATE:g} "
            f"letters and digits a second of transcript (silence, music or another clip's line?); they train as "
            f"they are:{_listing([described(r) for r in too_slow])}"
        )
    kept = [r for r in result.records if r.sample_id not in fast_ids]
    if not kept:
        raise DataError("data.path", f"no clips left in {data.path}: every clip is too short for its transcript.")
    return IndexResult(kept, warnings, skipped)


def _tones_record(index: int) -> AudioRecord:
    text = tones_text(index)
    return AudioRecord(f"tones/{index:06d}", None, text, "", tones_duration(text))


def _layout(root: Path, fmt: str) -> str:
    csv_path = root / LJSPEECH_METADATA
    f5 = csv_path.is_file() and _first_line(csv_path) == F5_HEADER
    has = {
        "ljspeech": csv_path.is_file() and not f5,
        "f5csv": f5,
        "jsonl": (root / JSONL_METADATA).is_file(),
        "gptsovits": (root / GPTSOVITS_METADATA).is_file(),
    }
    wanted = {
        "ljspeech": LJSPEECH_METADATA,
        "f5csv": f"{LJSPEECH_METADATA} starting with the line {F5_HEADER}",
        "jsonl": JSONL_METADATA,
        "gptsovits": GPTSOVITS_METADATA,
    }
    if fmt in has:
        if not has[fmt]:
            raise DataError(
                "data.format",
                f"format '{fmt}' needs {root / wanted[fmt].split(' ')[0]} ({wanted[fmt]}); there is none.",
            )
        return fmt
    if fmt == "auto" and any(has.values()):
        return next(name for name, present in has.items() if present)
    raise DataError(
        "data.path",
        f"{root} holds neither {LJSPEECH_METADATA} (LJSpeech: `id|text|normalized` lines, "
        f"audio in wavs/<id>.wav, or F5-TTS's with the header {F5_HEADER}), {JSONL_METADATA} (`audio`, "
        f"`text`, optional `speaker`) nor {GPTSOVITS_METADATA} (`path|speaker|language|text`).",
    )


def _first_line(path: Path) -> str:
    with open(path, encoding="utf-8-sig") as handle:
        return handle.readline().strip()


def _dataset_path(where: str, raw: str, what: str) -> str:
    """An audio path of a list line: absolute, or relative to the list's folder (never climbing out of it)."""
    path = PurePosixPath(raw.strip().replace("\\", "/"))
    if not raw.strip():
        raise DataError("data.path", f"{where}: the {what} field is empty")
    if not path.is_absolute() and ".." in path.parts:
        raise DataError(
            "data.path",
            f"{where}: audio {raw.strip()!r} climbs out of the list's folder; give an absolute path or one inside it",
        )
    return str(path)


def _gptsovits_rows(path: Path):
    """GPT-SoVITS's annotation list: `audio path|speaker|language|text` (the text may itself hold `|`)."""
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        fields = line.split("|", 3)
        if len(fields) < 4 or not fields[3].strip():
            raise DataError(
                "data.path",
                f"{where}: expected `audio path|speaker|language|text` (GPT-SoVITS .list), got {line.strip()[:120]!r}",
            )
        yield where, _dataset_path(where, fields[0], "audio path"), fields[3].strip(), fields[1].strip()


def _f5_rows(root: Path):
    """F5-TTS's metadata.csv: the header `audio_file|text`, then `audio path|text` lines."""
    path = root / LJSPEECH_METADATA
    lines = path.read_text(encoding="utf-8-sig").splitlines()
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        fields = line.split("|", 1)
        if len(fields) < 2 or not fields[1].strip():
            raise DataError(
                "data.path", f"{where}: expected `audio_file|text` (F5-TTS csv), got {line.strip()[:120]!r}"
            )
        yield where, _dataset_path(where, fields[0], "audio_file"), fields[1].strip(), ""


def _ljspeech_rows(root: Path):
    path = root / LJSPEECH_METADATA
    with open(path, encoding="utf-8", newline="") as handle:
        for number, fields in enumerate(csv.reader(handle, delimiter="|", quoting=csv.QUOTE_NONE), start=1):
            if not fields or not "".join(fields).strip():
                continue
            where = f"{path}:{number}"
            if len(fields) < 2 or not fields[0].strip():
                raise DataError(
                    "data.path",
                    f"{where}: expected `id|text|normalized` (at least `id|text`), got {'|'.join(fields)!r}",
                )
            text = fields[2] if len(fields) > 2 and fields[2].strip() else fields[1]
            yield where, f"wavs/{fields[0].strip()}.wav", text.strip(), ""


def _jsonl_rows(root: Path):
    path = root / JSONL_METADATA
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                "data.path",
                f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must "
                'be one object like {"audio": "wavs/a.wav", "text": "hello", "speaker": "s1"}',
            ) from None
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("audio"), str)
            or not isinstance(entry.get("text"), str)
        ):
            raise DataError(
                "data.path",
                f"{where}: needs string fields `audio` and `text` (optional `speaker`), got {line.strip()[:120]}",
            )
        rel = PurePosixPath(entry["audio"].replace("\\", "/"))
        if rel.is_absolute() or ".." in rel.parts:
            raise DataError("data.path", f"{where}: audio {entry['audio']!r} must be a path inside the dataset folder")
        yield where, str(rel), entry["text"].strip(), str(entry.get("speaker") or "")


def _record(root: Path, where: str, rel: str, text: str, speaker: str) -> tuple[AudioRecord | None, str | None]:
    import soundfile

    path = root / rel
    if not path.is_file():
        return None, f"{where}: audio {path} does not exist"
    try:
        info = soundfile.info(str(path))
    except (RuntimeError, soundfile.LibsndfileError) as err:
        return None, f"{where}: audio {path} cannot be read ({str(err).splitlines()[0]})"
    if info.frames <= 0 or info.samplerate <= 0:
        return None, f"{where}: audio {path} is empty"
    return AudioRecord(rel, str(path), text, speaker, info.frames / info.samplerate), None


def _apply_length_rules(
    records: list[AudioRecord], data: DataSpec, warnings: list[str], skipped: list[str]
) -> IndexResult:
    short = [r for r in records if r.duration_seconds < data.min_clip_seconds]
    long = [r for r in records if r.duration_seconds > data.max_clip_seconds]
    kept = [r for r in records if data.min_clip_seconds <= r.duration_seconds <= data.max_clip_seconds]
    for rule, clips, limit in (("shorter", short, data.min_clip_seconds), ("longer", long, data.max_clip_seconds)):
        if clips:
            examples = ", ".join(f"{r.sample_id} ({r.duration_seconds:.2f} s)" for r in clips[:_EXAMPLES])
            key = "min_clip_seconds" if rule == "shorter" else "max_clip_seconds"
            warnings.append(
                f"{len(clips)} of {len(records)} clips are {rule} than {limit:g} s and are skipped "
                f"(data.{key}): {examples}"
            )
            skipped += [f"{r.sample_id}: {r.duration_seconds:.2f} s, {rule} than data.{key}" for r in clips]
    if not kept:
        raise DataError(
            "data.path",
            f"no clips left in {data.path}: {len(records)} found, {len(short)} shorter than "
            f"data.min_clip_seconds {data.min_clip_seconds:g}, {len(long)} longer than "
            f"data.max_clip_seconds {data.max_clip_seconds:g}. Widen the limits.",
        )
    return IndexResult(kept, warnings, skipped)


# ---------------------------------------------------------------------------------------------- length groups


def speaker_keys(records: list[AudioRecord], data: DataSpec) -> list[str] | None:
    """One speaker per dataset index (repeats expanded, as duration_keys), or None without data.speaker_balance."""
    return [r.speaker for r in records for _ in range(r.repeats)] if data.speaker_balance else None


def duration_keys(records: list[AudioRecord], data: DataSpec) -> list[float] | None:
    """One group key per clip: the lower edge of its duration bucket in seconds (floor(duration / width) * width,
    shown as e.g. "0.5" in the plan), or None without grouping."""
    width = data.duration_bucket_seconds
    if width is None:
        return None
    return [round(math.floor(r.duration_seconds / width) * width, 6) for r in records for _ in range(r.repeats)]


def duration_groups(records: list[AudioRecord], data: DataSpec) -> dict | None:
    """{"bucket label": clips} for the plan (key_label of the int key), or None without grouping."""
    keys = duration_keys(records, data)
    if keys is None:
        return None
    return {key_label(k): n for k, n in group_counts(keys).items()}
