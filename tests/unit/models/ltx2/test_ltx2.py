"""LTX-2 (its card and class, dstune.models.ltx2; model.family video, chosen by the folder) on builtin:tiny-ltx2,
text-to-video: the video loss against ltx-trainer's loss lines (ltx_trainer.py) and its sigma samplers, the audio
stream kept out of the video-only loss, samples, the export LTX2Pipeline loads, the LoRA file its loader reads, the
text cache's keys, and `dstune validate` on the real LTX-2 configs. Sound: test_ltx2_audio.py; image-to-video:
test_ltx2_i2v.py."""

from __future__ import annotations

import pytest
import torch

from dstune.families import card_of
from dstune.pretrained import build_model
from dstune.spec.models import VideoModelSpec
from loaded_models import CACHE_DIR, with_settings
from tiny_batches import clip_batch

from .ltx_trainer import (
    FPS,
    FRAMES,
    INDICES,
    NAME,
    SEED,
    STEP,
    TEXT_TOKENS,
    draws,
    load_tiny_ltx2,
    reference_sigmas,
    reference_video_loss,
    validate_example,
)


@pytest.fixture(scope="module")
def built():
    return load_tiny_ltx2()


@pytest.mark.parametrize("scheme", ["shifted_logit_normal", "uniform"])
def test_video_loss_equals_ltx_trainers_loss_lines(built, scheme):
    model = with_settings(built, timestep_sampling=scheme)
    encoded = model.encode_batch(clip_batch(INDICES, SEED, frames=FRAMES))
    assert encoded["latent_mean"].shape[2:] == (3, 4, 4) and encoded["encoder_hidden_states"].shape[1] == TEXT_TOKENS
    with torch.no_grad():
        ours = model.loss(model.trainable, encoded, SEED, STEP)
    assert ours.item() == pytest.approx(reference_video_loss(model, encoded, scheme).item(), rel=1e-5)


@pytest.mark.parametrize("tokens", [48, 2000, 9000])
def test_sigma_draws_are_ltx_trainers_samplers(built, tokens):
    """Over 300 samples (about 30 of them the sampler's uniform fallback), at token counts below, inside and above
    the shift's 1024-4096 range: dstune's sigma per sample is ltx-trainer's sampler fed the same draws."""
    indices = list(range(300))
    latents = torch.zeros(len(indices), 1, 1, 1, tokens)
    for scheme in ("shifted_logit_normal", "uniform"):
        model = with_settings(built, timestep_sampling=scheme)
        _, ours = model.draw_sigmas(latents, SEED, STEP, indices)
        assert torch.allclose(ours, reference_sigmas(scheme, tokens, indices), atol=1e-6), scheme
    assert (draws("timestep_mix", indices=indices) <= 0.1).sum() > 10


def test_the_audio_stream_does_not_reach_the_video_loss(built):
    """Video-only training cuts the audio stream off (isolate_modalities): the video prediction is the same
    whatever audio tokens the transformer is given, as ltx-trainer's transformer without an audio modality."""
    encoded = built.encode_batch(clip_batch(INDICES[:1], SEED, frames=FRAMES))
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
    encoded = built.encode_batch(clip_batch(INDICES, SEED, frames=FRAMES))
    params = dict(built.trainable.named_parameters())
    assert all(p.requires_grad for p in params.values())  # full training: a missing gradient is the model's doing
    built.trainable.zero_grad(set_to_none=True)
    try:
        built.loss(built.trainable, encoded, SEED, STEP).backward()
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

    clips = built.sample(built.trainable, ["a red circle moving left"], SampleSpec(steps=2, guidance=1.0), 32)
    assert len(clips) == 1 and len(clips[0]) == 5 and clips[0][0].size == (32, 32)
    assert clips[0].rate == 16000 and clips[0].fps == FPS and clips[0].sound.shape[0] == 2  # the vocoder's sound
    webp = built.save_samples(clips, ["a red circle moving left"], tmp_path / "samples" / "step-000001.png")
    with av.open(str(webp.with_suffix("") / "0.mp4")) as container:  # each clip with its sound track
        assert len(container.streams.video) == 1 and container.streams.audio[0].rate == 16000
        assert sum(frame.samples for frame in container.decode(audio=0)) >= clips[0].sound.shape[1]
    page = write_contact_sheet(webp.parent, ["a red circle moving left"], "trained").read_text()
    assert page.count('<section id="step-1">') == 1 and 'src="step-000001/0.mp4"' in page  # one step, its sound
    state = {name: value + 0.01 for name, value in built.trainable.state_dict().items()}
    out = built.export(state, tmp_path / "full")
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
        family="video",
        pretrained=NAME,
        train="lora",
        max_sequence_length=TEXT_TOKENS,
        timestep_sampling="shifted_logit_normal",
    )
    model = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(model, spec, seed=0)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:  # B starts at zero: "train" it
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    lora = export_lora(
        model, {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}, tmp_path / "lora", spec
    )
    encoded = model.encode_batch(clip_batch([1], SEED, frames=FRAMES))
    pipeline = LTX2Pipeline.from_pretrained(model.folder)
    with torch.no_grad():
        base_loss = model.loss(pipeline.transformer, encoded, 0, 1)
    pipeline.load_lora_weights(str(lora), weight_name="pytorch_lora_weights.safetensors")
    with torch.no_grad():
        trained_loss, loaded = (model.loss(module, encoded, 0, 1) for module in (model.trainable, pipeline.transformer))
    assert loaded.item() == pytest.approx(trained_loss.item(), rel=1e-6) and loaded.item() != base_loss.item()


def test_text_cache_is_keyed_by_gemma_and_the_connectors_and_refusals(built):
    """The cached text is the connectors' output, so their folder keys the entries beside Gemma's; Wan folders
    refuse LTX-2's sampler."""
    from dstune.families.base import FamilyError

    card = card_of("video", built.folder)
    assert card.text_cache_folders == ("text_encoder", "tokenizer", "connectors")
    assert card.text_tensors == (
        "encoder_hidden_states",
        "audio_encoder_hidden_states",
        "encoder_attention_mask",
    )
    with pytest.raises(FamilyError, match="shifted_logit_normal is the sampler of the video models that draw sigma"):
        build_model(
            VideoModelSpec(family="video", pretrained="builtin:tiny-wan", timestep_sampling="shifted_logit_normal"),
            CACHE_DIR,
            "cpu",
        )


def test_validate_counts_ltx2_at_its_vae_compression_and_refuses_what_it_cannot_train(capsys, monkeypatch, tmp_path):
    """The real configs: the 18.9 B transformer, Gemma 3, the connectors and the audio VAE frozen (cached), the
    vocoder joining only for samples, the caches at the VAE's 8x/32x (121 frames at 512 px: 16 x 16 x 16 latents);
    frame counts that are 4k+1 (Wan's rule) but not 8k+1 (LTX-2's clip rule, the core's check), model.shift, a table-indexing sampler and a sequence split are refused, each at
    its key."""
    code, out = validate_example(capsys, monkeypatch, tmp_path)
    assert code == 0, out["errors"]
    counts = out["memory"]["parameters"]
    assert 18.5e9 < counts["module_params"] < 19.5e9
    assert set(counts["companions"]) == {"vae", "text_encoder", "connectors", "audio_vae"}  # the sound's encoder
    assert set(counts["sampling_companions"]) == {"vocoder"}
    code, out = validate_example(
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
    assert "109 is not 8k+1: LTX-2's VAE takes 8k+1 frames (1, 9, 17, ...," in errors, errors
    assert "use 105 or 113" in errors and "117 is not 8k+1" in errors
    assert "data.video.sampling" in errors and "sound (which LTX-2 trains on) cannot follow them" in errors


def test_validate_takes_a_sequence_split_of_ltx2_by_its_video_heads(capsys, monkeypatch, tmp_path):
    """dstune's split (dstune.models.ltx2.split) divides the video stream's 32 heads and the clip's tokens; the caption
    and the audio stream stay whole, so they set no rule. The activations shrink N-fold, the all-to-all buffers
    are the clip's (query, key, value and output of 4,096 tokens / N, 32 x 128 wide, in bf16, sent and received).
    The tokens are counted at the VAE's 8x in time: 9 frames at 480 px are 2 x 15 x 15 = 450 tokens, which 2 divides
    and 4 does not (at 4x, 3 x 15 x 15 = 675, 2 would be refused). A split run trains the sound too, whole on every
    rank: its activations are more than half the unsplit run's with sound, and the sound adds less to them than to
    the unsplit run's (its video tokens' cross-modal share is split)."""
    from dstune.models.ltx2 import card

    code, with_sound = validate_example(capsys, monkeypatch, tmp_path)
    assert code == 0, with_sound["errors"]
    monkeypatch.setattr(card, "audio_tokens", lambda spec, folder, frames: 0)
    code, whole = validate_example(capsys, monkeypatch, tmp_path)
    assert code == 0, whole["errors"]
    monkeypatch.undo()
    code, out = validate_example(capsys, monkeypatch, tmp_path, "deepspeed.sequence_parallel_size=2")
    assert code == 0, out["errors"]
    assert out["plan"]["sequence_parallel_size"] == 2 and out["plan"]["data_parallel_size"] == 4
    assert out["memory"]["sequence_parallel"]["all_to_all_bytes"] == 2 * 4 * (4096 // 2) * 32 * 128 * 2
    split, joint, silent = (run["memory"]["per_gpu"]["activations_bytes"] for run in (out, with_sound, whole))
    assert joint / 2 < split and split - silent / 2 < joint - silent
    short = ("data.video.frames=9", "model.sample_frames=9", "data.resolution=480")
    code, out = validate_example(capsys, monkeypatch, tmp_path, *short, "deepspeed.sequence_parallel_size=2")
    assert code == 0, out["errors"]
    code, out = validate_example(capsys, monkeypatch, tmp_path, *short, "deepspeed.sequence_parallel_size=4")
    errors = "\n".join(out["errors"])
    assert code == 1 and "deepspeed.sequence_parallel_size" in errors and "9f 480x480: 450" in errors, errors
