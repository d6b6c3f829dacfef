"""The built-in synthetic datasets, made on the fly from the sample number: no files, the same on every rank.

`builtin:shapes`: a synthetic dataset of large flat-coloured shapes with captions ("a red circle").

Sample i is a pure function of i (its own seeded RNG), so any rank or worker can make any sample without
coordination and a run is reproducible without files. Colour and shape cycle through all 18 combinations
(index % 18), so every combination appears equally often; background, size and position vary per sample.
Shapes are large and flat so that a tiny diffusion model visibly learns colour and shape in a few hundred steps.
PIL is imported only when rendering: the index (and `dstune validate`) needs captions, not pixels.

`builtin:moving-shapes`: the same shapes as short clips: each sample's shape glides in one of four directions
("a red circle moving left"); colour, shape and direction cycle through all 72 combinations, and the clip has as
many frames as the video family asks for (data.video.frames), the motion spread over the whole clip.

`builtin:moving-shapes-av`: the moving shapes with a sound track, a tone whose pitch follows the shape's position;
each clip is written as a real MP4 file (MPEG-4 video and AAC, in memory) and read back through the video decoder, as a
user's clip with sound is.

`builtin:tones`: synthetic "speech": the text is a digit string, the audio one tone per digit (its pitch is the
digit). Small enough that a CPU run shows a TTS loss falling.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np

from dstune.data.sound import mp4_with_sound

SHAPES_NUM_SAMPLES = 256
MOVING_SHAPES_NUM_SAMPLES = 144  # each of the 72 colour x shape x direction combinations twice
TONES_NUM_SAMPLES = 256
TONES_SAMPLE_RATE = 16000
TONE_SECONDS, GAP_SECONDS = 0.1, 0.03
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 235),
    "yellow": (240, 215, 40),
    "white": (245, 245, 245),
    "purple": (150, 60, 210),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"dark": (28, 28, 32), "grey": (110, 110, 110)}
_SEED_BASE = 0x5A4E_0000  # keeps this stream apart from other uses of small integer seeds
_SUPERSAMPLE = 4  # drawn at 4x and box-filtered down: smooth edges, flat interiors, even at 32 px


@dataclass(frozen=True)
class ShapeSample:
    colour: str
    shape: str
    background: str
    size: float  # shape width as a fraction of the image side
    centre_x: float  # fractions of the image side
    centre_y: float

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape}"


def shape_sample(index: int) -> ShapeSample:
    """What sample `index` shows; deterministic in `index` alone."""
    if not 0 <= index < SHAPES_NUM_SAMPLES:
        raise IndexError(f"builtin:shapes has samples 0..{SHAPES_NUM_SAMPLES - 1}, not {index}")
    colours = list(COLOURS)
    combination = index % (len(colours) * len(SHAPES))
    rng = random.Random(_SEED_BASE + index)
    size = rng.uniform(0.55, 0.75)
    # Jitter the centre but keep the whole shape inside the image with a small margin.
    slack = (1.0 - size) / 2 * 0.8
    return ShapeSample(
        colour=colours[combination % len(colours)],
        shape=SHAPES[combination // len(colours)],
        background=rng.choice(sorted(BACKGROUNDS)),
        size=size,
        centre_x=0.5 + rng.uniform(-slack, slack),
        centre_y=0.5 + rng.uniform(-slack, slack),
    )


def _outline(sample: ShapeSample, side: int) -> list[tuple[float, float]]:
    """Polygon points (square, triangle) or the bounding box corners (circle), in pixels of a `side` canvas."""
    cx, cy, width = sample.centre_x * side, sample.centre_y * side, sample.size * side
    if sample.shape == "circle":
        r = width / 2
        return [(cx - r, cy - r), (cx + r, cy + r)]
    if sample.shape == "square":
        h = width * 0.85 / 2  # a square as wide as the circle looks bigger; keep the areas comparable
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    half, height = width / 2, width
    return [(cx, cy - height / 2), (cx + half, cy + height / 2), (cx - half, cy + height / 2)]


def render_shape(index: int, resolution: int = 32):
    """Sample `index` as an RGB PIL image of resolution x resolution pixels, and its caption."""
    from PIL import Image, ImageDraw

    sample = shape_sample(index)
    side = resolution * _SUPERSAMPLE
    canvas = Image.new("RGB", (side, side), BACKGROUNDS[sample.background])
    draw = ImageDraw.Draw(canvas)
    points = _outline(sample, side)
    if sample.shape == "circle":
        draw.ellipse(points, fill=COLOURS[sample.colour])
    else:
        draw.polygon(points, fill=COLOURS[sample.colour])
    return canvas.resize((resolution, resolution), Image.Resampling.BOX), sample.caption


# -------------------------------------------------------------------------------------- builtin:moving-shapes

DIRECTIONS: dict[str, tuple[float, float]] = {
    "left": (-1.0, 0.0),
    "right": (1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
}
_TRAVEL = 0.3  # how far the centre moves over a clip, as a fraction of the side


@dataclass(frozen=True)
class MovingShape:
    still: ShapeSample  # the shape at the middle of the clip
    direction: str

    @property
    def caption(self) -> str:
        return f"{self.still.caption} moving {self.direction}"


def moving_shape(index: int) -> MovingShape:
    """What clip `index` shows; deterministic in `index` alone."""
    if not 0 <= index < MOVING_SHAPES_NUM_SAMPLES:
        raise IndexError(f"builtin:moving-shapes has samples 0..{MOVING_SHAPES_NUM_SAMPLES - 1}, not {index}")
    combination = index % (len(COLOURS) * len(SHAPES) * len(DIRECTIONS))
    rng = random.Random(_SEED_BASE + 0x1000 + index)
    size = rng.uniform(0.35, 0.45)  # smaller than the stills, so the shape stays inside while it travels
    return MovingShape(
        still=ShapeSample(
            colour=list(COLOURS)[combination % len(COLOURS)],
            shape=SHAPES[(combination // len(COLOURS)) % len(SHAPES)],
            background=rng.choice(sorted(BACKGROUNDS)),
            size=size,
            centre_x=0.5 + rng.uniform(-0.05, 0.05),
            centre_y=0.5 + rng.uniform(-0.05, 0.05),
        ),
        direction=list(DIRECTIONS)[combination // (len(COLOURS) * len(SHAPES))],
    )


def render_moving_shape(index: int, resolution: int = 32, frames: int = 5):
    """Clip `index` as a list of `frames` RGB PIL images (resolution x resolution), and its caption. The centre
    moves linearly from -_TRAVEL/2 to +_TRAVEL/2 along the direction."""
    from PIL import Image, ImageDraw

    clip = moving_shape(index)
    step_x, step_y = DIRECTIONS[clip.direction]
    side = resolution * _SUPERSAMPLE
    images = []
    for number in range(frames):
        offset = _TRAVEL * ((number / (frames - 1)) - 0.5) if frames > 1 else 0.0
        sample = ShapeSample(
            **{
                **clip.still.__dict__,
                "centre_x": clip.still.centre_x + step_x * offset,
                "centre_y": clip.still.centre_y + step_y * offset,
            }
        )
        canvas = Image.new("RGB", (side, side), BACKGROUNDS[sample.background])
        draw = ImageDraw.Draw(canvas)
        points = _outline(sample, side)
        (draw.ellipse if sample.shape == "circle" else draw.polygon)(points, fill=COLOURS[sample.colour])
        images.append(canvas.resize((resolution, resolution), Image.Resampling.BOX))
    return images, clip.caption


# ---------------------------------------------------------------------------------------------- builtin:tones


def tones_text(index: int) -> str:
    """Sample `index`'s digit string (1 to 6 digits), a pure function of the index."""
    rng = np.random.default_rng([0x70_4E5, index])
    return "".join(str(d) for d in rng.integers(0, 10, size=int(rng.integers(1, 7))))


def tones_duration(text: str) -> float:
    return len(text) * (TONE_SECONDS + GAP_SECONDS)


def render_tones(text: str, sample_rate: int = TONES_SAMPLE_RATE) -> np.ndarray:
    """float32 mono waveform: per digit d a TONE_SECONDS tone at 300 + 150 * d Hz (Hann-shaped), then a gap."""
    tone_n, gap_n = round(TONE_SECONDS * sample_rate), round(GAP_SECONDS * sample_rate)
    t = np.arange(tone_n) / sample_rate
    pieces = []
    for digit in text:
        pieces.append(0.5 * np.sin(2 * np.pi * (300 + 150 * int(digit)) * t) * np.hanning(tone_n))
        pieces.append(np.zeros(gap_n))
    return np.concatenate(pieces).astype(np.float32)


# ----------------------------------------------------------------------------------- builtin:moving-shapes-av

MOVING_SHAPES_AV_FPS = 24  # the clips' frame rate (24, the audio+video model's), unless data.video.fps asks for another
MOVING_SHAPES_AV_RATE = 24000  # the tone's sample rate: not the audio VAE's, so reading it resamples
TONE_BASE_HZ, TONE_AMPLITUDE, TONE_FADE_SECONDS = 440.0, 0.3, 0.005


def moving_shape_tone(index: int, frames: int, fps: float, rate: int = MOVING_SHAPES_AV_RATE) -> np.ndarray:
    """Clip `index`'s sound: float32 mono (1, frames / fps x rate), a tone whose pitch follows the shape's centre,
    TONE_BASE_HZ x 2^((x - y) / _TRAVEL) (sides as fractions): it rises as the shape moves right or up and falls as
    it moves left or down, by an octave over the clip. Between frames the centre moves as it does across frames."""
    clip = moving_shape(index)
    step_x, step_y = DIRECTIONS[clip.direction]
    seconds = np.arange(int(round(frames / fps * rate))) / rate
    last = (frames - 1) / fps
    progress = np.clip(seconds / last, 0.0, 1.0) if frames > 1 else np.full_like(seconds, 0.5)
    offset = _TRAVEL * (progress - 0.5)
    x, y = clip.still.centre_x + step_x * offset, clip.still.centre_y + step_y * offset
    phase = 2 * np.pi * np.cumsum(TONE_BASE_HZ * 2.0 ** ((x - y) / _TRAVEL)) / rate
    fade = np.clip(np.minimum(seconds, seconds[-1] - seconds) / TONE_FADE_SECONDS, 0.0, 1.0) if len(seconds) else 1
    return (TONE_AMPLITUDE * np.sin(phase) * fade).astype(np.float32)[None]


@functools.lru_cache(maxsize=512)
def moving_shape_av_mp4(index: int, resolution: int, frames: int, fps: float = MOVING_SHAPES_AV_FPS) -> bytes:
    """Clip `index` of builtin:moving-shapes-av as the bytes of an MP4 file: moving-shapes' frames at `fps` (MPEG-4)
    and moving_shape_tone (AAC, mono at MOVING_SHAPES_AV_RATE). The same bytes on every run and rank."""
    images, _ = render_moving_shape(index, resolution, frames)
    return mp4_with_sound(images, fps, moving_shape_tone(index, frames, fps), MOVING_SHAPES_AV_RATE)
