"""Clips: the samples of a video dataset once data.video has chosen their frames. Torch-free: `dstune validate`
counts them, and training's loader trains them, through `index_clips`, so the plan and the loader agree.

A video file's header (PyAV: frame count, frame rate, width, height; no pixel decoded unless the header states no
frame count, then the frames are counted by decoding) decides its clips:
  - resampling: the file's frames at data.video.fps (each output frame takes the source frame nearest its time);
  - the clip length: the largest of data.video.frames (a count, or a list of counts: frame-count buckets) that the
    resampled video can fill; a video shorter than the smallest count cannot be used, and is named;
  - which frames: `head` the first ones, `uniform` spread over the whole video (one clip per file), `sliding`
    every chunk of that length starting each data.video.stride frames (default: the length), so a long video
    gives several clips, each a sample of its own with its own index and id (`a.mp4#2`: chunk 2, which starts at
    resampled frame 2 x stride);
  - with data.buckets: the (width, height) bucket nearest the video's aspect ratio (dstune.data.buckets).
Still images are one-frame clips (their size from the image header); built-in clips are rendered square.

Groups: with data.buckets, or more than one frame count, every clip has the key (frames, width, height) and every
global batch comes from one key (dstune.data.groups), so every micro batch of a step stacks clips of one shape.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

from dstune.card import CAUSAL_4X, ClipRule
from dstune.data.buckets import bucket_sizes, header_size, nearest_bucket
from dstune.data.index import (
    DataError,
    SampleRecord,
    index_dataset,
    is_builtin_clip,
    is_builtin_clip_with_sound,
    is_video_file,
)

TEMPORAL_COMPRESSION = 4  # the video VAEs: the first frame, then 4 frames per latent frame (frames are 4k+1)
CHUNK_SEPARATOR = "#"  # a sliding chunk's sample id: the file's id, "#", the chunk number
PROGRESS_SECONDS = 5.0  # reading many headers: a line on stderr at most this often
_headers: dict = {}  # (path, mtime, size) -> VideoHeader: validate and the loader of one process read each once


@dataclass(frozen=True)
class ClipRecord(SampleRecord):
    frames: int = 1  # frames of this clip (its frame-count bucket)
    start: int = 0  # sliding: the chunk's first frame in the resampled timeline; 0 for head and uniform
    size: tuple[int, int] | None = None  # (width, height) with data.buckets; None: data.resolution's square
    sound: bool = False  # its file has a sound track (the header's audio stream; built-in: moving-shapes-av)


@dataclass(frozen=True)
class VideoHeader:
    frames: int  # frames the file holds (stated by the header, or counted by decoding)
    fps: float
    width: int
    height: int
    counted: bool = False  # True: the header stated no frame count, so the frames were decoded to count them
    audio: bool = False  # the file has an audio stream (a sound track)


@dataclass(frozen=True)
class ClipIndex:
    records: list[ClipRecord]  # in dataset order: a file's chunks follow each other
    problems: list[str] = field(default_factory=list)  # one self-contained line per video that gives no clip
    warnings: list[str] = field(default_factory=list)
    files: int = 0  # video files read
    counted: int = 0  # of them, headers that stated no frame count (frames counted by decoding)

    @property
    def with_sound(self) -> int:
        """Clips (repeats counted) whose file has a sound track."""
        return sum(record.repeats for record in self.records if record.sound)

    @property
    def num_samples(self) -> int:
        return sum(r.repeats for r in self.records)


def resampled_count(available: int, source_fps: float, fps=None) -> int:
    """Frames a video of `available` frames at `source_fps` has at data.video.fps (`fps`; None: its own rate)."""
    return available if fps is None else int(available * float(fps) / source_fps + 1e-9)


def frame_positions(
    available: int, source_fps: float, frames: int, sampling: str, fps=None, start: int = 0
) -> list[int]:
    """Which source frames (0-based) make a clip of `frames`, from a video of `available` frames at `source_fps`;
    `start`: a sliding chunk's first frame in the resampled timeline. ValueError saying how many frames the video
    has at the chosen rate when it is too short."""
    rate = float(fps or source_fps)
    resampled = resampled_count(available, source_fps, fps)
    nearest = lambda x: int(x + 0.5)  # noqa: E731 - round() would round halves to even
    timeline = [min(available - 1, nearest(k * source_fps / rate)) for k in range(resampled)]
    if resampled < start + frames:
        at = (
            f"{resampled} frames at {rate:g} fps ({available} at the file's {source_fps:g} fps)"
            if fps
            else f"{available} frames"
        )
        need = f"frames {start}..{start + frames - 1} (chunk of {frames})" if start else f"data.video.frames {frames}"
        raise ValueError(f"it has {at}, fewer than {need}")
    if sampling in ("head", "sliding") or frames == 1:
        return timeline[start : start + frames]
    return [timeline[nearest(i * (resampled - 1) / (frames - 1))] for i in range(frames)]


def chunk_starts(resampled: int, frames: int, sampling: str, stride=None) -> list[int]:
    """The first resampled frame of every clip a video of `resampled` frames gives at `frames` per clip."""
    if sampling != "sliding":
        return [0]
    return list(range(0, resampled - frames + 1, stride or frames))


def clip_length(resampled: int, counts: Sequence[int]) -> int | None:
    """The largest frame count a video of `resampled` frames fills, or None when it is shorter than all."""
    fitting = [count for count in counts if count <= resampled]
    return max(fitting) if fitting else None


def video_stream(container):
    """The first video stream of an opened PyAV container and its average frame rate; ValueError when there is none
    or it states no rate."""
    if not container.streams.video:
        raise ValueError("the file has no video stream")
    stream = container.streams.video[0]
    rate = float(stream.average_rate or stream.guessed_rate or 0)
    if not rate:
        raise ValueError("the video stream states no frame rate")
    return stream, rate


def read_header(path: str) -> VideoHeader:
    """The video's frame count, rate and size from its container header (decoding only to count frames when the
    header states none). Remembered per process by (path, mtime, size). OSError / ValueError (PyAV's errors are
    subclasses) when the file cannot be opened or has no video stream."""
    import av

    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _headers:
        with av.open(path) as container:
            stream, rate = video_stream(container)
            width, height = stream.codec_context.width, stream.codec_context.height
            counted = not stream.frames > 0
            audio = bool(container.streams.audio)
            frames = sum(1 for _ in container.decode(stream)) if counted else int(stream.frames)
        _headers[key] = VideoHeader(frames, rate, width, height, counted, audio)
    return _headers[key]


def unusable(record: SampleRecord, reason: str) -> str:
    """The one line that names a video which gives no clip (validate and startup print the same line)."""
    return (
        f"cannot use video {record.image_path} (sample {record.sample_id}): {reason}. Replace or delete the file, "
        "or change data.video (frames, fps)."
    )


def _video_clips(record: SampleRecord, data, sizes) -> tuple[list[ClipRecord], VideoHeader]:
    """The clips of one video file; ValueError / OSError saying why it gives none."""
    video = data.video
    header = read_header(record.image_path)
    resampled = resampled_count(header.frames, header.fps, video.fps)
    frames = clip_length(resampled, video.frame_counts)
    if frames is None:  # frame_positions words the shortfall
        frame_positions(header.frames, header.fps, video.frame_counts[0], video.sampling, video.fps)
    size = nearest_bucket(header.width, header.height, sizes) if sizes else None
    starts = chunk_starts(resampled, frames, video.sampling, video.stride)
    base = dict(
        sample_id=record.sample_id,
        image_path=record.image_path,
        caption=record.caption,
        repeats=record.repeats,
        mask_path=record.mask_path,
        set_index=record.set_index,
        control_paths=record.control_paths,  # a video model's reference clip (in-context control)
        frames=frames,
        size=size,
        sound=header.audio,
    )
    if video.sampling != "sliding":
        return [ClipRecord(**base)], header
    return [
        ClipRecord(**{**base, "sample_id": f"{record.sample_id}{CHUNK_SEPARATOR}{number}"}, start=start)
        for number, start in enumerate(starts)
    ], header


def _other_clip(record: SampleRecord, data, sizes) -> ClipRecord:
    """A still image (a one-frame clip, its bucket from the image header) or a built-in clip (rendered square)."""
    base = dict(
        sample_id=record.sample_id,
        image_path=record.image_path,
        caption=record.caption,
        repeats=record.repeats,
        mask_path=record.mask_path,
        set_index=record.set_index,
        control_paths=record.control_paths,
    )
    if record.image_path is None:
        moving = is_builtin_clip(record.sample_id)
        return ClipRecord(
            **base,
            frames=data.video.max_frames if moving else 1,
            size=nearest_bucket(1, 1, sizes) if sizes else None,
            sound=is_builtin_clip_with_sound(record.sample_id),
        )
    size = nearest_bucket(*header_size(record.image_path), sizes) if sizes else None
    return ClipRecord(**base, frames=1, size=size)


def index_clips(data, read_captions: bool = True, show_progress: bool = False) -> ClipIndex:
    """The clips of a video family's dataset (see the module docstring), with one line per video that gives none
    (`problems`: unreadable, or shorter than the smallest frame count). DataError for an unusable dataset (as
    dstune.data.index.index_dataset), or a still image whose header cannot be read."""
    index = index_dataset(data, read_captions=read_captions, video=True)
    specs = data.set_specs()  # data.sets: each set's own frames, resolution and buckets; else [data]
    set_sizes = [bucket_sizes(one) if one.buckets.enabled else None for one in specs]
    videos = [r for r in index.records if r.image_path is not None and is_video_file(r.image_path)]
    records, problems, counted, read = [], [], 0, 0
    started = shown = time.monotonic()
    for record in index.records:
        if record.image_path is None or not is_video_file(record.image_path):
            try:
                records.append(_other_clip(record, specs[record.set_index], set_sizes[record.set_index]))
            except (OSError, ValueError, SyntaxError) as err:
                raise DataError(
                    "data.path",
                    f"cannot read the size of image {record.image_path} (sample "
                    f"{record.sample_id}): {err}. Replace or delete the file.",
                ) from None
            continue
        try:
            clips, header = _video_clips(record, specs[record.set_index], set_sizes[record.set_index])
        except (OSError, ValueError) as err:
            problems.append(unusable(record, getattr(err, "strerror", None) or str(err) or type(err).__name__))
            continue
        records += clips
        counted, read = counted + header.counted, read + 1
        if show_progress and time.monotonic() - shown > PROGRESS_SECONDS:
            shown = time.monotonic()
            print(
                f"data.path: read {read + len(problems)} of {len(videos)} video headers "
                f"({time.monotonic() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return ClipIndex(records, problems, list(index.warnings), len(videos), counted)


def as_clip(record: SampleRecord, data) -> ClipRecord:
    """A record that did not come from index_clips (a plain index record): one clip of data.video's largest count
    from the start of the file, at data.resolution (its header is not read)."""
    if isinstance(record, ClipRecord):
        return record
    fields = {
        name: getattr(record, name)
        for name in ("sample_id", "image_path", "caption", "repeats", "mask_path", "set_index", "control_paths")
    }
    if record.image_path is None:
        still = not is_builtin_clip(record.sample_id)  # builtin:shapes renders one-frame clips
    else:
        still = not is_video_file(record.image_path)
    return ClipRecord(**fields, frames=1 if still else set_video(data, record.set_index).max_frames)


def set_video(data, number: int):
    """data.video of set `number` (data.sets.N.video, else data's)."""
    own = data.sets[number].video if data.sets is not None else None
    return own or data.video


def set_side(data, number: int) -> int:
    """data.resolution of set `number` (data.sets.N.resolution, else data's)."""
    own = data.sets[number].resolution if data.sets is not None else None
    return own or data.resolution


def is_grouped(data) -> bool:
    """Whether every global batch must come from one (frames, width, height) group: with data.buckets, or with
    more than one frame count, or with data.sets whose clips have other frame counts or sizes."""
    specs = data.set_specs()
    if any(one.buckets.enabled or len(one.video.frame_counts) > 1 for one in specs):
        return True
    return len({(one.resolution, one.video.max_frames) for one in specs}) > 1


def clip_key(record: ClipRecord, data) -> tuple[int, int, int]:
    """(frames, width, height) the clip trains at."""
    side = set_side(data, record.set_index)
    width, height = record.size or (side, side)
    return (record.frames, width, height)


def key_order(key: tuple[int, int, int]):
    """Display order of clip keys: frames, then aspect ratio (as image buckets), then width."""
    return (key[0], key[1] / key[2], key[1])


def clip_counts(records: Sequence[ClipRecord], data) -> dict[tuple[int, int, int], int]:
    """{(frames, width, height): clips, repeats included}, in display order."""
    counts: dict = {}
    for record in records:
        counts[clip_key(record, data)] = counts.get(clip_key(record, data), 0) + record.repeats
    return {key: counts[key] for key in sorted(counts, key=key_order)}


def latent_tokens(key: tuple[int, int, int], spatial: int, patch: Sequence[int], rule: ClipRule = CAUSAL_4X) -> int:
    """Transformer tokens of one clip: latent frames (the model's clip rule: 1 + (frames - 1) / 4 for a causal VAE
    4x in time) x latent height x width, divided by the patch (t, h, w): with a 4x VAE and 1x2x2 patches
    (1 + (frames - 1) / 4) x (H / 16) x (W / 16)."""
    frames, width, height = key
    latent_frames = rule.latent_frames(frames)
    return (latent_frames // patch[0]) * (height // spatial // patch[1]) * (width // spatial // patch[2])


def clips_by_file(records: Sequence[ClipRecord]) -> dict[str, list[ClipRecord]]:
    """File path -> its clips (a sliding video's chunks together), in dataset order; built-in clips left out."""
    files: dict[str, list[ClipRecord]] = {}
    for record in records:
        if record.image_path is not None:
            files.setdefault(record.image_path, []).append(record)
    return files
