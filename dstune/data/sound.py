"""A clip's sound track: decoded with PyAV (the decoder that reads the frames), resampled to the rate the model's
audio encoder takes, made stereo, cut to the clip's span. Torch-free (numpy arrays).

Stereo as Lightricks' reference trainer makes it before its audio VAE (scripts/process_videos.py): mono is duplicated,
5.1 (L R C LFE Ls Rs) and 7.1 (L R C LFE Ls Rs Lb Rb) are folded down with the weights 1 (front) and 0.707 (centre,
surrounds) normalised to sum 1 (LFE dropped), any other layout of more than two channels is averaged to mono and
duplicated. That trainer folds down at the file's rate and resamples after (torchaudio's sinc resampler); dstune
resamples while decoding (libswresample, through PyAV) and folds down after: both steps are linear per channel, so
the order does not matter, but the two resamplers' filters differ slightly (the model's docs page lists it).

The span: the clip's frames are `frames` consecutive frames of the timeline at `fps` starting at frame `start`, so
its sound is the samples of [start / fps, (start + frames) / fps) seconds; a track that ends earlier is padded with
silence (as the reference trainer pads it).

`mp4_with_sound` writes frames and a waveform as an MP4 (MPEG-4 video, AAC audio), the same bytes on every run:
builtin:moving-shapes-av's clips are such files.
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

VIDEO_BITS_PER_SECOND = 4_000_000  # mp4_with_sound: near-lossless for small clips
FRONT, OTHER = 1.0, 0.707  # the reference trainer's fold-down weights before normalising (front; centre and surrounds)
# channels (0-based) that feed the left and right output: front, then centre and the surrounds (LFE, 3, dropped)
FOLD_DOWN = {6: ((0, (2, 4)), (1, (2, 5))), 8: ((0, (2, 4, 6)), (1, (2, 5, 7)))}


def to_stereo(waveform: np.ndarray) -> np.ndarray:
    """(channels, samples) -> (2, samples) as the reference trainer makes its audio VAE's input stereo."""
    channels = waveform.shape[0]
    if channels == 2:
        return waveform
    if channels == 1:
        return np.repeat(waveform, 2, axis=0)
    if channels in FOLD_DOWN:
        sides = []
        for front, others in FOLD_DOWN[channels]:
            total = FRONT + OTHER * len(others)
            sides.append((FRONT * waveform[front] + OTHER * waveform[list(others)].sum(axis=0)) / total)
        return np.stack(sides).astype(waveform.dtype)
    return np.repeat(waveform.mean(axis=0, keepdims=True), 2, axis=0)


def has_sound(source) -> bool:
    """Whether the video file (a path, or a file object) has an audio stream."""
    import av

    with av.open(source) as container:
        return bool(container.streams.audio)


def decode_sound(source, rate: int, start_seconds: float, seconds: float):
    """The first audio stream of `source` (a path or a file object) as float32 (2, round(seconds x rate)) at
    `rate` Hz from `start_seconds` on, stereo (to_stereo), padded with silence where the track ends early; None
    when the file has no audio stream. OSError / ValueError (PyAV's errors, its codec errors as ValueError) when it
    cannot be decoded."""
    import av

    try:
        return _decoded(av, source, rate, int(round(start_seconds * rate)), int(round(seconds * rate)))
    except av.error.FFmpegError as err:
        if isinstance(err, (OSError, ValueError)):
            raise
        raise ValueError(f"its audio stream cannot be decoded ({err})") from None


def _decoded(av, source, rate: int, first: int, wanted: int):
    with av.open(source) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="fltp", rate=rate)  # the file's own channel layout is kept
        pieces, decoded = [], 0
        for frame in container.decode(stream):
            for piece in resampler.resample(frame):
                pieces.append(piece.to_ndarray())
                decoded += pieces[-1].shape[1]
            if decoded >= first + wanted:
                break
        else:
            pieces += [piece.to_ndarray() for piece in resampler.resample(None)]
        channels = stream.codec_context.channels or 1
    waveform = np.concatenate(pieces, axis=1) if pieces else np.zeros((channels, 0), np.float32)
    waveform = waveform[:, first : first + wanted]
    if waveform.shape[1] < wanted:
        waveform = np.pad(waveform, ((0, 0), (0, wanted - waveform.shape[1])))
    return to_stereo(np.ascontiguousarray(waveform, dtype=np.float32))


def mp4_with_sound(frames: list, fps: float, waveform: np.ndarray, rate: int) -> bytes:
    """RGB frames (PIL images or (H, W, 3) uint8 arrays, even sides) at `fps` and a float (channels, samples)
    waveform in [-1, 1] at `rate` Hz (one or two channels) as MP4 bytes: MPEG-4 Part 2 video (one thread) and AAC,
    the same bytes on every run."""
    import av

    buffer = io.BytesIO()
    waveform = np.asarray(waveform, dtype=np.float32).reshape(-1, np.shape(waveform)[-1])
    layout = {1: "mono", 2: "stereo"}[waveform.shape[0]]
    with av.open(buffer, "w", format="mp4") as container:
        # MPEG-4 Part 2, not H.264: libx264 gave other bytes from run to run for the same frames (seen with one
        # thread), and a built-in dataset must be the same on every rank and run
        video = container.add_stream("mpeg4", rate=Fraction(fps).limit_denominator(1001))
        first = np.asarray(frames[0])
        video.height, video.width = first.shape[:2]
        video.pix_fmt, video.thread_count, video.bit_rate = "yuv420p", 1, VIDEO_BITS_PER_SECOND
        audio = container.add_stream("aac", rate=rate)
        audio.layout = layout
        for image in frames:
            pixels = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, dtype=np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(video.encode())
        sound = av.AudioFrame.from_ndarray(np.clip(waveform, -1, 1), format="fltp", layout=layout)
        sound.sample_rate, sound.pts = rate, 0
        container.mux(audio.encode(sound))
        container.mux(audio.encode())
    return buffer.getvalue()
