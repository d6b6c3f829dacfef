"""The video-caption torch Dataset of the video families (wan): clips (3, frames, H, W) in [-1, 1].

A sample is a video file (decoded with PyAV), a still image (a one-frame clip), or a built-in clip
(builtin:moving-shapes; builtin:shapes gives one-frame clips). Which frames a video gives is data.video's choice:
the file's frames are first resampled to data.video.fps (each output frame takes the source frame nearest its time),
then `head` takes the first `frames` of them and `uniform` spreads `frames` evenly over all of them. Every frame is
resized and centre-cropped like an image (dstune.data.images.resize_and_crop).

Bad files are found before step 1: `find_bad_clips` decodes this rank's share and names every video that cannot be
decoded or is shorter than data.video.frames (the caller gathers all ranks' findings and stops with one message).
"""

from __future__ import annotations

import operator

import torch

from dstune.data.images import BadSampleError, ImageCaptionDataset, resize_and_crop, sample_rng, to_tensor
from dstune.data.index import SampleRecord, is_video_file
from dstune.data.synthetic import render_moving_shape, render_shape
from dstune.spec.models import DataSpec


def frame_positions(available: int, source_fps: float, frames: int, sampling: str, fps=None) -> list[int]:
    """Which source frames (0-based) make a clip of `frames`, from a video of `available` frames at `source_fps`.
    ValueError saying how many frames the video has at the chosen rate when it is too short."""
    rate = float(fps or source_fps)
    resampled = available if fps is None else int(available * rate / source_fps + 1e-9)
    nearest = lambda x: int(x + 0.5)  # noqa: E731 - round() would round halves to even
    timeline = [min(available - 1, nearest(k * source_fps / rate)) for k in range(resampled)]
    if resampled < frames:
        at = f"{resampled} frames at {rate:g} fps ({available} at the file's {source_fps:g} fps)" if fps else \
            f"{available} frames"
        raise ValueError(f"it has {at}, fewer than data.video.frames {frames}")
    if sampling == "head" or frames == 1:
        return timeline[:frames]
    return [timeline[nearest(i * (resampled - 1) / (frames - 1))] for i in range(frames)]


def _video_stream(container):
    """The first video stream and its average frame rate; ValueError when there is none or it states no rate."""
    if not container.streams.video:
        raise ValueError("the file has no video stream")
    stream = container.streams.video[0]
    rate = float(stream.average_rate or stream.guessed_rate or 0)
    if not rate:
        raise ValueError("the video stream states no frame rate")
    return stream, rate


def frame_count(path: str, trust_header: bool = True) -> tuple[int, float]:
    """(frames, frames per second) of the video: the container's stated count, or with trust_header=False (or when
    it states none) the frames actually decoded, without converting any."""
    import av

    with av.open(path) as container:
        stream, rate = _video_stream(container)
        if trust_header and stream.frames > 0:
            return int(stream.frames), rate
        return sum(1 for _ in container.decode(stream)), rate


def decode_frames(path: str, positions: list[int]) -> list:
    """The frames at `positions` (0-based, repeats allowed) as RGB PIL images, decoding no further than the last;
    ValueError when the video ends (or breaks) before it."""
    import av

    wanted, images, decoded = set(positions), {}, 0
    with av.open(path) as container:
        stream, _ = _video_stream(container)
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
    """The chosen frames (data.video: `video`) of the record's video file as RGB PIL images, decoding only as far as
    the last of them (a long video is not decoded whole for its first frames); BadSampleError naming the file and
    why it cannot be used."""
    def chosen(trust_header: bool) -> list:
        count, rate = frame_count(record.image_path, trust_header)
        return decode_frames(record.image_path, frame_positions(count, rate, video.frames, video.sampling, video.fps))

    try:
        try:
            return chosen(trust_header=True)
        except ValueError as err:
            if str(err).startswith("only "):  # the header overstated the frames: count them and choose again
                return chosen(trust_header=False)
            raise
    except (OSError, ValueError) as err:  # PyAV's errors (InvalidDataError, ...) are OSError/ValueError subclasses
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise BadSampleError(f"cannot use video {record.image_path} (sample {record.sample_id}): {reason}. Replace "
                             "or delete the file, or change data.video (frames, fps).", record.image_path) from None


def clip_tensor(images: list, resolution) -> torch.Tensor:
    """Frames -> float32 (3, frames, H, W) in [-1, 1], each resized and centre-cropped to `resolution`."""
    return torch.stack([to_tensor(resize_and_crop(image, resolution, 0.5, 0.5, False)) for image in images], dim=1)


class VideoCaptionDataset(ImageCaptionDataset):
    """Clips with captions; the same expanded-index, epoch and caption-dropout rules as the image dataset."""

    def clip_images(self, record: SampleRecord) -> list:
        """The record's frames as RGB PIL images: a video's chosen frames, a still image alone (the image dataset's
        loader), or the built-in clip. BadSampleError naming the file and why it cannot be used."""
        data = self.data
        if record.image_path is None:
            name, number = record.sample_id.rsplit("/", 1)
            if name == "moving-shapes":
                return render_moving_shape(int(number), data.resolution, data.video.frames)[0]
            return [render_shape(int(number), data.resolution)[0]]
        if not is_video_file(record.image_path):
            return [self.load_image(record)]
        return read_video(record, data.video)

    def load_clip(self, record: SampleRecord) -> torch.Tensor:
        return clip_tensor(self.clip_images(record), self.data.resolution)

    def cache_pixels(self, record: SampleRecord, size, flip: bool) -> torch.Tensor:
        return self.load_clip(record)  # data.buckets and random_flip are refused for video: the one centre crop

    def __getitem__(self, index: int) -> dict:
        index = operator.index(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range 0..{len(self) - 1}")
        _, dropout_draw, _, _ = sample_rng(self.seed, self.epoch, index).random(4)  # the image dataset's draws
        record = self.record_at(index)
        caption = "" if dropout_draw < self.data.caption_dropout else record.caption
        return {"pixel_values": self.load_clip(record), "caption": caption, "sample_id": record.sample_id,
                "index": index}


def collate_video(samples: list[dict]) -> dict:
    """pixel_values (B, 3, frames, H, W); caption and sample_id lists; index (B,)."""
    return {"pixel_values": torch.stack([s["pixel_values"] for s in samples]),
            "caption": [s["caption"] for s in samples], "sample_id": [s["sample_id"] for s in samples],
            "index": torch.tensor([s["index"] for s in samples], dtype=torch.long)}


def clip_frames(record: SampleRecord, data: DataSpec) -> int:
    """Frames the record's clip has: 1 for a still image (built-in shapes included), else data.video.frames."""
    if record.image_path is None:
        return data.video.frames if record.sample_id.startswith("moving-shapes/") else 1
    return data.video.frames if is_video_file(record.image_path) else 1


def find_bad_clips(records: list[SampleRecord], data: DataSpec, rank: int = 0,
                   world_size: int = 1) -> list[tuple[SampleRecord, str]]:
    """(record, reason) for each file of this rank's share (records[rank::world_size]) that cannot give its clip:
    videos are decoded in full and their frames chosen, images opened. Gather all ranks' results."""
    bad, share = [], records[rank::world_size]
    reader = VideoCaptionDataset(data, share, 0) if share else None
    for record in share:
        if record.image_path is None:
            continue
        try:
            reader.clip_images(record)
        except BadSampleError as err:
            bad.append((record, err.message))
    return bad
