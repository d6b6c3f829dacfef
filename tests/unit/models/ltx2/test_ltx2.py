"""LTX-2 (model.family wan, chosen by the folder) on builtin:tiny-ltx2: the video loss against ltx-trainer's loss
lines, samples, the export LTX2Pipeline loads, the LoRA file its loader reads, and the text cache's keys; and
image-to-video (model.image_to_video) against ltx-trainer's first-frame conditioning, rendered by
LTX2ImageToVideoPipeline.

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

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dstune.families import video as wan
from dstune.families.randomness import per_sample_randn, sample_generator
from dstune.pretrained import build_model
from dstune.spec.models import VideoModelSpec
from tiny_batches import clip_batch

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
NAME = "builtin:tiny-ltx2"
SEED, STEP, INDICES = 7, 5, [3, 11]
TEXT_TOKENS = 32  # model.max_sequence_length: short to keep the test quick
FRAMES = 9  # 4k + 1 for the tiny VAE: 3 latent frames
FPS = 24.0  # ltx-trainer's DEFAULT_FPS


@pytest.fixture(scope="module")
def built():
    return build_model(
        VideoModelSpec(
            family="wan", pretrained=NAME, max_sequence_length=TEXT_TOKENS, timestep_sampling="shifted_logit_normal"
        ),
        CACHE_DIR,
        "cpu",
    )


def _draws(purpose: str, normal: bool = False, indices=INDICES) -> torch.Tensor:
    make = torch.randn if normal else torch.rand
    return torch.cat([make((1,), generator=sample_generator(SEED, STEP, i, purpose)) for i in indices])


def _reference_sigmas(scheme: str, seq_length: int, indices=INDICES) -> torch.Tensor:
    """ltx-trainer's timestep samplers, fed dstune's per-sample draws in place of torch.randn / torch.rand."""
    draw = lambda purpose, normal=False: _draws(purpose, normal, indices)  # noqa: E731
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


def _reference_positions(frames: int, height: int, width: int, scale: tuple[int, int, int]) -> torch.Tensor:
    """_get_video_positions: [B, 3, tokens, 2] pixel bounds of each latent patch, time in seconds."""
    grid = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij"))
    bounds = torch.stack((grid, grid + 1), dim=-1).flatten(1, 3)  # [3, tokens, 2]
    pixels = (bounds * torch.tensor(scale).view(3, 1, 1)).float()
    pixels[0] = (pixels[0] + 1 - scale[0]).clamp(min=0) / FPS
    return pixels.unsqueeze(0).repeat(len(INDICES), 1, 1, 1)


def _reference_loss(built, encoded: dict, scheme: str) -> torch.Tensor:
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
    sigmas = _reference_sigmas(scheme, video.shape[1])
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
            sigma=sigmas * 1000,
            encoder_attention_mask=encoded["encoder_attention_mask"],
            audio_encoder_attention_mask=encoded["encoder_attention_mask"],
            video_coords=_reference_positions(f, h, w, scale),
            audio_num_frames=1,
            isolate_modalities=True,
            return_dict=False,
        )
    per_sample = (video_pred - targets).pow(2).mean(dim=[-2, -1])
    return per_sample.mean()


@pytest.mark.parametrize("scheme", ["shifted_logit_normal", "uniform"])
def test_video_loss_equals_ltx_trainers_loss_lines(built, scheme):
    model = replace(built, settings=built.settings.model_copy(update={"timestep_sampling": scheme}))
    encoded = wan.encode_batch(model, clip_batch(INDICES, SEED, frames=FRAMES))
    assert encoded["latent_mean"].shape[2:] == (3, 4, 4) and encoded["encoder_hidden_states"].shape[1] == TEXT_TOKENS
    with torch.no_grad():
        ours = wan.loss(model, model.trainable, encoded, SEED, STEP)
    assert ours.item() == pytest.approx(_reference_loss(model, encoded, scheme).item(), rel=1e-5)


# ------------------------------------------------------------------------------------------ audio + video


def _sound_batch(indices: list[int], rate: int) -> dict:
    """builtin:moving-shapes-av clips `indices` (9 frames at 24 fps, MP4 with AAC sound), with their sound read at
    the audio VAE's `rate`, collated as the video loader collates them."""
    from dstune.data.index import list_samples
    from dstune.data.video import VideoCaptionDataset, collate_video
    from dstune.spec.models import DataSpec

    data = DataSpec(path="builtin:moving-shapes-av", resolution=32, video={"frames": FRAMES})
    dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED, sound_rate=rate)
    return collate_video([dataset[i] for i in indices])


def _reference_audio_latents(audio_vae, sound: torch.Tensor) -> torch.Tensor:
    """ltx-trainer's audio latents of stereo waveforms: AudioProcessor's log-mel (here transformers' audio_utils,
    which tests/unit/test_ltx2_audio.py checks), the encoder's posterior means (the first half of its channels),
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


def _reference_audio_positions(tokens: int, batch: int, config: dict) -> torch.Tensor:
    """ltx-core's AudioPatchifier.get_patch_grid_bounds: each latent step's [start, end) in seconds, the mel frames
    (x4) shifted by the causal offset (+1 - 4, clipped at 0), x hop / rate."""
    steps = torch.arange(tokens + 1, dtype=torch.float32)
    seconds = (steps * 4 + 1 - 4).clamp(min=0) * config["audio_hop_length"] / config["audio_sampling_rate"]
    bounds = torch.stack((seconds[:-1], seconds[1:]), dim=-1)  # [tokens, 2]
    return bounds.view(1, 1, tokens, 2).repeat(batch, 1, 1, 1)


def _reference_av_loss(built, encoded: dict, sound: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """TextToVideoStrategy with with_audio true: the same sigma for both streams, the audio's own noise, every audio
    token at that sigma, targets noise - x0; per sample the video's mean plus the audio's mean; the batch mean."""
    vae, audio_vae = built.vae, built.parts["audio_vae"]
    mean = encoded["latent_mean"]
    latents = (mean - vae.latents_mean.view(1, -1, 1, 1, 1)) * vae.config.scaling_factor
    latents = latents / vae.latents_std.view(1, -1, 1, 1, 1)
    b, c, f, h, w = latents.shape
    video = latents.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
    noise = per_sample_randn((c, f, h, w), SEED, STEP, indices, "noise").permute(0, 2, 3, 4, 1).reshape(b, -1, c)
    sigmas = _reference_sigmas("shifted_logit_normal", video.shape[1], indices).view(-1, 1, 1)
    audio = _reference_audio_latents(audio_vae, sound)
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
            video_coords=_reference_positions(f, h, w, tuple(config["vae_scale_factors"]))[:b],
            audio_coords=_reference_audio_positions(audio.shape[1], b, config),
            return_dict=False,
        )
    video_loss = (video_pred - (noise - video)).pow(2).mean(dim=[-2, -1])
    audio_loss = (audio_pred - (audio_noise - audio)).pow(2).mean(dim=[-2, -1])
    return video_loss + audio_loss


def test_audio_video_loss_equals_ltx_trainers_loss_lines(built):
    """Clips with sound train both streams in one call; the loss is ltx-trainer's summed per-sample loss."""
    rate = built.parts["audio_vae"].config.sample_rate
    batch = _sound_batch(INDICES, rate)
    encoded = wan.encode_batch(built, batch)
    assert encoded["has_sound"].tolist() == [True, True] and encoded["sound_latent"].shape == (2, 2, 10, 4)
    with torch.no_grad():
        ours = wan.loss(built, built.trainable, encoded, SEED, STEP)
    reference = _reference_av_loss(built, encoded, batch["sound"], INDICES)
    assert ours.item() == pytest.approx(reference.mean().item(), rel=1e-5)
    video_only = dict(encoded, has_sound=torch.tensor([False, False]))
    with torch.no_grad():
        assert wan.loss(built, built.trainable, video_only, SEED, STEP).item() < ours.item()  # the audio term


def test_a_batch_mixing_clips_with_and_without_sound_calls_the_transformer_once_per_kind(built):
    """Clip 3 with its sound, clip 11 without: the batch loss is the mean of clip 3's audio+video loss (as if it were
    alone) and clip 11's video-only loss; the draws of each clip do not depend on its batch mate."""
    rate = built.parts["audio_vae"].config.sample_rate
    batch = _sound_batch(INDICES, rate)
    batch["has_sound"] = torch.tensor([True, False])
    encoded = wan.encode_batch(built, batch)
    calls = []

    def counting(**inputs):
        calls.append((inputs["hidden_states"].shape[0], inputs["isolate_modalities"]))
        return built.trainable(**inputs)

    with torch.no_grad():
        ours = wan.loss(built, counting, encoded, SEED, STEP)
    assert sorted(calls) == [(1, False), (1, True)]
    alone = {name: value[:1] if torch.is_tensor(value) else value for name, value in encoded.items()}
    with_sound = _reference_av_loss(built, alone, batch["sound"][:1], INDICES[:1])
    model = replace(built, settings=built.settings.model_copy(update={"timestep_sampling": "shifted_logit_normal"}))
    second = {name: value[1:] if torch.is_tensor(value) else value for name, value in encoded.items()}
    del second["has_sound"]
    with torch.no_grad():
        without = wan.loss(model, model.trainable, dict(second, indices=torch.tensor(INDICES[1:])), SEED, STEP)
    assert ours.item() == pytest.approx((with_sound.item() + without.item()) / 2, rel=1e-5)


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
    encoded = wan.encode_batch(built, batch)
    assert "sound_latent" not in encoded
    silent = {name: value for name, value in batch.items() if name not in ("sound", "has_sound")}
    with torch.no_grad():
        ours = wan.loss(built, built.trainable, encoded, SEED, STEP)
        video_only = wan.loss(built, built.trainable, wan.encode_batch(built, silent), SEED, STEP)
    assert ours.item() == video_only.item()


@pytest.mark.parametrize("tokens", [48, 2000, 9000])
def test_sigma_draws_are_ltx_trainers_samplers(built, tokens):
    """Over 300 samples (about 30 of them the sampler's uniform fallback), at token counts below, inside and above
    the shift's 1024-4096 range: dstune's sigma per sample is ltx-trainer's sampler fed the same draws."""
    indices = list(range(300))
    latents = torch.zeros(len(indices), 1, 1, 1, tokens)
    for scheme in ("shifted_logit_normal", "uniform"):
        model = replace(built, settings=built.settings.model_copy(update={"timestep_sampling": scheme}))
        ours = model.recipe.draw_sigmas(model, latents, SEED, STEP, indices)
        assert torch.allclose(ours, _reference_sigmas(scheme, tokens, indices), atol=1e-6), scheme
    assert (_draws("timestep_mix", indices=indices) <= 0.1).sum() > 10


def test_the_audio_stream_does_not_reach_the_video_loss(built):
    """Video-only training cuts the audio stream off (isolate_modalities): the video prediction is the same
    whatever audio tokens the transformer is given, as ltx-trainer's transformer without an audio modality."""
    encoded = wan.encode_batch(built, clip_batch(INDICES[:1], SEED, frames=FRAMES))
    tokens = torch.randn(1, 48, 8)
    common = dict(
        hidden_states=tokens,
        encoder_hidden_states=encoded["encoder_hidden_states"],
        audio_encoder_hidden_states=encoded["audio_encoder_hidden_states"],
        timestep=torch.tensor([500.0]),
        sigma=torch.tensor([500.0]),
        encoder_attention_mask=encoded["encoder_attention_mask"],
        audio_encoder_attention_mask=encoded["encoder_attention_mask"],
        num_frames=3,
        height=4,
        width=4,
        isolate_modalities=True,
        return_dict=False,
    )
    with torch.no_grad():
        one, _ = built.trainable(audio_hidden_states=torch.zeros(1, 1, 8), audio_num_frames=1, **common)
        other, _ = built.trainable(audio_hidden_states=torch.randn(1, 5, 8), audio_num_frames=5, **common)
        crossed, _ = built.trainable(
            audio_hidden_states=torch.randn(1, 5, 8), audio_num_frames=5, **{**common, "isolate_modalities": False}
        )
    assert torch.allclose(one, other, atol=1e-6) and not torch.allclose(one, crossed, atol=1e-4)


def test_video_only_training_gives_the_audio_stream_no_gradient(built):
    """The video loss reaches no parameter of the audio stream or of the cross-modal attention (isolate_modalities):
    under sequence parallelism (dstune.models.ltx2.split) that stream runs whole on every rank of a group, and
    since its gradients are none, nothing of it is summed N times. Every other parameter gets a gradient."""
    import re

    audio_side = re.compile(r"audio|a2v|v2a|^av_cross_attn")
    encoded = wan.encode_batch(built, clip_batch(INDICES, SEED, frames=FRAMES))
    params = dict(built.trainable.named_parameters())
    assert all(p.requires_grad for p in params.values())  # full training: a missing gradient is the model's doing
    built.trainable.zero_grad(set_to_none=True)
    try:
        wan.loss(built, built.trainable, encoded, SEED, STEP).backward()
        without = {name for name, p in params.items() if p.grad is None}
    finally:
        built.trainable.zero_grad(set_to_none=True)
    assert without == {name for name in params if audio_side.search(name)}
    assert len(without) > 100 and "audio_proj_in.weight" in without and "proj_in.weight" not in without


def test_samples_render_clips_and_the_export_loads_and_renders(built, tmp_path):
    """Samples: the folder's LTX2Pipeline around the live transformer, model.sample_frames frames each, with the
    sound it renders (saved beside the grid as one MP4 with an AAC track per clip). The full
    export is an LTX2Pipeline folder (the trained transformer, every other part copied) that loads and renders video
    and audio."""
    import av
    from diffusers import LTX2Pipeline
    from safetensors.torch import load_file

    from dstune.families.samples import write_contact_sheet
    from dstune.spec.models import SampleSpec

    clips = wan.sample(built, built.trainable, ["a red circle moving left"], SampleSpec(steps=2, guidance=1.0), 32)
    assert len(clips) == 1 and len(clips[0]) == 5 and clips[0][0].size == (32, 32)
    assert clips[0].rate == 16000 and clips[0].fps == FPS and clips[0].sound.shape[0] == 2  # the vocoder's sound
    webp = wan.FAMILY.save_samples(clips, ["a red circle moving left"], tmp_path / "samples" / "step-000001.png")
    with av.open(str(webp.with_suffix("") / "0.mp4")) as container:  # each clip with its sound track
        assert len(container.streams.video) == 1 and container.streams.audio[0].rate == 16000
        assert sum(frame.samples for frame in container.decode(audio=0)) >= clips[0].sound.shape[1]
    page = write_contact_sheet(webp.parent, ["a red circle moving left"], "trained").read_text()
    assert page.count('<section id="step-1">') == 1 and 'src="step-000001/0.mp4"' in page  # one step, its sound
    state = {name: value + 0.01 for name, value in built.trainable.state_dict().items()}
    out = wan.export(built, state, tmp_path / "full")
    saved = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(saved[k], state[k]) for k in state)
    pipeline = LTX2Pipeline.from_pretrained(out)
    result = pipeline(
        "a red circle moving left",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=TEXT_TOKENS,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    assert result.frames.shape == (1, 9, 32, 32, 3) and torch.isfinite(torch.as_tensor(result.frames)).all()
    assert result.audio.shape[:2] == (1, 2) and torch.isfinite(result.audio).all()


def test_the_lora_file_loads_with_ltx2_pipelines_loader(tmp_path):
    """train: lora writes pytorch_lora_weights.safetensors with LTX2Pipeline's own writer; load_lora_weights reads
    it and gives the trained adapters' loss."""
    from diffusers import LTX2Pipeline

    from dstune.families.lora import apply_train_mode, export_lora

    spec = VideoModelSpec(
        family="wan",
        pretrained=NAME,
        train="lora",
        max_sequence_length=TEXT_TOKENS,
        timestep_sampling="shifted_logit_normal",
    )
    model = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(model.trainable, spec, seed=0, family=wan.FAMILY)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:  # B starts at zero: "train" it
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    lora = export_lora(
        wan.FAMILY,
        model,
        {k: v.detach().clone() for k, v in model.trainable.state_dict().items()},
        tmp_path / "lora",
        spec,
    )
    encoded = wan.encode_batch(model, clip_batch([1], SEED, frames=FRAMES))
    pipeline = LTX2Pipeline.from_pretrained(model.folder)
    with torch.no_grad():
        base_loss = wan.loss(model, pipeline.transformer, encoded, 0, 1)
    pipeline.load_lora_weights(str(lora), weight_name="pytorch_lora_weights.safetensors")
    with torch.no_grad():
        trained_loss, loaded = (
            wan.loss(model, module, encoded, 0, 1) for module in (model.trainable, pipeline.transformer)
        )
    assert loaded.item() == pytest.approx(trained_loss.item(), rel=1e-6) and loaded.item() != base_loss.item()


def test_text_cache_is_keyed_by_gemma_and_the_connectors_and_refusals(built):
    """The cached text is the connectors' output, so their folder keys the entries beside Gemma's; Wan folders
    refuse LTX-2's sampler."""
    from dstune.families.base import FamilyError

    cache = wan.FAMILY.text_cache
    assert cache.folders_of(built.folder) == ("text_encoder", "tokenizer", "connectors")
    assert cache.tensors_of(built.folder) == (
        "encoder_hidden_states",
        "audio_encoder_hidden_states",
        "encoder_attention_mask",
    )
    with pytest.raises(FamilyError, match="shifted_logit_normal is the sampler of the video models that draw sigma"):
        build_model(
            VideoModelSpec(family="wan", pretrained="builtin:tiny-wan", timestep_sampling="shifted_logit_normal"),
            CACHE_DIR,
            "cpu",
        )


# ------------------------------------------------------------------------------------------ dstune validate

EXAMPLE = REPO / "launch" / "ltx2-lora-zero3-8gpu.yaml"


def _validate(capsys, monkeypatch, tmp_path, *sets: str) -> tuple[int, dict]:
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


def test_validate_counts_ltx2_at_its_vae_compression_and_refuses_what_it_cannot_train(capsys, monkeypatch, tmp_path):
    """The real configs: the 18.9 B transformer, Gemma 3, the connectors and the audio VAE frozen (cached), the
    vocoder joining only for samples, the caches at the VAE's 8x/32x (121 frames at 512 px: 16 x 16 x 16 latents);
    frame counts that are 4k+1 (Wan's rule, which the spec checks) but not 8k+1, model.shift, a table-indexing sampler and a sequence split are refused, each at
    its key."""
    code, out = _validate(capsys, monkeypatch, tmp_path)
    assert code == 0, out["errors"]
    counts = out["memory"]["parameters"]
    assert 18.5e9 < counts["module_params"] < 19.5e9
    assert set(counts["companions"]) == {"vae", "text_encoder", "connectors", "audio_vae"}  # the sound's encoder
    assert set(counts["sampling_companions"]) == {"vocoder"}
    code, out = _validate(
        capsys,
        monkeypatch,
        tmp_path,
        "data.video.frames=109",
        "model.sample_frames=117",
        "model.shift=3.0",
        "model.timestep_sampling=logit_normal",
        "data.video.sampling=uniform",
    )
    errors = "\n".join(out["errors"])
    assert code == 1
    for key in ("data.video.frames", "model.sample_frames", "model.shift", "model.timestep_sampling"):
        assert key in errors, (key, errors)
    assert "109 frames: LTX-2's VAE takes 8k+1 frames" in errors and "117 is not 8k+1" in errors
    assert "data.video.sampling" in errors and "sound (which LTX-2 trains on) cannot follow them" in errors


def test_validate_takes_a_sequence_split_of_ltx2_by_its_video_heads(capsys, monkeypatch, tmp_path):
    """dstune's split (dstune.models.ltx2.split) divides the video stream's 32 heads and the clip's tokens; the caption
    and the audio stream stay whole, so they set no rule. The activations shrink N-fold, the all-to-all buffers
    are the clip's (query, key, value and output of 4,096 tokens / N, 32 x 128 wide, in bf16, sent and received).
    The tokens are counted at the VAE's 8x in time: 9 frames at 480 px are 2 x 15 x 15 = 450 tokens, which 2 divides
    and 4 does not (at 4x, 3 x 15 x 15 = 675, 2 would be refused). A split run trains the sound too, whole on every
    rank: its activations are more than half the unsplit run's with sound, and the sound adds less to them than to
    the unsplit run's (its video tokens' cross-modal share is split)."""
    from dstune.models.ltx2 import facts

    code, with_sound = _validate(capsys, monkeypatch, tmp_path)
    assert code == 0, with_sound["errors"]
    monkeypatch.setattr(facts, "audio_tokens", lambda spec, folder, frames: 0)
    code, whole = _validate(capsys, monkeypatch, tmp_path)
    assert code == 0, whole["errors"]
    monkeypatch.undo()
    code, out = _validate(capsys, monkeypatch, tmp_path, "deepspeed.sequence_parallel_size=2")
    assert code == 0, out["errors"]
    assert out["plan"]["sequence_parallel_size"] == 2 and out["plan"]["data_parallel_size"] == 4
    assert out["memory"]["sequence_parallel"]["all_to_all_bytes"] == 2 * 4 * (4096 // 2) * 32 * 128 * 2
    split, joint, silent = (run["memory"]["per_gpu"]["activations_bytes"] for run in (out, with_sound, whole))
    assert joint / 2 < split and split - silent / 2 < joint - silent
    short = ("data.video.frames=9", "model.sample_frames=9", "data.resolution=480")
    code, out = _validate(capsys, monkeypatch, tmp_path, *short, "deepspeed.sequence_parallel_size=2")
    assert code == 0, out["errors"]
    code, out = _validate(capsys, monkeypatch, tmp_path, *short, "deepspeed.sequence_parallel_size=4")
    errors = "\n".join(out["errors"])
    assert code == 1 and "deepspeed.sequence_parallel_size" in errors and "9f 480x480: 450" in errors, errors


def test_under_a_sequence_split_the_sound_loss_gradient_is_divided_by_the_split(built):
    """Every rank of a sequence group computes the whole sound stream and its loss (dstune.models.ltx2.split), and
    the group sums gradients, so the core divides the sound loss's gradient by the split size, its value kept:
    the audio output projection (which only the sound's loss reads) gets half its gradient at a split of 2, the
    video output projection (which only the video's loss reads) the same gradient. The 2-rank runs of
    tests/dist/test_sequence_parallel.py check the whole step against one rank's."""
    batch = _sound_batch(INDICES, built.sound_rate)
    encoded = wan.encode_batch(built, batch)
    assert encoded["has_sound"].all()

    def loss_and_gradients(split: int):
        built.trainable.zero_grad(set_to_none=True)
        built.sequence_split = split
        try:
            loss = wan.loss(built, built.trainable, encoded, SEED, STEP)
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


# ------------------------------------------------------------------------------------------ image-to-video


@pytest.fixture(scope="module")
def i2v():
    return build_model(
        VideoModelSpec(
            family="wan",
            pretrained=NAME,
            max_sequence_length=TEXT_TOKENS,
            timestep_sampling="shifted_logit_normal",
            image_to_video=True,
        ),
        CACHE_DIR,
        "cpu",
    )


def _reference_i2v_loss(built, encoded: dict, indices: list[int], sound=None) -> torch.Tensor:
    """ltx-trainer's first-frame conditioning (TextToVideoStrategy with first_frame_conditioning_p 1, the flexible
    strategy's first_frame condition at probability 1 computes the same): the first latent frame's tokens (h x w)
    are the clean latents, their per-token timesteps 0, the others' sigma; the video loss per sample is the squared
    error times the loss mask (not the conditioning tokens), its mean over tokens and channels divided by the mask's
    mean; with sound, the audio at sigma on every token, its mean squared error added."""
    vae, config = built.vae, built.transformer_config
    mean = encoded["latent_mean"]
    latents = (mean - vae.latents_mean.view(1, -1, 1, 1, 1)) * vae.config.scaling_factor
    latents = latents / vae.latents_std.view(1, -1, 1, 1, 1)
    b, c, f, h, w = latents.shape
    video = latents.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
    noise = per_sample_randn((c, f, h, w), SEED, STEP, indices, "noise").permute(0, 2, 3, 4, 1).reshape(b, -1, c)
    sigmas = _reference_sigmas("shifted_logit_normal", video.shape[1], indices)
    conditioning_mask = torch.zeros(b, video.shape[1], dtype=torch.bool)
    conditioning_mask[:, : h * w] = True
    noisy = (1 - sigmas.view(-1, 1, 1)) * video + sigmas.view(-1, 1, 1) * noise
    noisy = torch.where(conditioning_mask.unsqueeze(-1), video, noisy)
    timesteps = torch.where(conditioning_mask, 0.0, sigmas.view(-1, 1).expand_as(conditioning_mask))
    audio_inputs = dict(audio_hidden_states=torch.zeros(b, 1, config["audio_in_channels"]), audio_num_frames=1)
    if sound is not None:
        audio = _reference_audio_latents(built.parts["audio_vae"], sound)
        audio_noise = per_sample_randn(audio.shape[1:], SEED, STEP, indices, "audio_noise")
        audio_inputs = dict(
            audio_hidden_states=(1 - sigmas.view(-1, 1, 1)) * audio + sigmas.view(-1, 1, 1) * audio_noise,
            audio_timestep=sigmas.view(-1, 1).expand(-1, audio.shape[1]) * 1000,
            audio_coords=_reference_audio_positions(audio.shape[1], b, config),
        )
    with torch.no_grad():
        video_pred, audio_pred = built.trainable(
            hidden_states=noisy,
            encoder_hidden_states=encoded["encoder_hidden_states"],
            audio_encoder_hidden_states=encoded["audio_encoder_hidden_states"],
            timestep=timesteps * 1000,
            sigma=sigmas * 1000,
            encoder_attention_mask=encoded["encoder_attention_mask"],
            audio_encoder_attention_mask=encoded["encoder_attention_mask"],
            video_coords=_reference_positions(f, h, w, tuple(config["vae_scale_factors"]))[:b],
            isolate_modalities=sound is None,
            return_dict=False,
            **audio_inputs,
        )
    loss_mask = (~conditioning_mask).unsqueeze(-1).float()
    masked = (video_pred - (noise - video)).pow(2).mul(loss_mask)
    per_sample = masked.mean(dim=[-2, -1]) / loss_mask.mean(dim=[-2, -1]).clamp(min=1e-8)
    if sound is not None:
        per_sample = per_sample + (audio_pred - (audio_noise - audio)).pow(2).mean(dim=[-2, -1])
    return per_sample.mean()


def test_image_to_video_loss_equals_ltx_trainers_first_frame_conditioning(i2v):
    """model.image_to_video: the clip's first latent frame clean at timestep 0, the loss over the other frames'
    tokens: ltx-trainer's loss lines, video alone and with the clips' sound. The first latent frame is the first
    pixel frame's alone (a causal VAE), which is what LTX2ImageToVideoPipeline encodes from the given image."""
    from dstune.families.flow_core import vae_posterior

    assert i2v.mode is True and i2v.recipe.conditioning.clean_frames(i2v) == 1
    batch = clip_batch(INDICES, SEED, frames=FRAMES)
    encoded = wan.encode_batch(i2v, batch)
    alone, _ = vae_posterior(i2v.vae, batch["pixel_values"][:, :, :1])
    assert torch.allclose(alone, encoded["latent_mean"][:, :, :1], atol=1e-5)
    with torch.no_grad():
        ours = wan.loss(i2v, i2v.trainable, encoded, SEED, STEP)
        text_to_video = wan.loss(replace(i2v, mode=False), i2v.trainable, encoded, SEED, STEP)
    assert ours.item() == pytest.approx(_reference_i2v_loss(i2v, encoded, INDICES).item(), rel=1e-5)
    assert abs(ours.item() - text_to_video.item()) > 1e-4
    sound_batch = _sound_batch(INDICES, i2v.parts["audio_vae"].config.sample_rate)
    encoded = wan.encode_batch(i2v, sound_batch)
    assert encoded["has_sound"].tolist() == [True, True]
    with torch.no_grad():
        ours = wan.loss(i2v, i2v.trainable, encoded, SEED, STEP)
    reference = _reference_i2v_loss(i2v, encoded, INDICES, sound=sound_batch["sound"])
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def test_image_to_video_refuses_a_clip_of_one_latent_frame(i2v):
    encoded = wan.encode_batch(i2v, clip_batch(INDICES, SEED, frames=1))
    with pytest.raises(ValueError, match="one latent frame"):
        wan.loss(i2v, i2v.trainable, encoded, SEED, STEP)


def test_image_to_video_samples_render_from_first_frames_and_the_export_loads_in_its_pipeline(i2v, tmp_path):
    """Samples: LTX2ImageToVideoPipeline around the live transformer from sample.control_images (another first
    frame, another clip); the export (an LTX2Pipeline folder, every part shared) loads in LTX2ImageToVideoPipeline
    and renders video and sound from an image."""
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    from dstune.families.base import FamilyError
    from dstune.spec.models import SampleSpec

    for name, colour in (("red", (200, 30, 30)), ("blue", (20, 40, 220))):
        Image.new("RGB", (32, 32), colour).save(tmp_path / f"{name}.png")
    clips = {
        name: wan.sample(
            i2v,
            i2v.trainable,
            ["a circle moving left"],
            SampleSpec(
                prompts=["a circle moving left"],
                steps=2,
                guidance=1.0,
                control_images=[str(tmp_path / f"{name}.png")],
            ),
            32,
        )[0]
        for name in ("red", "blue")
    }
    assert len(clips["red"]) == 5 and clips["red"][0].size == (32, 32) and clips["red"].sound.shape[0] == 2
    assert clips["red"][0].tobytes() != clips["blue"][0].tobytes()
    with pytest.raises(FamilyError, match="one image per prompt"):
        wan.sample(i2v, i2v.trainable, ["a circle"], SampleSpec(steps=2, guidance=1.0), 32)
    out = wan.export(i2v, i2v.trainable.state_dict(), tmp_path / "full")
    pipeline = LTX2ImageToVideoPipeline.from_pretrained(out)
    result = pipeline(
        image=Image.open(tmp_path / "red.png"),
        prompt="a circle moving left",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=TEXT_TOKENS,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    assert result.frames.shape == (1, 9, 32, 32, 3) and torch.isfinite(torch.as_tensor(result.frames)).all()
    assert result.audio.shape[:2] == (1, 2) and torch.isfinite(result.audio).all()


def test_validate_takes_ltx2_image_to_video_and_refuses_it_under_a_sequence_split(capsys, monkeypatch, tmp_path):
    """model.image_to_video on the real LTX-2 configs validates (samples from one first frame per prompt), its
    activations from the constants measured with a timestep per token (more than text-to-video's); with a sequence
    split it is refused at deepspeed.sequence_parallel_size (per-token timesteps are not split), and first frames
    that do not match the prompts at sample.control_images."""
    code, out = _validate(capsys, monkeypatch, tmp_path, "model.image_to_video=true", "sample.prompts=[]")
    assert code == 0, out["errors"]
    code, text_to_video = _validate(capsys, monkeypatch, tmp_path, "sample.prompts=[]")
    activations = out["memory"]["per_gpu"]["activations_bytes"]
    assert 1.0 < activations / text_to_video["memory"]["per_gpu"]["activations_bytes"] < 2.0
    code, out = _validate(
        capsys, monkeypatch, tmp_path, "model.image_to_video=true", "deepspeed.sequence_parallel_size=2"
    )
    errors = "\n".join(out["errors"])
    assert code == 1 and "deepspeed.sequence_parallel_size" in errors and "per-token" not in errors
    assert "its own timestep (the first frame's at 0)" in errors
    assert "sample.control_images" in errors and "one image per sample.prompts entry" in errors
