"""LTX-2's audio side of a clip: the log-mel spectrogram its audio VAE encodes, and the VAE's latents as tokens.

The spectrogram is ltx-core's AudioProcessor (the one ltx-trainer's preprocessing runs before the audio VAE), written
in torch because torchaudio is not a dependency of dstune: torchaudio's MelSpectrogram at the VAE's sample rate with
n_fft N_FFT (ltx-core's default; diffusers' AutoencoderKLLTX2Audio config does not carry it) as the window length, a
periodic Hann window, the VAE's mel_hop_length as hop, the VAE's mel_bins filters from 0 Hz to half the rate on the
slaney mel scale with slaney (area) normalisation, the magnitude (power 1), centred frames with reflect padding; then
log(clamp(mel, 1e-5)), laid out (batch, channels, time, mels). tests/unit/test_ltx2_audio.py checks it against
transformers' audio_utils (its own slaney filter bank and numpy spectrogram).

Latents as ltx-trainer trains on them: the audio VAE posterior's mean (B, C, T, M), patchified to (B, T, C x M), then
normalised per feature with the VAE's latents_mean / latents_std (ltx-core's per-channel statistics, applied to the
patchified latents; LTX2Pipeline normalises its audio latents the same way).
"""

from __future__ import annotations

import math

import torch

from dstune.families.precision import at_least_float32, at_least_float32_dtype

N_FFT = 1024  # ltx-core's AudioEncoder default n_fft (the window length too)
LOG_FLOOR = 1e-5  # log(clamp(mel, LOG_FLOOR))
# the slaney mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above (27 mels per factor 6.4)
SLANEY_LINEAR_HZ_PER_MEL, SLANEY_KNEE_HZ, SLANEY_LOG_STEP = 200.0 / 3.0, 1000.0, math.log(6.4) / 27.0


def hz_to_slaney_mel(hz: torch.Tensor) -> torch.Tensor:
    knee_mel = SLANEY_KNEE_HZ / SLANEY_LINEAR_HZ_PER_MEL
    linear = hz / SLANEY_LINEAR_HZ_PER_MEL
    log = knee_mel + torch.log(hz.clamp(min=SLANEY_KNEE_HZ) / SLANEY_KNEE_HZ) / SLANEY_LOG_STEP
    return torch.where(hz >= SLANEY_KNEE_HZ, log, linear)


def slaney_mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    knee_mel = SLANEY_KNEE_HZ / SLANEY_LINEAR_HZ_PER_MEL
    log = SLANEY_KNEE_HZ * torch.exp(SLANEY_LOG_STEP * (mel - knee_mel))
    return torch.where(mel >= knee_mel, log, mel * SLANEY_LINEAR_HZ_PER_MEL)


def slaney_filter_bank(frequency_bins: int, mel_bins: int, rate: int) -> torch.Tensor:
    """(frequency_bins, mel_bins) float64 triangular filters between 0 Hz and rate / 2, their corners evenly spaced
    on the slaney mel scale, each scaled to unit area (2 / its width in Hz)."""
    bin_hz = torch.linspace(0, rate // 2, frequency_bins, dtype=torch.float64)
    top = hz_to_slaney_mel(torch.tensor(rate / 2.0, dtype=torch.float64))
    corners = slaney_mel_to_hz(torch.linspace(0.0, float(top), mel_bins + 2, dtype=torch.float64))
    widths = corners[1:] - corners[:-1]
    offsets = corners[None, :] - bin_hz[:, None]  # (bins, mel_bins + 2)
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return filters * (2.0 / (corners[2:] - corners[:-2]))[None, :]


def log_mel(waveform: torch.Tensor, rate: int, hop: int, mel_bins: int, n_fft: int = N_FFT) -> torch.Tensor:
    """(B, channels, samples) float waveform at `rate` Hz -> (B, channels, frames, mel_bins) log-mel, frames =
    samples // hop + 1 (ltx-core's AudioProcessor.waveform_to_mel, see the module docstring). Computed in float32
    (float64 filters cast), or in float64 for a float64 waveform."""
    batch, channels, samples = waveform.shape
    flat = at_least_float32(waveform.reshape(batch * channels, samples))
    window = torch.hann_window(n_fft, periodic=True, dtype=flat.dtype, device=flat.device)
    spectrum = torch.stft(
        flat,
        n_fft,
        hop_length=hop,
        win_length=n_fft,
        window=window,
        center=True,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    ).abs()  # (B x channels, n_fft // 2 + 1, frames)
    filters = slaney_filter_bank(n_fft // 2 + 1, mel_bins, rate).to(flat.device, flat.dtype)
    mel = torch.matmul(spectrum.transpose(1, 2), filters)  # (B x channels, frames, mel_bins)
    return torch.log(mel.clamp(min=LOG_FLOOR)).reshape(batch, channels, -1, mel_bins)


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, T, M) -> (B, T, C x M): ltx-core's AudioPatchifier (patch 1), LTX2Pipeline._pack_audio_latents."""
    return latents.transpose(1, 2).flatten(2, 3)


def audio_tokens(audio_vae, latents: torch.Tensor) -> torch.Tensor:
    """The posterior means (B, C, T, M) as the transformer's audio tokens: packed, then normalised per feature with
    the VAE's latents_mean / latents_std."""
    tokens = pack_audio(latents)
    mean = audio_vae.latents_mean.to(tokens.device, tokens.dtype)
    std = audio_vae.latents_std.to(tokens.device, tokens.dtype)
    return (tokens - mean) / std


def sound_latents(audio_vae, sound: torch.Tensor) -> torch.Tensor:
    """Stereo waveforms (B, 2, samples) at the VAE's sample_rate -> the posterior means (B, C, T, M), float32 (float64 from a float64 VAE)."""
    config = audio_vae.config
    mel = log_mel(
        sound.to(at_least_float32_dtype(audio_vae.dtype)), config.sample_rate, config.mel_hop_length, config.mel_bins
    )
    with torch.no_grad():
        posterior = audio_vae.encode(mel.to(audio_vae.dtype)).latent_dist
    return at_least_float32(posterior.mean)
