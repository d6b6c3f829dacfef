"""Kandinsky 6 (its card and class, dstune.models.kandinsky6; model.family video, chosen by the folder) on
builtin:tiny-kandinsky6: the loss against the musubi-tuner fork's loss lines (fork_trainer.py: repository, file and
commit named there) on the same tiny model, batch and draws, the transformer's inputs, the pipeline's scheduler step
inverted, clips without sound, samples with sound, the export Kandinsky6TI2VAPipeline loads, and the folders it
refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of
from dstune.families.randomness import per_sample_randn, sample_generator
from dstune.models.kandinsky6.card import KANDINSKY6_CARD, LORA_TARGETS
from dstune.models.kandinsky6.model import Kandinsky6
from dstune.pretrained import build_model
from dstune.spec.models import VideoModelSpec
from .fork_trainer import fork_loss
from loaded_models import CACHE_DIR, with_settings

NAME = "builtin:tiny-kandinsky6"
SEED, STEP, INDICES = 7, 5, [0, 3]
TEXT_TOKENS = 560  # the byte-level tokenizer's template keeps ~500 tokens after the pipeline's 129-token crop
FRAMES = 9  # 3 latent frames


@pytest.fixture(scope="module")
def built():
    spec = VideoModelSpec(family="video", pretrained=NAME, max_sequence_length=TEXT_TOKENS, timestep_sampling="uniform")
    return build_model(spec, CACHE_DIR, "cpu")


def sound_batch(indices: list[int], rate: int, frames: int = FRAMES) -> dict:
    """builtin:moving-shapes-av clips (MP4 with sound) with their sound at `rate`, collated as the loader does."""
    from dstune.data.index import list_samples
    from dstune.data.video import VideoCaptionDataset, collate_video
    from dstune.spec.models import DataSpec

    data = DataSpec(path="builtin:moving-shapes-av", resolution=32, video={"frames": frames})
    dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED, sound_rate=rate)
    return collate_video([dataset[i] for i in indices])


def uniform(indices: list[int], purpose: str) -> torch.Tensor:
    return torch.cat([torch.rand((1,), generator=sample_generator(SEED, STEP, i, purpose)) for i in indices])


def reference(model, encoded: dict, image_to_video: bool = False) -> torch.Tensor:
    """The fork's loss of dstune's encoded batch at dstune's draws."""
    scale, audio_scale = model.vae.config.scaling_factor, model.parts["audio_vae"].config.scaling_factor
    latents = encoded["latent_mean"] * scale
    audio = encoded["sound_latent"] * audio_scale
    noise = per_sample_randn(latents.shape[1:], SEED, STEP, INDICES, "noise")
    audio_noise = per_sample_randn(audio.shape[1:][::-1], SEED, STEP, INDICES, "audio_noise").transpose(1, 2)
    shift = 1.0 if model.model_spec.shift is None else model.model_spec.shift
    with torch.no_grad():
        return fork_loss(
            model.trainable,
            latents,
            noise,
            uniform(INDICES, "timestep"),
            audio,
            audio_noise,
            uniform(INDICES, "audio_timestep"),
            encoded["has_sound"],
            encoded["encoder_hidden_states"],
            encoded["pooled_projections"],
            encoded["encoder_attention_mask"],
            shift,
            image_latent=latents[:, :, :1] if image_to_video else None,
        )


def test_builtin_is_a_kandinsky6_folder(built):
    assert card_of("video", tiny.ensure_builtin_model("tiny-kandinsky6", CACHE_DIR)) is KANDINSKY6_CARD
    assert built.card is KANDINSKY6_CARD and type(built) is Kandinsky6
    assert built.sound_rate == 44_100 and built.max_sequence_length == TEXT_TOKENS


@pytest.mark.parametrize("shift", [None, 3.0])
def test_loss_equals_the_forks_loss_lines(built, shift):
    """Text-to-video+audio at the fork's default --scheduler_scale (1.0) and at 3.0; the batch's clips have sound."""
    model = with_settings(built, shift=shift)
    encoded = model.encode_batch(sound_batch(INDICES, model.sound_rate))
    assert encoded["has_sound"].all() and encoded["encoder_hidden_states"].shape[1] == TEXT_TOKENS
    with torch.no_grad():
        ours = model.loss(model.trainable, encoded, SEED, STEP)
    assert ours.item() == pytest.approx(reference(model, encoded).item(), rel=1e-5)


def test_image_to_video_loss_equals_the_forks_ti2av_lines(built):
    """ti2av: the clip's first latent frame appended clean at the tail (mask 1, token type 1, temporal RoPE 0)."""
    model = with_settings(built, image_to_video=True)
    model.mode = True
    encoded = model.encode_batch(sound_batch(INDICES, model.sound_rate))
    with torch.no_grad():
        ours = model.loss(model.trainable, encoded, SEED, STEP)
        text_only = with_settings(built)
        text_only.mode = False
        plain = text_only.loss(text_only.trainable, encoded, SEED, STEP)
    assert ours.item() == pytest.approx(reference(model, encoded, image_to_video=True).item(), rel=1e-5)
    assert ours.item() != pytest.approx(plain.item(), rel=1e-5)  # the reference frame changes the prediction


def test_the_transformer_gets_each_streams_own_timestep_and_inputs(built):
    """The denoiser's inputs under dstune's loss: the video branch embeds sigma x 1000 of the video's u, the audio
    branch the sound's own (the fork's independent_time), the noisy clip in (B, F, H, W, 2C + 1) with zero
    conditioning channels, the noisy sound (B, T, C), the caption's states, pooled vector and mask."""
    encoded = built.encode_batch(sound_batch(INDICES, built.sound_rate))
    seen = {}

    def record(name):  # what the module embedded (a forward hook gets its arguments as its forward got them)
        return lambda module, args, output: seen.update({name: args[0].detach().clone()})

    hooks = [
        built.trainable.video_time_embeddings.register_forward_hook(record("video")),
        built.trainable.audio_time_embeddings.register_forward_hook(record("audio")),
        built.trainable.register_forward_pre_hook(lambda m, a, k: seen.update(inputs=k), with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            built.loss(built.trainable, encoded, SEED, STEP)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.allclose(seen["video"], uniform(INDICES, "timestep") * 1000)
    assert torch.allclose(seen["audio"], uniform(INDICES, "audio_timestep") * 1000)
    inputs = seen["inputs"]
    frames = encoded["latent_mean"].shape[2]
    assert inputs["hidden_states"].shape == (2, frames, 4, 4, 9) and not inputs["hidden_states"][..., 4:].any()
    assert inputs["audio_hidden_states"].shape == encoded["sound_latent"].transpose(1, 2).shape
    assert torch.equal(inputs["encoder_hidden_states"], encoded["encoder_hidden_states"])
    assert torch.equal(inputs["pooled_projections"], encoded["pooled_projections"])
    assert inputs["visual_token_type_ids"] is None and inputs["visual_rope_pos"] is None


def test_the_pipelines_scheduler_step_from_the_training_path_lands_on_it(built):
    """The objective is the pipeline's step inverted: from x_t = (1 - s) x0 + s noise, FlowMatchEulerDiscrete's step
    with dstune's target (noise - x0) as the model output lands on the path at the next sigma; the opposite sign
    misses it."""
    scheduler = built.sample_scheduler()
    scheduler.set_timesteps(8)
    x0, noise = torch.randn(1, 3, 4, 4, 4), torch.randn(1, 3, 4, 4, 4)
    for index in (0, 3, 6):
        scheduler._step_index = index
        sigma, following = scheduler.sigmas[index], scheduler.sigmas[index + 1]
        here = (1 - sigma) * x0 + sigma * noise
        landed = scheduler.step(noise - x0, scheduler.timesteps[index], here, return_dict=False)[0]
        scheduler._step_index = index
        missed = scheduler.step(x0 - noise, scheduler.timesteps[index], here, return_dict=False)[0]
        path = (1 - following) * x0 + following * noise
        assert torch.allclose(landed, path, atol=1e-5) and not torch.allclose(missed, path, atol=1e-2)


def test_clips_without_sound_add_nothing_of_their_sound(built):
    """A clip without sound: the fork's audio weight 0 (its sound's error left out, the others' averaged over the
    clips with sound); its video trains as any clip's."""
    encoded = built.encode_batch(sound_batch(INDICES, built.sound_rate))
    silent = {**encoded, "has_sound": torch.tensor([True, False])}
    with torch.no_grad():
        ours = built.loss(built.trainable, silent, SEED, STEP)
        parts = built.loss_parts()
    assert ours.item() == pytest.approx(reference(built, silent).item(), rel=1e-5)
    assert parts["audio"] > 0
    with torch.no_grad():
        built.loss(built.trainable, {**encoded, "has_sound": torch.tensor([False, False])}, SEED, STEP)
    assert built.loss_parts()["audio"] == 0.0


def test_samples_render_with_sound(built, tmp_path):
    """Samples: Kandinsky6TI2VAPipeline around the live transformer, each clip with the sound its vocoder renders
    (44.1 kHz, as long as the clip at 24 fps, to the audio VAE's latent step); written as an MP4 with sound."""
    import av

    from dstune.families.samples import ClipWithSound, save_clip_grid
    from dstune.spec.models import SampleSpec

    model = with_settings(built, sample_frames=FRAMES)
    clips = model.sample(model.trainable, ["a red circle moving left"], SampleSpec(steps=2, guidance=1.0), 32)
    clip = clips[0]
    assert isinstance(clip, ClipWithSound) and len(clip) == FRAMES and clip[0].size == (32, 32)
    assert clip.rate == 44_100 and clip.sound.shape[0] == 1
    assert clip.sound.shape[1] == -(-FRAMES * 44_100 // (24 * 1024)) * 1024 and abs(clip.sound).max() > 0
    save_clip_grid(clips, ["a red circle moving left"], tmp_path / "step-000001.png")
    with av.open(str(tmp_path / "step-000001" / "0.mp4")) as container:
        assert container.streams.audio and len(list(container.decode(container.streams.video[0]))) == FRAMES


def test_export_loads_in_its_pipeline_and_renders_with_sound_and_the_lora_loads(built, tmp_path):
    """The full export is a Kandinsky6TI2VAPipeline folder that loads and renders frames and sound with the trained
    weights; the LoRA file loads into the pipeline's transformer (load_lora_adapter) and gives the trained loss."""
    from diffusers import Kandinsky6TI2VAPipeline
    from safetensors.torch import load_file

    from dstune.families.lora import apply_train_mode, export_lora

    state = {name: value + 0.01 for name, value in built.trainable.state_dict().items()}
    out = built.export(state, tmp_path / "full")
    saved = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(saved[k], state[k]) for k in state)

    def render(folder):
        pipeline = Kandinsky6TI2VAPipeline.from_pretrained(folder)
        return pipeline(
            "a red circle moving left",
            height=32,
            width=32,
            num_frames=FRAMES,
            num_inference_steps=2,
            guidance_scale=1.0,
            max_sequence_length=TEXT_TOKENS,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        )

    trained, base = render(out), render(built.folder)
    assert trained.frames.shape == (1, FRAMES, 32, 32, 3) and trained.audio.shape[-1] > 0
    assert abs(trained.frames - base.frames).max() > 0

    spec = VideoModelSpec(
        family="video",
        pretrained=NAME,
        train="lora",
        lora={"target_modules": list(LORA_TARGETS)},
        max_sequence_length=TEXT_TOKENS,
        timestep_sampling="uniform",
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
    encoded = model.encode_batch(sound_batch([1], model.sound_rate))
    pipeline = Kandinsky6TI2VAPipeline.from_pretrained(model.folder)
    with torch.no_grad():
        base_loss = model.loss(pipeline.transformer, encoded, 0, 1)
    pipeline.transformer.load_lora_adapter(
        str(lora), weight_name="pytorch_lora_weights.safetensors", prefix="transformer"
    )
    with torch.no_grad():
        trained_loss = model.loss(model.trainable, encoded, 0, 1)
        loaded = with_loaded(model, pipeline.transformer).loss(pipeline.transformer, encoded, 0, 1)
    assert loaded.item() == pytest.approx(trained_loss.item(), rel=1e-6) and loaded.item() != base_loss.item()


def with_loaded(model, transformer):
    """The model's loss run on another transformer (the one its audio timestep goes to)."""
    from loaded_models import with_attributes

    return with_attributes(model, trainable=transformer)


def test_a_distilled_folder_is_refused_with_the_reason(tmp_path):
    """A PiFlow (distilled) folder: refused by the card before anything loads, saying why."""
    folder = tmp_path / "distilled"
    shutil.copytree(tiny.ensure_builtin_model("tiny-kandinsky6", CACHE_DIR), folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "PiflowScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))
    problems = KANDINSKY6_CARD.folder_problems(folder, VideoModelSpec(family="video", pretrained=str(folder)))
    assert len(problems) == 1 and "PiflowScheduler" in problems[0] and "distill" in problems[0]


def _validate(capsys, tmp_path, *sets: str) -> tuple[int, str]:
    import yaml

    from dstune.cli import main

    spec = {
        "model": {"family": "video", "pretrained": NAME, "timestep_sampling": "uniform"},
        "data": {"path": "builtin:moving-shapes-av", "resolution": 32, "video": {"frames": 5}},
        "train": {"micro_batch_size": 1, "max_steps": 2},
    }
    path = tmp_path / "kandinsky6.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["validate", str(path), "--num-gpus", "2", *[word for s in sets for word in ("--set", s)]])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_validate_plans_it_and_refuses_what_it_cannot_train_with_the_reason(capsys, tmp_path):
    """validate passes the tiny model's spec, and refuses, naming the key and why: the default LoRA targets (naming
    its layers), another sigma sampler, and image-to-video samples without first frames."""
    code, text = _validate(capsys, tmp_path)
    assert code == 0, text
    code, text = _validate(capsys, tmp_path, "model.train=lora")
    assert code == 1 and "model.lora.target_modules" in text and "to_query" in text
    code, text = _validate(capsys, tmp_path, "model.timestep_sampling=logit_normal")
    assert code == 1 and "model.timestep_sampling" in text and "uniform" in text
    code, text = _validate(capsys, tmp_path, "model.image_to_video=true", "sample.prompts=[a red circle]")
    assert code == 1 and "sample.control_images" in text and "first frame" in text


def test_validate_takes_a_sequence_split_by_the_video_heads_and_tokens_with_the_reference_frame(capsys, tmp_path):
    """dstune's split (dstune.models.kandinsky6.split) divides the video's 2 heads and the clip's tokens; the caption
    and the sound stay whole, so they set no rule. Image-to-video appends the first frame's latent to the clip's
    tokens: at 48 px a 5-frame clip is 2 x 3 x 3 = 18 tokens, which 2 divides, and with the reference frame
    3 x 3 x 3 = 27, which it does not (the split would fail at the first block)."""
    code, text = _validate(capsys, tmp_path, "deepspeed.sequence_parallel_size=2")
    assert code == 0, text
    assert "1 data-parallel x 2 sequence-parallel" in text and "8 tokens per sample -> 4 per rank" in text
    code, text = _validate(capsys, tmp_path, "deepspeed.sequence_parallel_size=2", "data.resolution=48")
    assert code == 0 and "18 tokens per sample -> 9 per rank" in text, text
    code, text = _validate(
        capsys, tmp_path, "deepspeed.sequence_parallel_size=2", "data.resolution=48", "model.image_to_video=true"
    )
    assert code == 1 and "deepspeed.sequence_parallel_size" in text and "5f 48x48: 27" in text, text


def test_the_sound_encodes_with_the_audio_vae_in_bf16(built):
    """diffusers' MMAudio front end multiplies a float32 magnitude by its filter bank: dstune keeps the front end in
    float32 so that a bf16 (mixed precision) or float64 audio VAE encodes; bf16's latents are float32's within
    bf16's precision."""
    import copy

    from dstune.models.kandinsky6.model import float32_front_end

    sound = sound_batch([0], built.sound_rate)["sound"]
    reference = built.encode_sound(sound)
    half = copy.deepcopy(built)
    half.parts = {**built.parts, "audio_vae": copy.deepcopy(built.parts["audio_vae"]).to(torch.bfloat16)}
    with pytest.raises(RuntimeError):  # diffusers' own front end in the VAE's dtype
        half.encode_sound(sound)
    float32_front_end(half.parts["audio_vae"])
    encoded = half.encode_sound(sound)
    assert encoded.dtype == torch.float32 and encoded.shape == reference.shape
    assert torch.allclose(encoded, reference, atol=0.1 * reference.abs().max().item())


def test_samples_from_cached_text_equal_the_pipelines_own_encoding(built):
    """A rank without the text encoders (the text cache, dstune.text_once) renders from the prompt's and the
    negative prompt's cached tensors (cut to the tokens some row uses: the pipeline's __call__ takes no mask) the
    same frames and sound as the pipeline encoding them itself, under guidance (the negative prompt: the pipeline's
    own default)."""
    import numpy as np
    from diffusers import Kandinsky6TI2VAPipeline

    from dstune.models.kandinsky6.card import NEGATIVE
    from dstune.spec.models import SampleSpec

    assert NEGATIVE == Kandinsky6TI2VAPipeline._DEFAULT_NEGATIVE_PROMPT
    spec = built.model_spec
    lean = build_model(spec, CACHE_DIR, "cpu", text_encoders=False)
    lean.trainable.load_state_dict(built.trainable.state_dict())
    prompt = "a red circle moving left"
    with torch.no_grad():
        tensors = built.encode_text([prompt, NEGATIVE])
    lean.prompt_text = {caption: {k: v[i] for k, v in tensors.items()} for i, caption in enumerate([prompt, NEGATIVE])}
    sample_spec = SampleSpec(steps=2, guidance=5.0)
    expected = built.sample(built.trainable, [prompt], sample_spec, 32)[0]
    rendered = lean.sample(lean.trainable, [prompt], sample_spec, 32)[0]
    frames = [np.stack([np.asarray(frame, dtype=np.float32) for frame in clip]) for clip in (rendered, expected)]
    # the trimmed rows (no padding, no mask) sum the attention in another order: at most one 8-bit level
    np.testing.assert_allclose(frames[0], frames[1], atol=1.0)
    np.testing.assert_allclose(np.asarray(rendered.sound), np.asarray(expected.sound), atol=1e-5)
