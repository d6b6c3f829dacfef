"""What the speech families share: the clip type and sample WAV folders. (The tts_lm token layouts, written as
`dstune_tts.json` beside a model, are described in dstune.token_layouts.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

@dataclass
class Clip:
    wave: np.ndarray  # float32 mono
    sample_rate: int


def save_wavs(clips: list[Clip], prompts: list[str], path) -> Path:
    """WAVs in a folder named like `path` without its suffix (samples/step-000010/00.wav ...) + prompts.txt."""
    import soundfile

    folder = Path(path).with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    for number, clip in enumerate(clips):
        soundfile.write(str(folder / f"{number:02d}.wav"), clip.wave, clip.sample_rate, subtype="FLOAT")
    (folder / "prompts.txt").write_text("".join(f"{n:02d}.wav\t{p}\n" for n, p in enumerate(prompts)))
    return folder
