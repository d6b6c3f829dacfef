"""Sample outputs: an image grid per step (an animated one for clips; clips rendered with sound also each as an MP4
with its sound track) and the samples page (index.html) over every step of a run."""

from __future__ import annotations

import os
import re
import textwrap
from fractions import Fraction
from pathlib import Path

from dstune.curves import curves_svg
from dstune.families.base import FamilyError
from dstune.fsutil import write_text_atomic

_GRID_CELL_PX = 192  # small models render 32-px images; scale them up (nearest) so they can be seen
_CLIP_FRAME_MS = 125  # 8 frames per second in the animated sample grids


def read_control_images(paths) -> list:
    """sample.control_images as RGB PIL images; ValueError naming the one that cannot be read (the families raise
    it as their FamilyError)."""
    from PIL import Image

    images = []
    for path in paths:
        if not isinstance(path, str):
            raise ValueError(
                f"sample.control_images: {path} is a list, but this model takes one image per prompt. Give one path "
                "per prompt (a list per prompt is for the models that take several references)."
            )
        try:
            with Image.open(Path(path).expanduser()) as image:
                images.append(image.convert("RGB"))
        except OSError as err:
            raise ValueError(f"sample.control_images: cannot read {path} ({err}). Fix the path.") from None
    return images


def sized_as_trained(sources: list, side: int) -> list:
    """Sample sources (one image, or a list of references, per prompt) each resized (the shorter side to `side`,
    LANCZOS) and centre-cropped to side x side: what training gave an edit model beside a target of that size (the
    dataset sizes a target's references with it), so a sample edits what the run trained on and renders at the size
    the memory plan's sample phase counts (for a pipeline that takes its source at the size given)."""
    from PIL import Image, ImageOps

    def sized(image):
        if isinstance(image, list):
            return [sized(one) for one in image]
        if image.size == (side, side):
            return image
        return ImageOps.fit(image, (side, side), method=Image.Resampling.LANCZOS, centering=(0.5, 0.5))

    return [sized(source) for source in sources]


VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv")  # what read_control_clips decodes as a video


def read_control_clips(paths) -> list:
    """sample.control_images as clips (a video model's references): each a list of RGB PIL images, every frame of a
    video file (VIDEO_SUFFIXES) or an image alone; ValueError naming the one that cannot be read."""
    import av

    clips = []
    for path in paths:
        if not str(path).lower().endswith(VIDEO_SUFFIXES):
            clips.append(read_control_images([path]))
            continue
        try:
            with av.open(str(Path(path).expanduser())) as container:
                clips.append([frame.to_image().convert("RGB") for frame in container.decode(video=0)])
        except (OSError, ValueError) as err:
            raise ValueError(f"sample.control_images: cannot read the clip {path} ({err}). Fix the path.") from None
    return clips


def first_frames(sample_spec, prompts: list[str]) -> list:
    """An image-to-video model's sample sources: sample.control_images as RGB images, one first frame per prompt;
    FamilyError when the counts differ or one cannot be read."""
    paths = sample_spec.control_images
    if len(paths) != len(prompts):
        raise FamilyError(
            "sample.control_images: image-to-video renders each clip from a first frame: give one image "
            f"per prompt ({len(prompts)} prompt(s), {len(paths)} image(s)), or set sample.prompts: []"
        )
    try:
        return read_control_images(paths)
    except ValueError as err:
        raise FamilyError(str(err)) from None


def save_grid(images: list, prompts: list[str], path: str | os.PathLike) -> Path:
    """Write the images side by side (up to 4 per row) as one PNG with each prompt under its image."""
    if len(images) != len(prompts):
        raise ValueError(f"save_grid: {len(images)} images but {len(prompts)} prompts")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid_image(images, prompts).save(path)
    return path


class ClipWithSound(list):
    """A rendered clip's frames (PIL images, the list) with the sound the pipeline rendered with them: `sound`
    float (channels, samples) in [-1, 1] at `rate` Hz, the frames at `fps`."""

    def __init__(self, frames, sound, rate: int, fps: float):
        super().__init__(frames)
        self.sound, self.rate, self.fps = sound, int(rate), float(fps)


def save_clip_grid(clips: list, prompts: list[str], path: str | os.PathLike) -> Path:
    """Video families: the clips (lists of PIL frames) as one animated grid, each frame a grid of every clip's frame
    with the prompts under them, written twice beside `path`: an animated WebP (lossless; the samples page plays it
    in an <img>) and an H.264 MP4 (for players and trackers). Clips with sound (ClipWithSound) are also written one
    MP4 each, at their own frame rate with their sound (AAC), into the folder `path` names without its suffix
    (0.mp4, 1.mp4, ... in prompt order). Returns the WebP's path."""
    if len(clips) != len(prompts):
        raise ValueError(f"save_clip_grid: {len(clips)} clips but {len(prompts)} prompts")
    frames = [
        grid_image([clip[min(number, len(clip) - 1)] for clip in clips], prompts)
        for number in range(max(len(clip) for clip in clips))
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    webp = path.with_suffix(".webp")
    frames[0].save(
        webp, format="WEBP", save_all=True, append_images=frames[1:], duration=_CLIP_FRAME_MS, loop=0, lossless=True
    )
    write_mp4(frames, path.with_suffix(".mp4"), 1000 // _CLIP_FRAME_MS)
    heard = [(number, clip) for number, clip in enumerate(clips) if isinstance(clip, ClipWithSound)]
    if heard:
        folder = path.with_suffix("")
        folder.mkdir(exist_ok=True)
        for number, clip in heard:
            write_mp4(list(clip), folder / f"{number}.mp4", clip.fps, sound=(clip.sound, clip.rate))
    return webp


def write_mp4(frames: list, path: Path, fps: float, sound=None) -> Path:
    """PIL frames -> an H.264 (yuv420p, which every player decodes) MP4 by PyAV; sides padded to even pixels, as
    4:2:0 needs; with `sound` ((channels, samples) float in [-1, 1], Hz), an AAC track of it (one or two
    channels). Written to a temporary name and renamed, so a reader never sees half a file."""
    import av
    import numpy as np
    from PIL import Image

    width, height = frames[0].size
    even = (width + width % 2, height + height % 2)
    partial = path.with_name(path.name + ".partial")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(partial), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = even[0], even[1], "yuv420p"
        if sound is not None:  # every stream is added before the first packet is written
            waveform, hz = np.clip(np.asarray(sound[0], dtype=np.float32), -1, 1)[:2], int(sound[1])
            layout = "mono" if waveform.shape[0] == 1 else "stereo"
            audio = container.add_stream("aac", rate=hz)
            audio.layout = layout
        for frame in frames:
            canvas = Image.new("RGB", even, (255, 255, 255))
            canvas.paste(frame.convert("RGB"), (0, 0))
            container.mux(stream.encode(av.VideoFrame.from_image(canvas)))
        container.mux(stream.encode())
        if sound is not None:
            track = av.AudioFrame.from_ndarray(np.ascontiguousarray(waveform), format="fltp", layout=layout)
            track.sample_rate, track.pts = hz, 0
            container.mux(audio.encode(track))
            container.mux(audio.encode())
    os.replace(partial, path)
    return path


def grid_image(images: list, prompts: list[str]):
    """The images side by side (up to 4 per row), each scaled up to a cell, with its prompt under it."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    line_px, chars_per_line, lines = 14, max(8, _GRID_CELL_PX // 7), 3
    columns = min(4, max(1, len(images)))
    rows = (len(images) + columns - 1) // columns
    cell_h = _GRID_CELL_PX + lines * line_px + 8
    grid = Image.new("RGB", (columns * (_GRID_CELL_PX + 8), max(1, rows) * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for number, (image, prompt) in enumerate(zip(images, prompts)):
        x, y = (number % columns) * (_GRID_CELL_PX + 8) + 4, (number // columns) * cell_h + 4
        scaled = image.convert("RGB").resize((_GRID_CELL_PX, _GRID_CELL_PX), Image.Resampling.NEAREST)
        grid.paste(scaled, (x, y))
        wrapped = textwrap.wrap(prompt or "(empty prompt)", chars_per_line)[:lines]
        for line_number, line in enumerate(wrapped):
            draw.text((x, y + _GRID_CELL_PX + 2 + line_number * line_px), line, fill=(0, 0, 0), font=font)
    return grid


_SHEET_STEP = re.compile(r"step-(\d+)(\.png|\.webp)?")


def write_contact_sheet(
    samples_dir: str | os.PathLike, prompts: list[str], weights: str, metrics: list[dict] = ()
) -> Path:
    """(Re)write samples_dir/index.html: the loss and LR curves of `metrics` (metrics.jsonl records, inline SVG),
    then every `step-NNNNNN.png` grid (`.webp` for clips, with a link to its MP4 and a player for each clip saved
    with its sound) of the run so far (resumed runs included), oldest first, with its step number,
    under the prompts in grid order. `weights` says what the grids show ("EMA" or "trained"). Written to a temporary
    file and renamed, so a browser never sees half a page."""
    import html

    folder = Path(samples_dir)
    entries = sorted((int(m.group(1)), p.name) for p in folder.iterdir() if (m := _SHEET_STEP.fullmatch(p.name)))
    grids = {step for step, name in entries if name.endswith((".png", ".webp"))}
    entries = [(step, name) for step, name in entries if name.endswith((".png", ".webp")) or step not in grids]
    prompt_items = "".join(f"<li>{html.escape(prompt or '(empty prompt)')}</li>" for prompt in prompts)
    rows = "".join(
        f'<section id="step-{step}"><h2>step {step}</h2>'
        + (
            f'<img src="{html.escape(name)}" alt="samples at step {step}">{_mp4_link(folder, name)}'
            if name.endswith((".png", ".webp"))
            else _wav_players(folder, name)
        )
        + "</section>\n"
        for step, name in entries
    )
    curves = curves_svg(list(metrics))
    curves_section = f'<section id="curves">{curves}</section>\n' if curves else ""
    page = (
        '<!doctype html>\n<html><head><meta charset="utf-8"><title>dstune samples</title>'
        "<style>body{font-family:sans-serif;margin:1em}img{max-width:100%;image-rendering:pixelated}"
        "section{margin-bottom:1.5em}</style></head><body>\n"
        f"<h1>samples: {len(entries)} steps ({html.escape(weights)} weights)</h1>\n"
        f"{curves_section}<p>Prompts, left to right, top to bottom:</p><ol>{prompt_items}</ol>\n{rows}"
        "</body></html>\n"
    )
    target = folder / "index.html"
    write_text_atomic(target, page)
    return target


def _wav_players(folder: Path, name: str) -> str:
    """A speech step's folder of WAVs (00.wav, 01.wav ... in prompt order): one player per clip, then the folder."""
    import html

    wavs = sorted(p.name for p in (folder / name).glob("*.wav"))
    players = "".join(
        f"<p>{int(Path(wav).stem) + 1 if Path(wav).stem.isdigit() else html.escape(wav)}. "
        f'<audio controls preload="none" src="{html.escape(name)}/{html.escape(wav)}"></audio></p>'
        for wav in wavs
    )
    return f'{players}<a href="{html.escape(name)}/">{html.escape(name)}/</a>'


def _mp4_link(folder: Path, name: str) -> str:
    """A clip grid's MP4, and a player for each clip saved with its sound (the step's folder: 0.mp4, 1.mp4, ...)."""
    import html

    if not name.endswith(".webp"):
        return ""
    mp4 = Path(name).with_suffix(".mp4").name
    link = f' <a href="{mp4}">MP4</a>' if (folder / mp4).is_file() else ""
    stem = Path(name).stem
    heard = sorted((folder / stem).glob("*.mp4"), key=lambda p: int(p.stem) if p.stem.isdigit() else 0)
    players = "".join(
        f'<p>{html.escape(clip.stem)}. <video controls preload="none" '
        f'src="{html.escape(stem)}/{html.escape(clip.name)}"></video></p>'
        for clip in heard
    )
    return link + (f"<p>with sound:</p>{players}" if players else "")
