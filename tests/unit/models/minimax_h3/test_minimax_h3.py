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
from loaded_models import CACHE_DIR

from .h3_trainer import trainer_loss

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
        "model.image_to_video": (True, "fl2va"),
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
    holder = MiniMaxH3.__new__(MiniMaxH3)
    holder.transformer_config = dict(whole.config)
    clip = torch.randn(1, 4, 3, 4, 4)
    inputs = holder.packed_inputs(
        torch.randn(caption, 16), patchify(clip, (1, 2, 2)), torch.randn(10, 4), clip.shape, 0.7, 0.4, torch.float32
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
    from loaded_models import with_settings

    weighted = with_settings(model, loss_weighting="cosmap")
    with torch.no_grad():
        both = weighted.loss(weighted.trainable, weighted.encode_batch(clips(model, [3, 4])), SEED, STEP)
        alone = [
            weighted.loss(weighted.trainable, weighted.encode_batch(clips(model, [i])), SEED, STEP) for i in (3, 4)
        ]
    assert both.item() == pytest.approx((alone[0].item() + alone[1].item()) / 2, rel=1e-5)
