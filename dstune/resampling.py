"""Band-limited audio resampling (numpy only, deterministic, the same on every rank): what the speech data
(dstune.data.audio) and the speech models' own inputs (a voice prompt's reference clip) are converted with."""

from __future__ import annotations

import numpy as np


def resample(wave: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Band-limited resampling by zero-padding / truncating the spectrum (what scipy.signal.resample does)."""
    if from_rate == to_rate:
        return wave.astype(np.float32, copy=False)
    length = max(1, round(len(wave) * to_rate / from_rate))
    spectrum = np.fft.rfft(wave.astype(np.float64))
    bins = length // 2 + 1
    if bins <= len(spectrum):
        spectrum = spectrum[:bins]
    else:
        spectrum = np.concatenate([spectrum, np.zeros(bins - len(spectrum), dtype=spectrum.dtype)])
    return (np.fft.irfft(spectrum, n=length) * (length / len(wave))).astype(np.float32)
