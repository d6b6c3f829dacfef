"""LTX-2's sound (dstune.models.ltx2.audio and Ltx2.loss) on builtin:tiny-ltx2 and builtin:moving-shapes-av: the
log-mel spectrogram (ltx-core's AudioProcessor settings) against an independent reference, transformers' audio_utils
(its own slaney mel filter bank and numpy STFT), at the tiny audio VAE's and the real LTX-2 audio VAE's settings; and
the audio+video loss against ltx-trainer's loss lines (TextToVideoStrategy with with_audio true: ltx_trainer.py), on
clips with sound, without, and mixed in one batch, and its gradient under a sequence split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

from dstune.models.ltx2.audio import N_FFT, log_mel, slaney_filter_bank
from loaded_models import with_settings

from .ltx_trainer import (
    FRAMES,
    INDICES,
    SEED,
    STEP,
    load_tiny_ltx2,
    reference_av_loss,
    sound_batch,
)


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


# ------------------------------------------------------------------------------------------ audio + video


@pytest.fixture(scope="module")
def built():
    return load_tiny_ltx2()


def test_audio_video_loss_equals_ltx_trainers_loss_lines(built):
    """Clips with sound train both streams in one call; the loss is ltx-trainer's summed per-sample loss."""
    rate = built.parts["audio_vae"].config.sample_rate
    batch = sound_batch(INDICES, rate)
    encoded = built.encode_batch(batch)
    assert encoded["has_sound"].tolist() == [True, True] and encoded["sound_latent"].shape == (2, 2, 10, 4)
    with torch.no_grad():
        ours = built.loss(built.trainable, encoded, SEED, STEP)
    reference = reference_av_loss(built, encoded, batch["sound"], INDICES)
    assert ours.item() == pytest.approx(reference.mean().item(), rel=1e-5)
    video_only = dict(encoded, has_sound=torch.tensor([False, False]))
    with torch.no_grad():
        assert built.loss(built.trainable, video_only, SEED, STEP).item() < ours.item()  # the audio term


def test_a_batch_mixing_clips_with_and_without_sound_calls_the_transformer_once_per_kind(built):
    """Clip 3 with its sound, clip 11 without: the batch loss is the mean of clip 3's audio+video loss (as if it were
    alone) and clip 11's video-only loss; the draws of each clip do not depend on its batch mate."""
    rate = built.parts["audio_vae"].config.sample_rate
    batch = sound_batch(INDICES, rate)
    batch["has_sound"] = torch.tensor([True, False])
    encoded = built.encode_batch(batch)
    calls = []

    def counting(**inputs):
        calls.append((inputs["hidden_states"].shape[0], inputs["isolate_modalities"]))
        return built.trainable(**inputs)

    with torch.no_grad():
        ours = built.loss(counting, encoded, SEED, STEP)
    assert sorted(calls) == [(1, False), (1, True)]
    alone = {name: value[:1] if torch.is_tensor(value) else value for name, value in encoded.items()}
    with_sound = reference_av_loss(built, alone, batch["sound"][:1], INDICES[:1])
    model = with_settings(built, timestep_sampling="shifted_logit_normal")
    second = {name: value[1:] if torch.is_tensor(value) else value for name, value in encoded.items()}
    del second["has_sound"]
    with torch.no_grad():
        without = model.loss(model.trainable, dict(second, indices=torch.tensor(INDICES[1:])), SEED, STEP)
    assert ours.item() == pytest.approx((with_sound.item() + without.item()) / 2, rel=1e-5)
    parts = built.loss_parts()  # what training logs beside the loss: the video's and the sound's shares
    assert parts["video"] + parts["audio"] == pytest.approx(ours.item(), rel=1e-6)
    assert 0 < parts["audio"] < ours.item()


def test_a_batch_without_sound_gives_the_sound_no_share_of_the_loss(built):
    rate = built.parts["audio_vae"].config.sample_rate
    encoded = built.encode_batch(sound_batch(INDICES, rate))
    with torch.no_grad():
        loss = built.loss(built.trainable, dict(encoded, has_sound=torch.tensor([False, False])), SEED, STEP)
    assert built.loss_parts() == {"video": loss.item(), "audio": 0.0}


def test_clips_without_sound_train_their_video_alone(built):
    """builtin:moving-shapes read for a model with sound: silence and has_sound False, nothing encoded for it, and
    the loss is the video-only one."""
    from dstune.data.index import list_samples
    from dstune.data.video import VideoCaptionDataset, collate_video
    from dstune.spec.models import DataSpec

    data = DataSpec(path="builtin:moving-shapes", resolution=32, video={"frames": FRAMES})
    dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED, sound_rate=built.sound_rate)
    batch = collate_video([dataset[i] for i in INDICES])
    assert batch["has_sound"].tolist() == [False, False] and batch["sound"].shape == (2, 2, 6000)
    encoded = built.encode_batch(batch)
    assert "sound_latent" not in encoded
    silent = {name: value for name, value in batch.items() if name not in ("sound", "has_sound")}
    with torch.no_grad():
        ours = built.loss(built.trainable, encoded, SEED, STEP)
        video_only = built.loss(built.trainable, built.encode_batch(silent), SEED, STEP)
    assert ours.item() == video_only.item()


def test_under_a_sequence_split_the_sound_loss_gradient_is_divided_by_the_split(built):
    """Every rank of a sequence group computes the whole sound stream and its loss (dstune.models.ltx2.split), and
    the group sums gradients, so the core divides the sound loss's gradient by the split size, its value kept:
    the audio output projection (which only the sound's loss reads) gets half its gradient at a split of 2, the
    video output projection (which only the video's loss reads) the same gradient. The 2-rank runs of
    tests/dist/test_sequence_parallel.py check the whole step against one rank's."""
    batch = sound_batch(INDICES, built.sound_rate)
    encoded = built.encode_batch(batch)
    assert encoded["has_sound"].all()

    def loss_and_gradients(split: int):
        built.trainable.zero_grad(set_to_none=True)
        built.sequence_split = split
        try:
            loss = built.loss(built.trainable, encoded, SEED, STEP)
            loss.backward()
        finally:
            built.sequence_split = 1
        return loss.item(), {
            name: built.trainable.get_submodule(name).weight.grad.clone() for name in ("audio_proj_out", "proj_out")
        }

    whole_loss, whole = loss_and_gradients(1)
    split_loss, split = loss_and_gradients(2)
    built.trainable.zero_grad(set_to_none=True)
    assert split_loss == whole_loss
    torch.testing.assert_close(split["audio_proj_out"], whole["audio_proj_out"] / 2, rtol=1e-6, atol=0)
    torch.testing.assert_close(split["proj_out"], whole["proj_out"], rtol=0, atol=0)


def test_a_loss_mask_weights_the_video_and_leaves_the_sound_alone(built):
    """data.mask_dir on LTX-2: the clips' audio part of the loss is the same under any mask (a mask weights the
    picture), the video part changes, and a mask of ones gives the unmasked loss."""
    rate = built.parts["audio_vae"].config.sample_rate
    batch = sound_batch(INDICES, rate)
    half = torch.ones(len(INDICES), 1, FRAMES, 32, 32)
    half[..., 16:] = 0
    parts = {}
    for name, mask in (("none", None), ("ones", torch.ones_like(half)), ("half", half)):
        encoded = built.encode_batch(batch if mask is None else {**batch, "loss_mask": mask})
        with torch.no_grad():
            loss = built.loss(built.trainable, encoded, SEED, STEP).item()
        parts[name] = (loss, built.loss_parts())
    assert parts["ones"][0] == pytest.approx(parts["none"][0], rel=1e-6)
    assert parts["none"][1]["audio"] > 0
    assert parts["half"][1]["audio"] == pytest.approx(parts["none"][1]["audio"], rel=1e-6)
    assert abs(parts["half"][1]["video"] - parts["none"][1]["video"]) > 1e-4


def test_a_regularization_set_adds_its_weighted_mean_to_the_train_clips_mean(built):
    """data.sets on LTX-2: clip 3 (train) and clip 11 (regularization, loss_weight w) in one batch give clip 3's
    audio+video loss plus w x clip 11's, each as if it were alone (each clip's draws are its own)."""
    rate = built.parts["audio_vae"].config.sample_rate
    batch = sound_batch(INDICES, rate)
    alone = []
    for i in range(len(INDICES)):
        one = {k: v[i : i + 1] if torch.is_tensor(v) else v[i : i + 1] for k, v in batch.items()}
        with torch.no_grad():
            alone.append(built.loss(built.trainable, built.encode_batch(one), SEED, STEP).item())
    fields = {"loss_weight": torch.tensor([1.0, 0.7]), "prior": torch.tensor([False, True])}
    with torch.no_grad():
        combined = built.loss(built.trainable, built.encode_batch({**batch, **fields}), SEED, STEP).item()
    assert combined == pytest.approx(alone[0] + 0.7 * alone[1], rel=1e-5)
