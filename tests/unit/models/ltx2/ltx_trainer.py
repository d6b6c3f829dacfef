"""ltx-trainer's loss lines for LTX-2, recomputed on builtin:tiny-ltx2 (a helper of the LTX-2 tests, not a test):
the video and audio references the tests compare dstune's loss with, the clips with sound they use, and
`dstune validate` on the 8-GPU example spec.

The reference re-computes the lines of Lightricks' ltx-trainer (packages/ltx-trainer, TextToVideoStrategy with
with_audio false and first_frame_conditioning_p 0): the video latents are the VAE's normalised posterior means
((mean - latents_mean) / latents_std per channel), patchified "b c f h w -> b (f h w) c"; sigma from its
ShiftedLogitNormalTimestepSampler (or UniformTimestepSampler) over the video's token count; noisy = (1 - sigma) x0 +
sigma noise; target noise - x0; per-token timesteps sigma; the positions of _get_video_positions (each latent
patch's [start, end) in pixels: frames x temporal factor with the causal fix, then / fps; rows and columns x spatial
factor); the transformer without an audio modality; the loss per sample the mean of the squared error over tokens
and channels, then the batch mean (trainer.py's output.loss.mean()). Its transformer is ltx-core's; the reference
feeds diffusers' LTX2VideoTransformer3DModel the same inputs (timesteps x 1000, its timestep_scale_multiplier, and
isolate_modalities for the missing audio modality). The draws are dstune's: each sample's generator for the noise
and for the sampler's normal, uniform and mixing draws.
"""

from __future__ import annotations

import torch

from dstune.families.randomness import per_sample_randn, sample_generator
from dstune.pretrained import build_model
from dstune.spec.models import VideoModelSpec
from loaded_models import CACHE_DIR, REPO

NAME = "builtin:tiny-ltx2"
SEED, STEP, INDICES = 7, 5, [3, 11]
TEXT_TOKENS = 32  # model.max_sequence_length: short to keep the test quick
FRAMES = 9  # 4k + 1 for the tiny VAE: 3 latent frames
FPS = 24.0  # ltx-trainer's DEFAULT_FPS
EXAMPLE = REPO / "launch" / "ltx2-lora-zero3-8gpu.yaml"


def load_tiny_ltx2(name: str = NAME, **settings):
    """builtin:tiny-ltx2 (or `name`: tiny-ltx2-3, tiny-ltx2-5) loaded on the CPU, at the tests' text length, with
    ltx-trainer's default sigma sampler."""
    spec = VideoModelSpec(
        family="video",
        pretrained=name,
        max_sequence_length=TEXT_TOKENS,
        timestep_sampling="shifted_logit_normal",
        **settings,
    )
    return build_model(spec, CACHE_DIR, "cpu")


def draws(purpose: str, normal: bool = False, indices=INDICES) -> torch.Tensor:
    make = torch.randn if normal else torch.rand
    return torch.cat([make((1,), generator=sample_generator(SEED, STEP, i, purpose)) for i in indices])


def reference_sigmas(scheme: str, seq_length: int, indices=INDICES) -> torch.Tensor:
    """ltx-trainer's timestep samplers, fed dstune's per-sample draws in place of torch.randn / torch.rand."""
    draw = lambda purpose, normal=False: draws(purpose, normal, indices)  # noqa: E731
    if scheme == "uniform":
        return draw("timestep") * (1.0 - 0.0) + 0.0
    std, eps, uniform_prob = 1.0, 1e-3, 0.1
    m = (2.05 - 0.95) / (4096 - 1024)
    mu = m * seq_length + (0.95 - m * 1024)
    logitnormal = torch.sigmoid(draw("timestep", normal=True) * std + mu)
    p999, p005 = torch.sigmoid(torch.tensor(mu + 3.0902 * std)), torch.sigmoid(torch.tensor(mu - 2.5758 * std))
    raw = (logitnormal - p005) / (p999 - p005)
    stretched = torch.clamp(torch.where(raw >= eps, raw, 2 * eps - raw), 0, 1)
    uniform = (1 - eps) * draw("timestep_uniform") + eps
    return torch.where(draw("timestep_mix") > uniform_prob, stretched, uniform)


def reference_positions(frames: int, height: int, width: int, scale: tuple[int, int, int]) -> torch.Tensor:
    """_get_video_positions: [B, 3, tokens, 2] pixel bounds of each latent patch, time in seconds."""
    grid = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij"))
    bounds = torch.stack((grid, grid + 1), dim=-1).flatten(1, 3)  # [3, tokens, 2]
    pixels = (bounds * torch.tensor(scale).view(3, 1, 1)).float()
    pixels[0] = (pixels[0] + 1 - scale[0]).clamp(min=0) / FPS
    return pixels.unsqueeze(0).repeat(len(INDICES), 1, 1, 1)


def reference_video_loss(built, encoded: dict, scheme: str) -> torch.Tensor:
    mean = encoded["latent_mean"]
    vae = built.vae
    latents = (
        (mean - vae.latents_mean.view(1, -1, 1, 1, 1))
        * vae.config.scaling_factor
        / vae.latents_std.view(1, -1, 1, 1, 1)
    )
    b, c, f, h, w = latents.shape
    video = latents.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
    noise = per_sample_randn((c, f, h, w), SEED, STEP, INDICES, "noise").permute(0, 2, 3, 4, 1).reshape(b, -1, c)
    sigmas = reference_sigmas(scheme, video.shape[1])
    noisy = (1 - sigmas.view(-1, 1, 1)) * video + sigmas.view(-1, 1, 1) * noise
    targets = noise - video
    timesteps = sigmas.view(-1, 1).expand(-1, video.shape[1])  # per-token, no conditioning tokens
    scale = tuple(built.transformer_config["vae_scale_factors"])
    with torch.no_grad():
        video_pred, _ = built.trainable(
            hidden_states=noisy,
            audio_hidden_states=torch.zeros(b, 1, built.transformer_config["audio_in_channels"]),
            encoder_hidden_states=encoded["encoder_hidden_states"],
            audio_encoder_hidden_states=encoded["audio_encoder_hidden_states"],
            timestep=timesteps * 1000,
            audio_timestep=sigmas * 1000,  # the absent audio modality's one token (its output is not read)
            sigma=sigmas * 1000,
            encoder_attention_mask=encoded["encoder_attention_mask"],
            audio_encoder_attention_mask=encoded["encoder_attention_mask"],
            video_coords=reference_positions(f, h, w, scale),
            audio_num_frames=1,
            isolate_modalities=True,
            return_dict=False,
        )
    per_sample = (video_pred - targets).pow(2).mean(dim=[-2, -1])
    return per_sample.mean()


def sound_batch(indices: list[int], rate: int) -> dict:
    """builtin:moving-shapes-av clips `indices` (9 frames at 24 fps, MP4 with AAC sound), with their sound read at
    the audio VAE's `rate`, collated as the video loader collates them."""
    from dstune.data.index import list_samples
    from dstune.data.video import VideoCaptionDataset, collate_video
    from dstune.spec.models import DataSpec

    data = DataSpec(path="builtin:moving-shapes-av", resolution=32, video={"frames": FRAMES})
    dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED, sound_rate=rate)
    return collate_video([dataset[i] for i in indices])


def reference_audio_latents(audio_vae, sound: torch.Tensor) -> torch.Tensor:
    """ltx-trainer's audio latents of stereo waveforms: AudioProcessor's log-mel (here transformers' audio_utils,
    which test_ltx2_audio.py checks against dstune's), the encoder's posterior means (the first half of its channels),
    patchified "b c t f -> b t (c f)" and normalised with the per-channel statistics."""
    import numpy as np
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    config = audio_vae.config
    filters = mel_filter_bank(513, config.mel_bins, 0.0, config.sample_rate / 2, config.sample_rate, "slaney", "slaney")
    mel = [
        [
            spectrogram(
                channel.numpy().astype(np.float64),
                window_function(1024, "hann", periodic=True),
                frame_length=1024,
                hop_length=config.mel_hop_length,
                power=1.0,
                center=True,
                pad_mode="reflect",
                mel_filters=filters,
                mel_floor=1e-5,
                log_mel="log",
            ).T
            for channel in clip
        ]
        for clip in sound
    ]
    with torch.no_grad():
        moments = audio_vae.encoder(torch.tensor(np.array(mel), dtype=torch.float32))
    means = torch.chunk(moments, 2, dim=1)[0]
    patched = means.permute(0, 2, 1, 3).flatten(2)
    return (patched - audio_vae.latents_mean) / audio_vae.latents_std


def reference_audio_positions(tokens: int, batch: int, config: dict) -> torch.Tensor:
    """ltx-core's AudioPatchifier.get_patch_grid_bounds: each latent step's [start, end) in seconds, the mel frames
    (x4) shifted by the causal offset (+1 - 4, clipped at 0), x hop / rate."""
    steps = torch.arange(tokens + 1, dtype=torch.float32)
    seconds = (steps * 4 + 1 - 4).clamp(min=0) * config["audio_hop_length"] / config["audio_sampling_rate"]
    bounds = torch.stack((seconds[:-1], seconds[1:]), dim=-1)  # [tokens, 2]
    return bounds.view(1, 1, tokens, 2).repeat(batch, 1, 1, 1)


def reference_av_loss(built, encoded: dict, sound: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """TextToVideoStrategy with with_audio true: the same sigma for both streams, the audio's own noise, every audio
    token at that sigma, targets noise - x0; per sample the video's mean plus the audio's mean; the batch mean."""
    vae, audio_vae = built.vae, built.parts["audio_vae"]
    mean = encoded["latent_mean"]
    latents = (mean - vae.latents_mean.view(1, -1, 1, 1, 1)) * vae.config.scaling_factor
    latents = latents / vae.latents_std.view(1, -1, 1, 1, 1)
    b, c, f, h, w = latents.shape
    video = latents.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
    noise = per_sample_randn((c, f, h, w), SEED, STEP, indices, "noise").permute(0, 2, 3, 4, 1).reshape(b, -1, c)
    sigmas = reference_sigmas("shifted_logit_normal", video.shape[1], indices).view(-1, 1, 1)
    audio = reference_audio_latents(audio_vae, sound)
    audio_noise = per_sample_randn(audio.shape[1:], SEED, STEP, indices, "audio_noise")
    noisy_audio = (1 - sigmas) * audio + sigmas * audio_noise
    config = built.transformer_config
    with torch.no_grad():
        video_pred, audio_pred = built.trainable(
            hidden_states=(1 - sigmas) * video + sigmas * noise,
            audio_hidden_states=noisy_audio,
            encoder_hidden_states=encoded["encoder_hidden_states"],
            audio_encoder_hidden_states=encoded["audio_encoder_hidden_states"],
            timestep=sigmas.view(-1, 1).expand(-1, video.shape[1]) * 1000,
            audio_timestep=sigmas.view(-1, 1).expand(-1, audio.shape[1]) * 1000,
            sigma=sigmas.view(-1) * 1000,
            encoder_attention_mask=encoded["encoder_attention_mask"],
            audio_encoder_attention_mask=encoded["encoder_attention_mask"],
            video_coords=reference_positions(f, h, w, tuple(config["vae_scale_factors"]))[:b],
            audio_coords=reference_audio_positions(audio.shape[1], b, config),
            return_dict=False,
        )
    video_loss = (video_pred - (noise - video)).pow(2).mean(dim=[-2, -1])
    audio_loss = (audio_pred - (audio_noise - audio)).pow(2).mean(dim=[-2, -1])
    return video_loss + audio_loss


def validate_example(capsys, monkeypatch, tmp_path, *sets: str) -> tuple[int, dict]:
    """(exit code, --json output) of `dstune validate` on the 8-GPU LTX-2 example spec with `sets` (--set values),
    from the real configs stored in the repository (an empty hub cache: nothing downloaded)."""
    import json

    import huggingface_hub.constants

    from dstune.cli import main

    monkeypatch.chdir(REPO)  # the stored Lightricks/LTX-2 configs, not a local download
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    code = main(
        [
            "validate",
            str(EXAMPLE.relative_to(REPO)),
            "--num-gpus",
            "8",
            "--num-samples",
            "2000",
            "--json",
            *[arg for value in sets for arg in ("--set", value)],
        ]
    )
    return code, json.loads(capsys.readouterr().out)
