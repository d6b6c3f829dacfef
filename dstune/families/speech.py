"""What the speech families share: the clip type, sample WAV folders, and the tts_lm token layout file.

The token layout (`dstune_tts.json` in a model folder) is the tts_lm family's format: which ids are text, which
are audio codes of which codebook, and the special audio tokens. It lives here, with the families, and the built-in
tiny TTS model writes it through `tts_layout` like any exported model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

TTS_LAYOUT_FILE = "dstune_tts.json"


@dataclass
class Clip:
    wave: np.ndarray  # float32 mono
    sample_rate: int


def tts_layout(text: str, text_vocab_size: int, num_codebooks: int, codebook_size: int, codec: str,
               sampling_rate: int, frame_rate: float) -> dict:
    """The token layout of a tts_lm vocabulary: text ids, then num_codebooks blocks of codebook_size audio ids,
    then audio BOS, audio EOS and padding."""
    audio_offset = text_vocab_size
    audio_end = audio_offset + num_codebooks * codebook_size
    return {"text": text, "text_vocab_size": text_vocab_size, "audio_offset": audio_offset,
            "num_codebooks": num_codebooks, "codebook_size": codebook_size, "audio_bos": audio_end,
            "audio_eos": audio_end + 1, "pad": audio_end + 2, "vocab_size": audio_end + 3, "codec": codec,
            "sampling_rate": sampling_rate, "frame_rate": frame_rate}


def save_wavs(clips: list[Clip], prompts: list[str], path) -> Path:
    """WAVs in a folder named like `path` without its suffix (samples/step-000010/00.wav ...) + prompts.txt."""
    import soundfile

    folder = Path(path).with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    for number, clip in enumerate(clips):
        soundfile.write(str(folder / f"{number:02d}.wav"), clip.wave, clip.sample_rate, subtype="FLOAT")
    (folder / "prompts.txt").write_text("".join(f"{n:02d}.wav\t{p}\n" for n, p in enumerate(prompts)))
    return folder
