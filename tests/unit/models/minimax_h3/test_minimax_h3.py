"""MiniMax-H3 (its card and class, dstune.models.minimax_h3; a modular pipeline folder) on builtin:tiny-minimax-h3,
text-to-video with stereo sound: the card's facts against diffusers' own, the clip's latents in the VAE's pixel range,
the objective against the real MiniMaxH3Scheduler's step (from the training path, dstune's target lands on the path
at the next sigma; the opposite sign misses), the loss against a published trainer's loss lines on the same draws
(h3_trainer.py), samples with sound, the export MiniMaxH3ModularPipeline loads, and validate's refusals."""

from __future__ import annotations

import pytest
import torch
import yaml

from dstune.cli import main
from dstune.families.randomness import per_sample_randn
from dstune.models.minimax_h3 import card as h3
from dstune.models.minimax_h3.model import patchify, shifted
from dstune.pretrained import build_model
from dstune.spec.models import VideoModelSpec
from loaded_models import CACHE_DIR, with_settings

from .h3_trainer import trainer_fl2va_loss, trainer_keyframe_rows, trainer_loss, trainer_prompt

SEED, STEP, FRAMES, TEXT_TOKENS = 7, 3, 22, 16
SAMPLE_FRAMES = 124  # the shortest clip its pipeline renders (5 s at 24 fps, rounded up to 17k+5)


@pytest.fixture(scope="module")
def model():
    spec = VideoModelSpec(
        family="video", pretrained="builtin:tiny-minimax-h3", max_sequence_length=TEXT_TOKENS, sample_frames=124
    )
    return build_model(spec, CACHE_DIR, "cpu")


def clips(model, indices, path="builtin:moving-shapes-av"):
    from dstune.data.index import list_samples
    from dstune.data.video import VideoCaptionDataset, collate_video
    from dstune.spec.models import DataSpec

    data = DataSpec(path=path, video={"frames": FRAMES})
    dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED, model.sound_rate)
    return collate_video([dataset[i] for i in indices])


class Recorder:
    """The transformer, its keyword arguments kept; or an oracle's outputs in place of its own."""

    def __init__(self, transformer, outputs=None):
        self.transformer, self.outputs, self.calls = transformer, outputs, []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.outputs is not None:
            return self.outputs[len(self.calls) - 1]
        return self.transformer(**kwargs)


def test_the_cards_facts_are_the_pipelines(model):
    from diffusers import MiniMaxH3ModularPipeline
    from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as facts

    pipeline = MiniMaxH3ModularPipeline()
    assert pipeline.text_encoder_layer == h3.TEXT_LAYER and pipeline.fps == h3.FPS
    assert (pipeline.text_tag, pipeline.video_tag, pipeline.audio_tag) == (h3.TEXT_TAG, h3.VIDEO_TAG, h3.AUDIO_TAG)
    range_ = h3.MINIMAX_H3_CARD.pixel_range()
    assert (range_.low, range_.high, range_.mean, range_.std) == (0.0, 1.0, pipeline.pixel_mean, pipeline.pixel_std)
    assert (model.scheduler.shift, model.parts["audio_scheduler"].shift) == (h3.VIDEO_SHIFT, h3.AUDIO_SHIFT)
    assert (pipeline.min_duration, pipeline.max_duration) == (h3.MIN_SECONDS, h3.MAX_SECONDS)
    assert (pipeline.keyframe_encode_seed, pipeline.keyframe_noise_aug) == (h3.KEYFRAME_SEED, h3.KEYFRAME_LEVEL)
    rule = model.clip_rule()
    for frames in (22, 39, 124, 345):
        assert rule.latent_frames(frames) == facts.video_latent_num_frames(frames, 17, 5)
        assert h3.audio_rows(frames) == 2 * facts.audio_latent_num_frames(frames)


def test_a_clips_latents_are_the_vaes_mode_of_its_imagenet_normalised_pixels(model):
    """The data layer's [-1, 1] clip reaches the VAE as `uint8 / 255` normalised by ImageNet's statistics (the
    pipeline's own convention, encoders.encode_vae_condition's), the training latents the posterior's mode
    normalised by the VAE config's latents_mean / latents_std."""
    batch = clips(model, [0])
    encoded = model.encode_batch(batch)
    frames = ((batch["pixel_values"] + 1) * 127.5).round()  # the 8-bit frames the clip was read from
    mean = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1, 1)
    std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1, 1)
    with torch.no_grad():
        mode = model.vae.encode((frames / 255 - mean) / std).latent_dist.mode()
    assert torch.allclose(encoded["latent_mean"], mode, atol=1e-5)
    config = model.vae.config
    expected = (mode - torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)) / torch.tensor(config.latents_std).view(
        1, -1, 1, 1, 1
    )
    assert torch.allclose(model.model_latents(encoded, SEED, STEP), expected, atol=1e-5)
    assert encoded["latent_mean"].shape[2] == 7  # 22 frames -> 7 latent frames (17k+5 -> 5k+2)


def test_stepping_the_real_scheduler_from_the_training_path_lands_on_the_path_at_the_next_sigma(model):
    """The training step's inputs are the path x_t = (1 - sigma) x0 + sigma noise at timestep 1 - sigma, and its
    target is v = x0 - noise (a transformer that outputs exactly it has loss 0). From there the real
    MiniMaxH3Scheduler's step (video shift 12's sigma and the next one on its grid) lands on the path at the next
    sigma; the core's usual noise - x0 misses it."""
    from diffusers import MiniMaxH3Scheduler

    encoded = model.encode_batch(clips(model, [2]))
    x0 = patchify(model.model_latents(encoded, SEED, STEP), model.patch())
    noise = patchify(per_sample_randn(encoded["latent_mean"].shape[1:], SEED, STEP, [2], "noise"), model.patch())
    sigma, audio_sigma = model.draw_pair(SEED, STEP, [2])
    recorder = Recorder(model.trainable)
    with torch.no_grad():
        model.loss(recorder, encoded, SEED, STEP)
    [inputs] = recorder.calls
    x_t = inputs["hidden_states"][0]
    assert torch.allclose(x_t, (1 - sigma) * x0 + sigma * noise, atol=1e-6)
    video_row = inputs["video_indices"][0]
    assert inputs["timestep"][inputs["timestep_indices"][video_row]].item() == pytest.approx(1 - sigma.item())
    clean, sound_noise = model.clip_sound(encoded, 0, FRAMES, SEED, STEP, 2)
    oracle = Recorder(None, [((x0 - noise)[None], (clean - sound_noise)[None])])
    with torch.no_grad():
        assert model.loss(oracle, encoded, SEED, STEP).item() == pytest.approx(0.0, abs=1e-10)

    scheduler = MiniMaxH3Scheduler(shift=h3.VIDEO_SHIFT)
    nxt = float(sigma) * 0.6
    scheduler.set_timesteps(sigmas=[float(sigma), nxt, 0.0])
    target = (1 - nxt) * x0 + nxt * noise
    landed = scheduler.step(x0 - noise, scheduler.timesteps[0], x_t, return_dict=False)[0]
    assert (landed - target).abs().max() < 1e-5
    scheduler.set_timesteps(sigmas=[float(sigma), nxt, 0.0])
    missed = scheduler.step(noise - x0, scheduler.timesteps[0], x_t, return_dict=False)[0]
    assert (missed - target).abs().max() > 0.1


@pytest.mark.parametrize("path", ["builtin:moving-shapes-av", "builtin:moving-shapes"], ids=["sound", "silent"])
def test_the_loss_equals_the_published_trainers_loss_lines_on_the_same_draws(model, path):
    """One clip (with its sound; and a silent one, whose sound rows are zeros of the clip's length and carry no
    loss): dstune's loss and the transformer's inputs against AviadDahan/MiniMax-H3-Trainer's lines (h3_trainer.py)
    given the same target rows, u and noises."""
    from dstune.families.flow_matching import timestep_density

    index = 1
    encoded = model.encode_batch(clips(model, [index], path))
    latents = model.model_latents(encoded, SEED, STEP)
    recorder = Recorder(model.trainable)
    with torch.no_grad():
        ours = model.loss(recorder, encoded, SEED, STEP)
    u = float(timestep_density(model.model_spec, SEED, STEP, [index])[0])
    video_rows = patchify(latents, model.patch())
    noise = patchify(per_sample_randn(latents.shape[1:], SEED, STEP, [index], "noise"), model.patch())
    clean, sound_noise = model.clip_sound(encoded, 0, FRAMES, SEED, STEP, index)
    assert bool(clean.abs().sum() > 0) == (path == "builtin:moving-shapes-av")
    text = encoded["encoder_hidden_states"][0][encoded["encoder_attention_mask"][0].bool()]
    with torch.no_grad():
        theirs, kwargs = trainer_loss(
            model.trainable, u, video_rows, clean, text, noise, sound_noise, tuple(latents.shape[2:])
        )
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    [given] = recorder.calls
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "position_ids"):
        assert torch.allclose(given[name].float(), kwargs[name].float(), atol=1e-6), name
    for name in ("timestep_indices", "token_tags", "video_indices", "audio_indices", "text_indices"):
        assert torch.equal(given[name], kwargs[name]), name
    audio_t = given["timestep"][given["timestep_indices"][given["audio_indices"][0]]].item()
    assert 1 - float(shifted(torch.tensor(u), h3.AUDIO_SHIFT)) == pytest.approx(audio_t, abs=1e-6)


def sample_spec(steps=2):
    from dstune.spec.models import SampleSpec

    return SampleSpec(prompts=["a red square"], steps=steps, seed=0)


def test_an_export_loads_in_its_modular_pipeline_and_renders_with_sound_other_than_the_base(model, tmp_path):
    from diffusers import ModularPipeline

    from dstune.families.folders import modular_entries

    trained = {
        name: value + 0.05 * torch.randn(value.shape, generator=torch.Generator().manual_seed(1))
        for name, value in model.trainable.state_dict().items()
    }
    out = model.export(trained, tmp_path / "export")
    assert {entry["pretrained_model_name_or_path"] for entry in modular_entries(out).values() if entry.get("subfolder")}
    assert modular_entries(out)["transformer"]["pretrained_model_name_or_path"] == str(out.resolve())
    loaded = ModularPipeline.from_pretrained(str(out))
    loaded.load_components(names=["transformer"], dtype=torch.float32)
    for name, value in trained.items():
        assert torch.equal(loaded.transformer.state_dict()[name], value), name
    [base] = model.sample(model.trainable, ["a red square"], sample_spec(), 32)
    [clip] = model.sample(loaded.transformer, ["a red square"], sample_spec(), 32)
    assert len(clip) == len(base) == SAMPLE_FRAMES and clip.sound.shape == base.sound.shape
    assert clip.sound.shape[0] == 2 and clip.rate == 32000 and clip.fps == 24
    pixels = lambda frames: torch.tensor([list(f.getdata()) for f in frames], dtype=torch.float32)  # noqa: E731
    assert (pixels(clip) - pixels(base)).abs().max() > 0 or abs(clip.sound - base.sound).max() > 1e-4


def validate(capsys, tmp_path, **changes):
    spec = {
        "model": {"family": "video", "pretrained": "builtin:tiny-minimax-h3", "train": "lora", "sample_frames": 124},
        "data": {"path": "builtin:moving-shapes-av", "resolution": 32, "video": {"frames": FRAMES}},
        "train": {"micro_batch_size": 1, "max_steps": 2},
    }
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    capsys.readouterr()
    code = main(["validate", str(path), "--num-gpus", "2"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


def test_validate_takes_the_built_in_and_refuses_what_the_unit_does_not_train(capsys, tmp_path):
    code, text = validate(capsys, tmp_path)
    assert code == 0, text
    refusals = {
        "data.video.frames": (21, "21 is not 17k+5"),
        "data.video.fps": (30, "24 fps"),
        "model.sample_frames": (39, "120 to 360 frames"),
    }
    for key, (value, said) in refusals.items():
        code, text = validate(capsys, tmp_path, **{key: value, "sample.prompts": ["a red square"]})
        assert code == 1 and said in text and key in text, (key, text)


def test_validate_splits_the_packed_sequence_over_the_heads(capsys, tmp_path):
    """A sequence split of its one packed sequence: any caption length (the split pads the rows), so only the heads
    (2 in the tiny transformer) and the ranks bound N; validate shows the packed rows each rank holds."""
    code, text = validate(capsys, tmp_path, **{"deepspeed.sequence_parallel_size": 2, "deepspeed.zero_stage": 3})
    assert code == 0, text
    assert "22f 32x32: packed text <= 512 + sound 74 + video 7 rows, padded to a multiple of 2" in text
    assert "594 tokens per sample -> 297 per rank" in text  # 512 + 74 + 7 = 593, padded to 594
    code, text = validate(capsys, tmp_path, **{"deepspeed.sequence_parallel_size": 4, "deepspeed.zero_stage": 3})
    assert code == 1 and "deepspeed.sequence_parallel_size: 4" in text and "2 attention heads" in text, text


@pytest.mark.parametrize("caption", [5, 6])
def test_the_split_pads_the_packed_sequence_without_changing_the_prediction(caption):
    """The split's padding (dstune.models.minimax_h3.split, here without the ranks: the padded sequence whole) adds
    a row to an odd packed sequence and masks it as a key: the video's and the sound's predictions are the
    unpadded ones."""
    from diffusers import MiniMaxH3Transformer3DModel

    from dstune.models.minimax_h3.builtin import TINY_TRANSFORMER
    from dstune.models.minimax_h3.model import MiniMaxH3
    from dstune.models.minimax_h3.split import prepare_split

    torch.manual_seed(0)
    whole = MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER).eval()
    padded = MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER).eval()
    padded.load_state_dict(whole.state_dict())
    prepare_split(padded, 2)
    from types import SimpleNamespace

    from dstune.models.minimax_h3.card import TEXT_TAG

    holder = MiniMaxH3.__new__(MiniMaxH3)
    holder.transformer_config = dict(whole.config)
    holder.model_spec = SimpleNamespace(image_to_video=False)  # t2va: no keyframe rows
    clip = torch.randn(1, 4, 3, 4, 4)
    video = patchify(clip, (1, 2, 2))
    tags = torch.full((caption,), TEXT_TAG, dtype=torch.long)
    no_keyframe = video[:0]
    inputs = holder.packed_inputs(
        torch.randn(caption, 16), tags, no_keyframe, video, torch.randn(10, 4), clip.shape, (0.7, 0.4), torch.float32
    )
    assert (len(inputs["position_ids"]) % 2 == 1) == (caption == 5)  # 5 text + 10 sound + 12 video rows: odd
    with torch.no_grad():
        expected, got = whole(**inputs), padded(**inputs)
    for one, other in zip(expected, got):
        assert one.shape == other.shape
        torch.testing.assert_close(other, one, rtol=1e-5, atol=1e-6)


def test_an_empty_caption_is_no_text_rows_and_trains(model):
    """A dropped caption (data.caption_dropout) and the samples' negative are "": the caption has no tokens, so it
    is no text rows (the text encoder takes no empty sequence), and the clip trains on its sound and video alone."""
    encoded = model.encode_batch({**clips(model, [0]), "caption": [""]})
    assert encoded["encoder_attention_mask"].sum() == 0
    recorder = Recorder(model.trainable)
    with torch.no_grad():
        loss = model.loss(recorder, encoded, SEED, STEP)
    assert torch.isfinite(loss) and recorder.calls[0]["text_indices"].numel() == 0


def test_a_batchs_loss_is_the_mean_of_its_clips_losses_under_a_per_sample_weighting(model):
    """Each clip is its own packed forward with its own draws (by its dataset index), so a micro batch of two is the
    mean of the two alone, with a per-sample loss weighting (cosmap) too: each clip's weight at its own sigma."""
    weighted = with_settings(model, loss_weighting="cosmap")
    with torch.no_grad():
        both = weighted.loss(weighted.trainable, weighted.encode_batch(clips(model, [3, 4])), SEED, STEP)
        alone = [
            weighted.loss(weighted.trainable, weighted.encode_batch(clips(model, [i])), SEED, STEP) for i in (3, 4)
        ]
    assert both.item() == pytest.approx((alone[0].item() + alone[1].item()) / 2, rel=1e-5)


# ------------------------------------------------------------------------------------------ fl2va (first frame)


def first_frame(batch):
    """The clip's first frame as the 8-bit (H, W, 3) array it was read from."""
    return ((batch["pixel_values"][0, :, 0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()


def test_fl2va_keyframe_latent_and_presentation_are_the_published_trainers(model):
    """model.image_to_video: the clip's first frame encoded as the trainer's encode_visual_condition encodes a
    keyframe (the spatial encoder, the posterior sampled under seed 42, float16, normalised), and the caption's rows
    after the frame's '<Picture 1>: ' label and Qwen3-VL vision block (its encode_prompt), tagged as it tags them."""
    from PIL import Image

    from loaded_models import with_attributes

    fl2va = with_attributes(with_settings(model, image_to_video=True), max_sequence_length=4096)
    batch = clips(model, [1])
    encoded = fl2va.encode_batch(batch)
    config = model.vae.config
    with torch.no_grad():
        theirs = trainer_keyframe_rows(model.vae, first_frame(batch), config.latents_mean, config.latents_std)
    ours = patchify(encoded["keyframe_latent"], model.patch())
    assert ours.shape == theirs.shape == (1, 16) and torch.allclose(ours, theirs, atol=1e-6)
    with torch.no_grad():
        rows, tags = trainer_prompt(
            model.text_encoders["text_encoder"],
            model.tokenizers["tokenizer"],
            fl2va.keyframe_processor(),
            batch["caption"][0],
            [Image.fromarray(first_frame(batch))],
        )
    mask = encoded["encoder_attention_mask"][0].bool()
    assert torch.allclose(encoded["encoder_hidden_states"][0][mask], rows, atol=1e-5)
    assert torch.equal(encoded["text_token_tags"][0][mask].cpu(), tags)
    assert (tags == h3.VIDEO_TAG).sum() > 2  # the vision block: start, its image pads, end


def test_fl2va_loss_equals_the_published_trainers_loss_lines_on_the_same_draws(model):
    """The first-frame layout [text | keyframe | sound | video] (the keyframe at the first frame's rotary time,
    noised to t = 0.999 and held at max(t, 0.999)) and the loss over the target rows only: dstune's against the
    trainer's prepare / assemble / compute_loss (h3_trainer.trainer_fl2va_loss), every transformer input compared;
    a prediction exact on the targets and wrong on the keyframe rows has loss 0."""
    from dstune.families.flow_matching import timestep_density

    fl2va, index = with_settings(model, image_to_video=True), 2
    encoded = fl2va.encode_batch(clips(model, [index]))
    latents = fl2va.model_latents(encoded, SEED, STEP)
    recorder = Recorder(fl2va.trainable)
    with torch.no_grad():
        ours = fl2va.loss(recorder, encoded, SEED, STEP)
    u = float(timestep_density(fl2va.model_spec, SEED, STEP, [index])[0])
    video_rows = patchify(latents, model.patch())
    noise = patchify(per_sample_randn(latents.shape[1:], SEED, STEP, [index], "noise"), model.patch())
    keyframe_noise = per_sample_randn(encoded["keyframe_latent"].shape[1:], SEED, STEP, [index], "keyframe_noise")
    clean, sound_noise = fl2va.clip_sound(encoded, 0, FRAMES, SEED, STEP, index)
    text, tags = fl2va.clip_text(encoded, 0)
    keyframe = patchify(encoded["keyframe_latent"], model.patch())
    with torch.no_grad():
        theirs, kwargs = trainer_fl2va_loss(
            fl2va.trainable, u, video_rows, clean, text, tags, keyframe, noise, sound_noise,
            patchify(keyframe_noise, model.patch()), tuple(latents.shape[2:]),
        )  # fmt: skip
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    [given] = recorder.calls
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "position_ids"):
        assert given[name].shape == kwargs[name].shape, name
        assert torch.allclose(given[name].float(), kwargs[name].float(), atol=1e-6), name
    for name in ("timestep_indices", "token_tags", "video_indices", "audio_indices", "text_indices"):
        assert torch.equal(given[name], kwargs[name]), name
    held = len(keyframe)
    assert given["hidden_states"].shape[1] == held + len(video_rows)
    first_row = given["video_indices"][0]
    assert given["timestep"][given["timestep_indices"][first_row]].item() == pytest.approx(max(1 - float(
        shifted(torch.tensor(u), h3.VIDEO_SHIFT)), h3.KEYFRAME_LEVEL), abs=1e-6)  # fmt: skip
    wrong_keyframe = torch.cat([torch.full_like(keyframe, 9.0), video_rows - noise])
    oracle = Recorder(None, [(wrong_keyframe[None], (clean - sound_noise)[None])])
    with torch.no_grad():
        assert fl2va.loss(oracle, encoded, SEED, STEP).item() == pytest.approx(0.0, abs=1e-10)


def test_fl2va_samples_render_from_the_prompts_first_frame_through_the_modular_workflow(model, tmp_path):
    """sample.control_images: the modular pipeline's fl2va workflow renders from the prompt's first frame (its
    keyframe rows ride in front of the generated rows at every step) with sound."""
    from PIL import Image

    from dstune.spec.models import SampleSpec

    fl2va = with_settings(model, image_to_video=True)
    path = tmp_path / "first.png"
    Image.fromarray(first_frame(clips(model, [0]))).save(path)
    rows = []
    hook = fl2va.trainable.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["hidden_states"].shape[1]), with_kwargs=True
    )
    try:
        spec = SampleSpec(prompts=["a red square"], steps=2, seed=0, control_images=[str(path)])
        [clip] = fl2va.sample(fl2va.trainable, ["a red square"], spec, 32)
    finally:
        hook.remove()
    assert len(clip) == SAMPLE_FRAMES and clip.sound.shape[0] == 2
    latent_frames = model.clip_rule().latent_frames(SAMPLE_FRAMES)
    assert rows and set(rows) == {1 + latent_frames}  # one keyframe row (a 1x2x2-patched 2x2 latent) first


def test_the_memory_plan_counts_fl2vas_keyframe_rows_and_vision_block():
    """A 512 px clip of the released configuration: fl2va's sequence holds one more latent frame of rows (16 x 16)
    and the keyframe's vision block ((512 / 32)^2 tokens) and its label: the plan's activations grow by as many."""
    from dstune.families.denoiser_facts import pipeline_folder
    from dstune.spec.models import Spec

    spec = Spec.model_validate(
        {
            "model": {"family": "video", "pretrained": "MiniMaxAI/MiniMax-H3", "train": "lora"},
            "data": {"path": "builtin:moving-shapes-av", "resolution": 512, "video": {"frames": 124}},
            "train": {"micro_batch_size": 1, "max_steps": 1},
        }
    )
    folder = pipeline_folder("MiniMaxAI/MiniMax-H3")
    t2va = h3.sample_bytes(spec, folder, 124, 512, 512)[0]
    fl2va_spec = spec.model_copy(update={"model": spec.model.model_copy(update={"image_to_video": True})})
    fl2va = h3.sample_bytes(fl2va_spec, folder, 124, 512, 512)[0]
    rows = 512 + h3.audio_rows(124) + 37 * 256  # caption, sound, 37 latent frames of 16 x 16 rows
    assert fl2va / t2va == pytest.approx((rows + 256 + 256 + h3.KEYFRAME_LABEL_TOKENS) / rows, rel=0.02)


def test_validate_takes_fl2va_without_the_text_cache_and_refuses_what_cannot_work(capsys, tmp_path):
    first = tmp_path / "first.png"
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 30, 30)).save(first)
    fl2va = {"model.image_to_video": True, "data.cache.text_embeddings": False}
    code, text = validate(capsys, tmp_path, **fl2va)
    assert code == 0, text
    code, text = validate(capsys, tmp_path, **{**fl2va, "data.cache.text_embeddings": True})
    assert code == 1 and "data.cache.text_embeddings" in text and "its frame" in text, text
    code, text = validate(capsys, tmp_path, **{**fl2va, "sample.prompts": ["a red square"]})
    assert code == 1 and "sample.control_images" in text and "first frame" in text, text
    prompts = {"sample.prompts": ["a red square"], "sample.control_images": [str(first)]}
    code, text = validate(capsys, tmp_path, **fl2va, **prompts)
    assert code == 0, text


# ------------------------------------------------------------------------------------------ the distillation guard


def test_the_cfg_augmented_target_is_diffusion_pipes_rearranged_guidance_with_its_gradient(model):
    """model.cfg_augmented_target s: dstune's loss and its gradient against the trainer's lines with diffusion-pipe's
    rearrangement ((cond + (s - 1) uncond) / s, uncond on the empty caption without gradient) on the same draws; a
    second forward, of no text rows."""
    from dstune.families.flow_matching import timestep_density

    guarded, index = with_settings(model, cfg_augmented_target=4.0), 1
    encoded = guarded.encode_batch(clips(model, [index]))
    latents = guarded.model_latents(encoded, SEED, STEP)
    recorder = Recorder(guarded.trainable)
    parameters = [p for p in guarded.trainable.parameters() if p.requires_grad]
    ours = guarded.loss(recorder, encoded, SEED, STEP)
    our_grads = torch.autograd.grad(ours, parameters, allow_unused=True)
    u = float(timestep_density(guarded.model_spec, SEED, STEP, [index])[0])
    video_rows = patchify(latents, model.patch())
    noise = patchify(per_sample_randn(latents.shape[1:], SEED, STEP, [index], "noise"), model.patch())
    clean, sound_noise = guarded.clip_sound(encoded, 0, FRAMES, SEED, STEP, index)
    text, _ = guarded.clip_text(encoded, 0)
    theirs, _ = trainer_loss(
        guarded.trainable, u, video_rows, clean, text, noise, sound_noise, tuple(latents.shape[2:]), cfg=4.0
    )
    their_grads = torch.autograd.grad(theirs, parameters, allow_unused=True)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    assert [call["text_indices"].numel() for call in recorder.calls] == [len(text), 0]
    compared = 0
    for mine, reference in zip(our_grads, their_grads):
        if reference is not None:
            assert torch.allclose(mine, reference, rtol=1e-4, atol=1e-7)
            compared += 1
    assert compared > 10


def test_the_guard_holds_a_model_whose_output_has_its_guidance_built_in_and_plain_training_pulls_it_off(model):
    """The distilled behaviour, measured: a model whose conditional output is its unconditional one guided at scale
    s towards the data's velocity (v_cond = v_uncond + s (v_data - v_uncond): guidance built in, what guidance
    distillation makes) is at the guarded objective's minimum (loss 0), while the plain objective's loss there is
    (s - 1)^2 |v_data - v_uncond|^2 > 0, its minimum the unguided v_data: plain fine-tuning removes the guidance."""
    scale, index = 4.0, 3
    encoded = model.encode_batch(clips(model, [index]))
    latents = model.model_latents(encoded, SEED, STEP)
    video_target = patchify(latents, model.patch()) - patchify(
        per_sample_randn(latents.shape[1:], SEED, STEP, [index], "noise"), model.patch()
    )
    clean, sound_noise = model.clip_sound(encoded, 0, FRAMES, SEED, STEP, index)
    sound_target = clean - sound_noise
    generator = torch.Generator().manual_seed(5)
    video_uncond = torch.randn(video_target.shape, generator=generator)
    sound_uncond = torch.randn(sound_target.shape, generator=generator)
    video_cond = video_uncond + scale * (video_target - video_uncond)
    sound_cond = sound_uncond + scale * (sound_target - sound_uncond)
    outputs = [(video_cond[None], sound_cond[None]), (video_uncond[None], sound_uncond[None])]
    with torch.no_grad():
        guarded = with_settings(model, cfg_augmented_target=scale).loss(Recorder(None, outputs), encoded, SEED, STEP)
        plain = model.loss(Recorder(None, outputs[:1]), encoded, SEED, STEP)
    assert guarded.item() == pytest.approx(0.0, abs=1e-9)
    expected = (scale - 1) ** 2 * (
        (video_target - video_uncond).pow(2).mean() + (sound_target - sound_uncond).pow(2).mean()
    )
    assert plain.item() == pytest.approx(expected.item(), rel=1e-5) and plain.item() > 1


def test_validate_takes_the_guard_on_minimax_h3_only(capsys, tmp_path):
    from dstune.models.wan.card import WAN_CARD

    code, text = validate(capsys, tmp_path, **{"model.cfg_augmented_target": 4.0})
    assert code == 0, text
    other = VideoModelSpec(family="video", pretrained="builtin:tiny-wan", cfg_augmented_target=4.0)
    assert [key for key, _ in WAN_CARD.settings_issues(other)] == ["model.cfg_augmented_target"]
    assert not h3.MINIMAX_H3_CARD.settings_issues(other)
