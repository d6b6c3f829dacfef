"""LTX-2's log-mel spectrogram (dstune.models.ltx2.audio, ltx-core's AudioProcessor settings) against an independent
reference: transformers' audio_utils (its own slaney mel filter bank and numpy STFT), at the tiny audio VAE's and the
real LTX-2 audio VAE's settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

from dstune.models.ltx2.audio import N_FFT, log_mel, slaney_filter_bank


def _reference(waveform: np.ndarray, rate: int, hop: int, mel_bins: int) -> np.ndarray:
    """(frames, mels) of one channel: transformers' slaney filters, periodic Hann window, centred reflect-padded
    frames, magnitude, log of max(mel, 1e-5)."""
    filters = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1,
        num_mel_filters=mel_bins,
        min_frequency=0.0,
        max_frequency=rate / 2,
        sampling_rate=rate,
        norm="slaney",
        mel_scale="slaney",
    )
    mel = spectrogram(
        waveform.astype(np.float64),
        window_function(N_FFT, "hann", periodic=True),
        frame_length=N_FFT,
        hop_length=hop,
        power=1.0,
        center=True,
        pad_mode="reflect",
        mel_filters=filters,
        mel_floor=1e-5,
        log_mel="log",
    )
    return mel.T


@pytest.mark.parametrize("mel_bins", [16, 64])  # the tiny audio VAE's, LTX-2's
def test_filter_bank_is_slaney_scaled_and_normalised(mel_bins):
    ours = slaney_filter_bank(N_FFT // 2 + 1, mel_bins, 16000).numpy()
    theirs = mel_filter_bank(N_FFT // 2 + 1, mel_bins, 0.0, 8000.0, 16000, norm="slaney", mel_scale="slaney")
    assert np.allclose(ours, theirs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mel_bins", [16, 64])
def test_log_mel_equals_transformers_audio_utils(mel_bins):
    rate, hop = 16000, 160
    generator = torch.Generator().manual_seed(0)
    seconds = torch.arange(6000) / rate
    tone = 0.4 * torch.sin(2 * torch.pi * (300 + 400 * seconds) * seconds)  # a chirp, and noise on the right
    waveform = torch.stack([tone, 0.1 * torch.randn(6000, generator=generator)]).unsqueeze(0)
    ours = log_mel(waveform, rate, hop, mel_bins)
    assert ours.shape == (1, 2, 6000 // hop + 1, mel_bins) and ours.dtype == torch.float32
    for channel in range(2):
        theirs = _reference(waveform[0, channel].numpy(), rate, hop, mel_bins)
        mine = ours[0, channel].numpy().astype(np.float64)
        # float32 (as torchaudio computes) against float64: equal to float32 rounding of the magnitudes, which
        # the log enlarges only near the floor
        assert np.abs(np.exp(mine) - np.exp(theirs)).max() < 5e-6, channel
        loud = theirs > np.log(1e-3)
        assert loud.mean() > 0.2 and np.abs(mine - theirs)[loud].max() < 1e-4, channel
    silent = log_mel(torch.zeros(1, 2, 1600), rate, hop, mel_bins)
    assert torch.equal(silent, torch.full_like(silent, float(np.log(1e-5))))  # the floor
