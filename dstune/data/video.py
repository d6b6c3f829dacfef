"""The video-caption torch Dataset of the video family: clips (3, frames, H, W) in [-1, 1].

A sample is a clip (dstune.data.clips.ClipRecord: its frame count, a sliding chunk's start, its bucket size) of a
video file (decoded with PyAV), a still image (a one-frame clip), or a built-in clip (builtin:moving-shapes;
builtin:shapes gives one-frame clips). Which frames a clip takes is dstune.data.clips.frame_positions: the file's
frames resampled to data.video.fps, then `head` the first ones, `uniform` spread over all, `sliding` the chunk's.
Every frame is resized and centre-cropped like an image (dstune.data.images.resize_and_crop) to data.resolution's
square, or with data.buckets to the clip's (width, height) bucket.

Sound (`sound_rate` given: the run's model trains on a clip's audio too): each sample also carries its clip's sound
track as float32 (2, frames / fps x sound_rate), stereo, cut to the clip's span (dstune.data.sound), and has_sound;
a clip whose file has no audio stream (a still image, builtin:moving-shapes) carries silence of its length and
has_sound False (its video is trained alone). fps: data.video.fps, else the file's own (24 for built-in clips and
still images). builtin:moving-shapes-av's clips are MP4 files
with sound, written in memory (dstune.data.synthetic) and read back through the same decoder. Sound needs the clip's
frames to be consecutive (`head` or `sliding`): `uniform` spreads them over the video, which the sound cannot follow.

Loss masks (data.mask_dir): a clip's mask image weights every frame, a mask video (its video's frame count and rate)
each frame with its own, chosen as the clip's frames are; cut as the frames are (`clip_mask`).

Bad files are found before step 1: `find_bad_clips` decodes this rank's share of the files (each once, as far as
its last clip needs) and names every video that cannot be decoded (the caller gathers all ranks' findings and stops
with one message); videos shorter than every frame count are named from their headers (dstune.data.clips).
"""

from __future__ import annotations

import dataclasses
import io
import operator

import numpy as np
import torch
from PIL import Image

from dstune.data.clips import (
    ClipRecord,
    as_clip,
    clip_key,
    clips_by_file,
    frame_positions,
    is_grouped,
    read_header,
    unusable,
    video_stream,
)
from dstune.data.buckets import header_size
from dstune.data.images import (
    BadSampleError,
    ImageCaptionDataset,
    collate_loss_terms,
    read_mask,
    resize_and_crop,
    sample_rng,
    to_tensor,
)
from dstune.data.clips import set_side, set_video
from dstune.data.index import SampleRecord, builtin_of, is_video_file
from dstune.data.pairs import is_reference
from dstune.data.sound import decode_sound
from dstune.data.synthetic import MOVING_SHAPES_AV_FPS, moving_shape_av_mp4, render_moving_shape, render_shape
from dstune.spec.models import DataSpec


def frame_count(path, trust_header: bool = True) -> tuple[int, float]:
    """(frames, frames per second) of the video (a path or a file object): the container's stated count, or with trust_header=False (or when
    it states none) the frames actually decoded, without converting any."""
    import av

    with av.open(path) as container:
        stream, rate = video_stream(container)
        if trust_header and stream.frames > 0:
            return int(stream.frames), rate
        return sum(1 for _ in container.decode(stream)), rate


def decode_frames(path, positions: list[int]) -> list:
    """The frames of the video (a path or a file object) at `positions` (0-based, repeats allowed) as RGB PIL images, decoding no further than the last;
    ValueError when the video ends (or breaks) before it."""
    import av

    wanted, images, decoded = set(positions), {}, 0
    with av.open(path) as container:
        stream, _ = video_stream(container)
        for number, frame in enumerate(container.decode(stream)):
            decoded = number + 1
            if number in wanted:
                images[number] = frame.to_image().convert("RGB")
            if number >= max(wanted):
                break
    if len(images) < len(wanted):
        raise ValueError(f"only {decoded} frames could be decoded, frame {max(wanted)} is needed")
    return [images[p] for p in positions]


def read_video(record: SampleRecord, video) -> list:
    """The chosen frames (data.video: `video`) of the record's clip as RGB PIL images, decoding only as far as the
    last of them (a long video is not decoded whole for its first frames); BadSampleError naming the file and why it
    cannot be used. A plain record (not a ClipRecord) is one clip of data.video's largest count from the start."""
    frames, start = (record.frames, record.start) if isinstance(record, ClipRecord) else (max(video.frame_counts), 0)

    def chosen(trust_header: bool) -> list:
        count, rate = frame_count(record.image_path, trust_header)
        return decode_frames(record.image_path, frame_positions(count, rate, frames, video.sampling, video.fps, start))

    try:
        try:
            return chosen(trust_header=True)
        except ValueError as err:
            if str(err).startswith("only "):  # the header overstated the frames: count them and choose again
                return chosen(trust_header=False)
            raise
    except (OSError, ValueError) as err:  # PyAV's errors (InvalidDataError, ...) are OSError/ValueError subclasses
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise BadSampleError(unusable(record, reason), record.image_path) from None


def clip_tensor(images: list, resolution) -> torch.Tensor:
    """Frames -> float32 (3, frames, H, W) in [-1, 1], each resized and centre-cropped to `resolution`."""
    return torch.stack([to_tensor(resize_and_crop(image, resolution, 0.5, 0.5, False)) for image in images], dim=1)


class VideoCaptionDataset(ImageCaptionDataset):
    """Clips with captions; the same expanded-index, epoch and caption-dropout rules as the image dataset. Records
    are dstune.data.clips.ClipRecords (plain records become one clip each: dstune.data.clips.as_clip)."""

    def __init__(self, data: DataSpec, records: list[SampleRecord], seed: int, sound_rate: int | None = None):
        super().__init__(data, [as_clip(record, data) for record in records], seed)
        if sound_rate and any(one.video.sampling == "uniform" and one.video.max_frames > 1 for one in data.set_specs()):
            raise ValueError(
                "data.video.sampling uniform spreads a clip's frames over the whole video, so the clip's sound "
                "(which this model trains on) cannot follow them; use head or sliding"
            )
        self.sound_rate = sound_rate  # Hz of the sound each sample carries; None: no sound is read

    def bucket_of_records(self) -> list | None:
        """With data.buckets (here or in a set): each clip's (width, height), chosen from its header by
        dstune.data.clips (its set's square where the set has no buckets)."""
        if not any(one.buckets.enabled for one in self.data.set_specs()):
            return None
        return [record.size or (set_side(self.data, record.set_index),) * 2 for record in self.records]

    def group_keys(self) -> list | None:
        """(frames, width, height) of every index when batches are grouped (dstune.data.clips.is_grouped)."""
        if not is_grouped(self.data):
            return None
        return [clip_key(record, self.data) for record in self.records for _ in range(record.repeats)]

    def clip_images(self, record: ClipRecord) -> list:
        """The record's frames as RGB PIL images: a video's chosen frames, a still image alone (the image dataset's
        loader), or the built-in clip. BadSampleError naming the file and why it cannot be used."""
        if record.image_path is None:
            name, number, side = (
                builtin_of(record.sample_id),
                int(record.sample_id.rsplit("/", 1)[1]),
                self.side(record),
            )
            if name == "moving-shapes-av":
                return decode_frames(io.BytesIO(self._builtin_mp4(record)), list(range(record.frames)))
            if name == "moving-shapes":
                return render_moving_shape(number, side, record.frames)[0]
            return [render_shape(number, side)[0]]
        if not is_video_file(record.image_path):
            return [self.load_image(record, record.size or self.side(record))]
        return read_video(record, self.video_of(record))

    def video_of(self, record: ClipRecord):
        """data.video of the record's set (data.sets.N.video, else data's)."""
        return set_video(self.data, record.set_index)

    def side(self, record: ClipRecord) -> int:
        """data.resolution of the record's set: the square a clip without a bucket trains at."""
        return set_side(self.data, record.set_index)

    def _builtin_mp4(self, record: ClipRecord) -> bytes:
        fps = self.video_of(record).fps or MOVING_SHAPES_AV_FPS
        return moving_shape_av_mp4(int(record.sample_id.rsplit("/", 1)[1]), self.side(record), record.frames, fps)

    def clip_sound(self, record: ClipRecord) -> tuple[torch.Tensor, bool]:
        """The clip's sound at self.sound_rate: float32 (2, samples) over the clip's span and True, or silence of
        the clip's length and False without an audio stream. BadSampleError naming the file and why it cannot be
        used."""
        try:
            if record.image_path is not None and is_video_file(record.image_path):
                fps = float(self.video_of(record).fps or read_header(record.image_path).fps)
                source = record.image_path
            else:  # a built-in clip (one with sound: an MP4 made in memory) or a still image
                fps = float(self.video_of(record).fps or MOVING_SHAPES_AV_FPS)
                heard = record.image_path is None and builtin_of(record.sample_id) == "moving-shapes-av"
                source = io.BytesIO(self._builtin_mp4(record)) if heard else None
            sound = decode_sound(source, self.sound_rate, record.start / fps, record.frames / fps) if source else None
        except (OSError, ValueError) as err:
            reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
            raise BadSampleError(unusable(record, f"its sound track: {reason}"), record.image_path) from None
        if sound is None:
            return torch.zeros(2, int(round(record.frames / fps * self.sound_rate))), False
        return torch.from_numpy(sound), True

    def load_clip(self, record: ClipRecord) -> torch.Tensor:
        return clip_tensor(self.clip_images(record), record.size or self.side(record))

    def cache_pixels(self, record: ClipRecord, size, flip: bool) -> torch.Tensor:
        """The clip at its size (random_flip is refused for video: the one centre crop); a reference's record
        (dstune.data.index.control_records): its reference clip, read as training reads it."""
        if is_reference(record.sample_id):
            return self.reference_clip(record)
        return self.load_clip(record)

    def clip_mask(self, record: ClipRecord) -> torch.Tensor:
        """The clip's loss mask, float32 (1, frames, H, W) in [0, 1], cut as its frames are (resized to the frames'
        size, then the same resize and centre crop): a mask image weights every frame alike, a mask video (of the
        video's frame count and rate) each frame with its own frame, chosen as the clip's are; ones without a
        mask. BadSampleError naming the mask and why it cannot be used."""
        size = record.size or self.side(record)
        width, height = (size, size) if isinstance(size, int) else size
        if record.mask_path is None:
            return torch.ones(1, record.frames, height, width)
        clip = record.image_path is not None and is_video_file(record.image_path)
        shown = (read_header(record.image_path).width, read_header(record.image_path).height) if clip else None
        if is_video_file(record.mask_path):
            images = self._mask_video_frames(record, clip)
        else:
            images = [read_mask(record, alpha=False)] * record.frames
        shown = shown or header_size(record.image_path)
        frames = []
        for image in images:
            image = image.convert("L")
            if image.size != shown:  # a mask of another size: stretched over the frame, as an image's mask is
                image = image.resize(shown, Image.Resampling.BILINEAR)
            cut = resize_and_crop(image, size, 0.5, 0.5, False)
            frames.append(torch.from_numpy(np.asarray(cut, dtype=np.float32) / 255.0))
        return torch.stack(frames).unsqueeze(0)

    def _mask_video_frames(self, record: ClipRecord, clip: bool) -> list:
        """A mask video's frames at the clip's positions; it must match its video frame for frame."""

        def refuse(reason: str):
            raise BadSampleError(
                f"cannot use the loss mask {record.mask_path} (of sample {record.sample_id}): {reason}. Give a mask "
                "image (every frame alike) or a mask video with its video's frames.",
                record.mask_path,
            )

        if not clip:
            refuse("a mask video belongs to a video, and this sample is a still image")
        try:
            mask, video = read_header(record.mask_path), read_header(record.image_path)
        except (OSError, ValueError) as err:
            refuse(getattr(err, "strerror", None) or str(err) or type(err).__name__)
        if (mask.frames, round(mask.fps, 3)) != (video.frames, round(video.fps, 3)):
            refuse(f"it has {mask.frames} frames at {mask.fps:g} fps, its video {video.frames} at {video.fps:g} fps")
        return read_video(dataclasses.replace(record, image_path=record.mask_path), self.video_of(record))

    def cache_mask(self, record: ClipRecord, size, flip: bool) -> torch.Tensor | None:
        """What the latent cache stores beside the clip's latents (at the latent grid): its mask, None unmasked."""
        return self.clip_mask(record) if self.masked else None

    def __getitem__(self, index: int) -> dict:
        index = operator.index(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range 0..{len(self) - 1}")
        _, dropout_draw, _, _ = sample_rng(self.seed, self.epoch, index).random(4)  # the image dataset's draws
        record = self.record_at(index)
        sample = {
            "pixel_values": self.load_clip(record),
            "caption": self.caption_of(record, dropout_draw),
            "sample_id": record.sample_id,
            "index": index,
            **self.set_fields(record),
        }
        if self.masked:
            sample["loss_mask"] = self.clip_mask(record)
        if self.sound_rate:
            sample["sound"], sample["has_sound"] = self.clip_sound(record)
        if record.control_path is not None:
            sample["control_values"] = self.reference_clip(record)
            if self.sound_rate:  # the reference's own sound track, where it has one (audio-to-audio)
                reference = dataclasses.replace(record, image_path=record.control_path, mask_path=None)
                sample["control_sound"], sample["control_has_sound"] = self.clip_sound(reference)
        return sample

    def reference_clip(self, record: ClipRecord) -> torch.Tensor:
        """The sample's reference (data.control_dir: in-context control), (3, frames, H, W) in [-1, 1] like its clip: a
        video's frames chosen as the clip's are (the same positions, so of the same length and rate as its video),
        or an image on every frame, at the clip's size."""
        reference = dataclasses.replace(record, image_path=record.control_path, mask_path=None)
        if is_video_file(record.control_path):
            images = read_video(reference, self.video_of(record))  # BadSampleError naming the reference
        else:
            images = [self.load_image(reference, record.size or self.side(record))] * record.frames
        return clip_tensor(images, record.size or self.side(record))


def collate_video(samples: list[dict]) -> dict:
    """pixel_values (B, 3, frames, H, W); caption and sample_id lists; index (B,). With sound read: sound
    (B, 2, samples), silence where a clip has none, and has_sound (B,) saying which clips have it. Masked runs:
    loss_mask (B, 1, frames, H, W); data.sets: loss_weight, prior, preserve (B,)."""
    batch = {
        **collate_loss_terms(samples),
        "pixel_values": torch.stack([s["pixel_values"] for s in samples]),
        "caption": [s["caption"] for s in samples],
        "sample_id": [s["sample_id"] for s in samples],
        "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
    }
    if "control_values" in samples[0]:  # in-context control's reference clips (and their sound, where read)
        batch["control_values"] = torch.stack([s["control_values"] for s in samples])
    if "control_sound" in samples[0]:
        batch["control_sound"] = torch.stack([s["control_sound"] for s in samples])
        batch["control_has_sound"] = torch.tensor([s["control_has_sound"] for s in samples], dtype=torch.bool)
    return {**batch, **stack_sounds(samples)}


def stack_sounds(samples: list[dict]) -> dict:
    """The samples' sound (B, 2, samples) (silence where a clip has none) and has_sound (B,); nothing when the
    samples carry no sound (the model trains on none)."""
    if "sound" not in samples[0]:
        return {}
    if len({s["sound"].shape for s in samples}) > 1:
        lengths = ", ".join(f"{s['sample_id']}: {s['sound'].shape[1]}" for s in samples)
        raise ValueError(
            f"the clips of one batch have sound tracks of different lengths ({lengths} samples): their "
            "frame rates differ. Set data.video.fps, so that every clip lasts frames / fps seconds."
        )
    return {
        "sound": torch.stack([s["sound"] for s in samples]),
        "has_sound": torch.tensor([bool(s["has_sound"]) for s in samples]),
    }


def find_bad_clips(
    records: list[SampleRecord], data: DataSpec, rank: int = 0, world_size: int = 1, sound_rate: int | None = None
) -> list[tuple[SampleRecord, str]]:
    """(record, reason) for each file of this rank's share of the files (every world_size-th, in dataset order)
    that cannot give its clips: a video is decoded once, as far as its last clip needs (every frame before it
    passes through the decoder; with `sound_rate`, the model's, its sound track too; in a masked run its mask too),
    images are opened. Gather all ranks' results."""
    files = list(clips_by_file([as_clip(record, data) for record in records]).values())[rank::world_size]
    if not files:
        return []
    bad, reader = [], VideoCaptionDataset(data, [clips[0] for clips in files], 0, sound_rate)
    for clips in files:
        last = max(clips, key=lambda clip: clip.start + clip.frames)
        try:
            reader.clip_images(last)
            if reader.masked:  # its mask (a mask video is decoded as far as the clip's last frame)
                reader.clip_mask(last)
            if sound_rate:
                reader.clip_sound(last)
        except BadSampleError as err:
            bad.append((clips[0], err.message))
    return bad
