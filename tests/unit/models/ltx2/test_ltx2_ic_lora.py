"""IC-LoRA for LTX-2 (dstune.models.ltx2.ic_lora, on builtin:tiny-ltx2-3): a reference clip per sample from
data.control_dir, matched by name; the loss against the lines of Lightricks' ltx-trainer's video-to-video strategy
(packages/ltx-trainer/src/ltx_trainer/training_strategies/video_to_video.py, VideoToVideoStrategy with
first_frame_conditioning_p 0, retyped below), the denoiser's inputs compared (the reference tokens first, their
positions and their timestep 0); the reference changes the prediction; samples through LTX2InContextPipeline from
the reference; the LoRA file loads there and gives the trained loss; validate names a sample without its reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dstune.families.randomness import per_sample_randn
from dstune.data.synthetic import moving_shape_av_mp4

from .ltx_trainer import FRAMES, SEED, STEP, TEXT_TOKENS, load_tiny_ltx2, reference_positions, reference_sigmas

NAME = "builtin:tiny-ltx2-3"
CLIPS = {"a": (0, 5), "b": (1, 6)}  # target name -> (target's moving-shapes clip, its reference's)


def write_pairs(root, missing: tuple = ()) -> tuple:
    """targets/<name>.mp4 with captions and control/<name>.mp4 (another moving-shapes clip: the reference), 9
    frames of 32 x 32 at 24 fps; the references of `missing` left out."""
    targets, control = root / "targets", root / "control"
    targets.mkdir(parents=True), control.mkdir()
    for name, (clip, reference) in CLIPS.items():
        (targets / f"{name}.mp4").write_bytes(moving_shape_av_mp4(clip, 32, FRAMES))
        (targets / f"{name}.txt").write_text(f"clip {name}")
        if name not in missing:
            (control / f"{name}.mp4").write_bytes(moving_shape_av_mp4(reference, 32, FRAMES))
    return targets, control


def reference_batch(root) -> dict:
    from dstune.data.index import list_samples
    from dstune.data.video import VideoCaptionDataset, collate_video
    from dstune.spec.models import DataSpec

    targets, _ = write_pairs(root)
    data = DataSpec(path=str(targets), control_dir="../control", resolution=32, video={"frames": FRAMES})
    dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED)
    return collate_video([dataset[0], dataset[1]])


@pytest.fixture(scope="module")
def built():
    return load_tiny_ltx2(NAME)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return reference_batch(tmp_path_factory.mktemp("ic"))


def normalised(vae, mean: torch.Tensor) -> torch.Tensor:
    shape = (1, -1, 1, 1, 1)
    return (mean - vae.latents_mean.view(shape)) * vae.config.scaling_factor / vae.latents_std.view(shape)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """ltx-core's VideoLatentPatchifier (patch 1): "b c f h w -> b (f h w) c"."""
    b, c, f, h, w = latents.shape
    return latents.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)


def ltx_trainer_video_to_video(built, encoded: dict, indices: list[int], first_frame: bool = False):
    """VideoToVideoStrategy.prepare_training_inputs and compute_loss, retyped (first_frame_conditioning_p 0, or 1
    with `first_frame`: _create_first_frame_conditioning_mask's first h x w target tokens; the reference at the
    target's size: downscale factor 1), with dstune's draws: (loss per sample, the transformer's inputs)."""
    target_latents = patchify(normalised(built.vae, encoded["latent_mean"]))
    ref_latents = patchify(normalised(built.vae, encoded["control_latent"]))
    b, c, f, h, w = encoded["latent_mean"].shape
    batch_size, ref_seq_len, target_seq_len = target_latents.shape[0], ref_latents.shape[1], target_latents.shape[1]
    ref_conditioning_mask = torch.ones(batch_size, ref_seq_len, dtype=torch.bool)
    target_conditioning_mask = torch.zeros(batch_size, target_seq_len, dtype=torch.bool)
    if first_frame:
        target_conditioning_mask[:, : h * w] = True
    conditioning_mask = torch.cat([ref_conditioning_mask, target_conditioning_mask], dim=1)
    sigmas = reference_sigmas("shifted_logit_normal", target_seq_len, indices)
    noise = patchify(per_sample_randn((c, f, h, w), SEED, STEP, indices, "noise"))
    sigmas_expanded = sigmas.view(-1, 1, 1)
    noisy_target = (1 - sigmas_expanded) * target_latents + sigmas_expanded * noise
    noisy_target = torch.where(target_conditioning_mask.unsqueeze(-1), target_latents, noisy_target)
    targets = noise - target_latents
    combined_latents = torch.cat([ref_latents, noisy_target], dim=1)
    timesteps = torch.where(conditioning_mask, torch.zeros_like(sigmas.view(-1, 1)), sigmas.view(-1, 1))
    scale = tuple(built.transformer_config["vae_scale_factors"])
    positions = torch.cat([reference_positions(f, h, w, scale), reference_positions(f, h, w, scale)], dim=2)
    inputs = dict(
        hidden_states=combined_latents,
        timestep=timesteps * 1000,
        sigma=sigmas * 1000,
        video_coords=positions,
    )
    with torch.no_grad():
        video_pred, _ = built.trainable(
            **inputs,
            audio_hidden_states=torch.zeros(b, 1, built.transformer_config["audio_in_channels"]),
            audio_timestep=sigmas * 1000,  # the absent audio modality's one token (its output is not read)
            encoder_hidden_states=encoded["encoder_hidden_states"],
            audio_encoder_hidden_states=encoded["audio_encoder_hidden_states"],
            encoder_attention_mask=encoded["encoder_attention_mask"],
            audio_encoder_attention_mask=encoded["encoder_attention_mask"],
            audio_num_frames=1,
            isolate_modalities=True,
            return_dict=False,
        )
    target_pred = video_pred[:, -target_seq_len:, :]
    target_loss_mask = torch.cat([torch.zeros_like(ref_conditioning_mask), ~target_conditioning_mask], dim=1)
    loss = (target_pred - targets).pow(2)
    loss_mask = target_loss_mask[:, -target_seq_len:].unsqueeze(-1).float()
    per_sample = loss.mul(loss_mask).mean(dim=[-2, -1]) / loss_mask.mean(dim=[-2, -1]).clamp(min=1e-8)
    return per_sample, inputs


def test_the_loss_and_the_denoisers_inputs_are_ltx_trainers_video_to_video(built, batch):
    """The reference clip of each sample (control/<name>.mp4 for targets/<name>.mp4), encoded to its posterior
    mean; the loss equals ltx-trainer's at 1e-5; the transformer is given [reference | target] tokens, the
    reference's at timestep 0 and the target's at sigma x 1000, and each part's positions from frame 0."""
    encoded = built.encode_batch(batch)
    assert encoded["control_latent"].shape == encoded["latent_mean"].shape == (2, 8, 3, 4, 4)
    calls = []

    def forward(**kwargs):
        calls.append(kwargs)
        return built.trainable(**kwargs)

    with torch.no_grad():
        ours = built.loss(forward, encoded, SEED, STEP)
    indices = encoded["indices"].tolist()
    per_sample, inputs = ltx_trainer_video_to_video(built, encoded, indices)
    assert ours.item() == pytest.approx(per_sample.mean().item(), rel=1e-5)
    (given,) = calls
    assert given["hidden_states"].shape == inputs["hidden_states"].shape == (2, 96, 8)
    assert torch.allclose(given["hidden_states"][:, :48], inputs["hidden_states"][:, :48], atol=1e-6)  # the reference
    assert torch.allclose(given["timestep"], inputs["timestep"], atol=1e-3) and (given["timestep"][:, :48] == 0).all()
    assert torch.allclose(given["video_coords"].float(), inputs["video_coords"], atol=1e-5)
    assert torch.allclose(given["sigma"], inputs["sigma"], atol=1e-3)


def test_a_references_sound_joins_the_audio_as_ltx_trainers_audio_to_audio(built, tmp_path):
    """Clips and references with sound (ltx-trainer's av2av_ic_lora.yaml: the flexible strategy with a reference
    condition on both modalities): the reference's sound tokens come before the clip's, clean at timestep 0, each
    part's audio positions from 0 (_get_audio_positions), the sound's loss over the clip's tokens only; the loss
    equals those lines at 1e-5 and the transformer's audio inputs are theirs. One deliberate difference: the flexible
    strategy draws a sigma per modality, dstune one per clip for both streams (TextToVideoStrategy's with_audio
    lines, as dstune trains every LTX-2 clip): the reference is given dstune's. A reference without sound leaves the
    clip's sound alone (video-to-video's lines: test above)."""
    from dstune.data.index import list_samples
    from dstune.data.video import VideoCaptionDataset, collate_video
    from dstune.spec.models import DataSpec

    from .ltx_trainer import reference_audio_latents, reference_audio_positions

    targets, _ = write_pairs(tmp_path)
    data = DataSpec(path=str(targets), control_dir="../control", resolution=32, video={"frames": FRAMES})
    dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED, built.sound_rate)
    batch = collate_video([dataset[0], dataset[1]])
    assert batch["has_sound"].all() and batch["control_has_sound"].all()
    encoded = built.encode_batch(batch)
    calls = []

    def forward(**kwargs):
        calls.append(kwargs)
        return built.trainable(**kwargs)

    with torch.no_grad():
        ours = built.loss(forward, encoded, SEED, STEP)
    indices = encoded["indices"].tolist()
    vae, audio_vae, config = built.vae, built.parts["audio_vae"], built.transformer_config
    video = patchify(normalised(vae, encoded["latent_mean"]))
    ref_video = patchify(normalised(vae, encoded["control_latent"]))
    b, c, f, h, w = encoded["latent_mean"].shape
    sigmas = reference_sigmas("shifted_logit_normal", video.shape[1], indices)
    noise = patchify(per_sample_randn((c, f, h, w), SEED, STEP, indices, "noise"))
    s = sigmas.view(-1, 1, 1)
    audio = reference_audio_latents(audio_vae, batch["sound"])
    ref_audio = reference_audio_latents(audio_vae, batch["control_sound"])
    audio_noise = per_sample_randn(audio.shape[1:], SEED, STEP, indices, "audio_noise")
    scale = tuple(config["vae_scale_factors"])
    inputs = dict(  # _apply_reference_condition on each modality: [reference | target], reference at 0
        hidden_states=torch.cat([ref_video, (1 - s) * video + s * noise], dim=1),
        audio_hidden_states=torch.cat([ref_audio, (1 - s) * audio + s * audio_noise], dim=1),
        timestep=torch.cat([torch.zeros(b, ref_video.shape[1]), sigmas.view(-1, 1).expand(b, video.shape[1])], 1)
        * 1000,
        audio_timestep=torch.cat([torch.zeros(b, ref_audio.shape[1]), sigmas.view(-1, 1).expand(b, audio.shape[1])], 1)
        * 1000,
        video_coords=torch.cat([reference_positions(f, h, w, scale)] * 2, dim=2)[:b],
        audio_coords=torch.cat(
            [
                reference_audio_positions(ref_audio.shape[1], b, config),
                reference_audio_positions(audio.shape[1], b, config),
            ],
            dim=2,
        ),
    )
    with torch.no_grad():
        video_pred, audio_pred = built.trainable(
            **inputs,
            sigma=sigmas * 1000,
            encoder_hidden_states=encoded["encoder_hidden_states"],
            audio_encoder_hidden_states=encoded["audio_encoder_hidden_states"],
            encoder_attention_mask=encoded["encoder_attention_mask"],
            audio_encoder_attention_mask=encoded["encoder_attention_mask"],
            return_dict=False,
        )
    # _compute_modality_loss per modality (the prediction sliced to the targets' length, every target token counted)
    video_loss = (video_pred[:, -video.shape[1] :] - (noise - video)).pow(2).mean(dim=[-2, -1])
    audio_loss = (audio_pred[:, -audio.shape[1] :] - (audio_noise - audio)).pow(2).mean(dim=[-2, -1])
    assert ours.item() == pytest.approx((video_loss + audio_loss).mean().item(), rel=1e-5)
    (given,) = calls
    assert given["audio_hidden_states"].shape == inputs["audio_hidden_states"].shape
    assert torch.allclose(given["audio_hidden_states"], inputs["audio_hidden_states"], atol=1e-5)
    assert torch.allclose(given["audio_timestep"].float(), inputs["audio_timestep"], atol=1e-3)
    assert (given["audio_timestep"][:, : ref_audio.shape[1]] == 0).all()
    assert torch.allclose(given["audio_coords"].float(), inputs["audio_coords"], atol=1e-5)


def test_image_to_video_with_a_reference_is_ltx_trainers_video_to_video_with_its_first_frame(batch, tmp_path):
    """IC-LoRA with model.image_to_video: VideoToVideoStrategy with first_frame_conditioning_p 1 (every clip's first
    latent frame clean at timestep 0 and outside the loss, after the reference's tokens): the loss at 1e-5 and the
    transformer's inputs; samples through LTX2InContextPipeline from a [reference clip, first frame] pair per
    prompt, another first frame another clip."""
    from dstune.spec.models import SampleSpec

    built = load_tiny_ltx2(NAME, image_to_video=True)
    encoded = built.encode_batch(batch)
    calls = []

    def forward(**kwargs):
        calls.append(kwargs)
        return built.trainable(**kwargs)

    with torch.no_grad():
        ours = built.loss(forward, encoded, SEED, STEP)
    per_sample, inputs = ltx_trainer_video_to_video(built, encoded, encoded["indices"].tolist(), first_frame=True)
    assert ours.item() == pytest.approx(per_sample.mean().item(), rel=1e-5)
    (given,) = calls
    assert torch.allclose(given["hidden_states"], inputs["hidden_states"], atol=1e-5)
    assert torch.allclose(given["timestep"], inputs["timestep"], atol=1e-3) and (given["timestep"][:, :64] == 0).all()
    reference = tmp_path / "reference.mp4"
    reference.write_bytes(moving_shape_av_mp4(5, 32, FRAMES))
    rendered = []
    for number in (0, 1):
        from dstune.data.synthetic import render_moving_shape

        first = tmp_path / f"first{number}.png"
        render_moving_shape(number, 32, FRAMES)[0][0].save(first)
        spec = SampleSpec(prompts=["x"], control_images=[[str(reference), str(first)]], steps=2, guidance=1.0, seed=1)
        rendered.append(built.sample(built.trainable, spec.prompts, spec, 32)[0])
    assert type(built.pipeline(built.trainable)).__name__ == "LTX2InContextPipeline"
    first, second = (torch.tensor(np.stack([np.asarray(frame) for frame in clip])).float() for clip in rendered)
    assert (first - second).abs().mean() > 0.1  # the same reference, prompt and noise, another first frame


def test_the_reference_changes_the_prediction(built, batch):
    """Swapping the two samples' references changes each sample's loss: the model reads them."""
    encoded = built.encode_batch(batch)
    swapped = dict(encoded, control_latent=encoded["control_latent"].flip(0))
    with torch.no_grad():
        ours, other = (built.loss(built.trainable, one, SEED, STEP) for one in (encoded, swapped))
    assert abs(ours.item() - other.item()) > 1e-4


def test_samples_render_from_the_reference_and_the_lora_loads_in_the_in_context_pipeline(built, batch, tmp_path):
    """Samples: LTX2InContextPipeline from sample.control_images (the reference clips), one clip per prompt, another
    reference another clip. The LoRA file (LTX2Pipeline's writer) loads with LTX2InContextPipeline.load_lora_weights
    and gives the trained adapters' loss with the references."""
    from diffusers import LTX2InContextPipeline

    from dstune.families.lora import apply_train_mode, export_lora
    from dstune.pretrained import build_model
    from dstune.spec.models import SampleSpec, VideoModelSpec
    from loaded_models import CACHE_DIR

    _, control = write_pairs(tmp_path / "pairs")
    spec = SampleSpec(
        steps=2, guidance=1.0, prompts=["p", "p"], control_images=[str(control / n) for n in ("a.mp4", "b.mp4")]
    )
    clips = built.sample(built.trainable, ["a red circle", "a red circle"], spec, 32)
    assert type(built.pipeline(built.trainable)).__name__ == "LTX2InContextPipeline"
    assert len(clips) == 2 and len(clips[0]) == 5 and clips[0][0].size == (32, 32)
    first, second = (torch.tensor(np.stack([np.asarray(frame) for frame in clip])).float() for clip in clips)
    assert (first - second).abs().mean() > 0.1  # the same prompt and noise, another reference

    model_spec = VideoModelSpec(
        family="video",
        pretrained=NAME,
        train="lora",
        max_sequence_length=TEXT_TOKENS,
        timestep_sampling="shifted_logit_normal",
    )
    model = build_model(model_spec, CACHE_DIR, "cpu")
    apply_train_mode(model, model_spec, seed=0)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    state = {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}
    lora = export_lora(model, state, tmp_path / "lora", model_spec)
    encoded = model.encode_batch(batch)
    pipeline = LTX2InContextPipeline.from_pretrained(model.folder)
    with torch.no_grad():
        base = model.loss(pipeline.transformer, encoded, 0, 1)
    pipeline.load_lora_weights(str(lora), weight_name="pytorch_lora_weights.safetensors")
    with torch.no_grad():
        trained, loaded = (model.loss(module, encoded, 0, 1) for module in (model.trainable, pipeline.transformer))
    assert loaded.item() == pytest.approx(trained.item(), rel=1e-6) and loaded.item() != base.item()


def test_validate_names_a_sample_without_its_reference_and_plans_the_cached_references(capsys, tmp_path):
    """A target without its reference is named (and found once it is there); the memory plan counts the
    reference's tokens, and with the latent cache each reference's entry beside its clip's."""
    from dstune.cli import main
    from dstune.families.denoiser_facts import pipeline_folder
    from dstune.models.ltx2.card import sample_bytes
    from dstune.spec.load import load_spec

    targets, control = write_pairs(tmp_path, missing=("b",))
    spec = {
        "model": {
            "family": "video",
            "pretrained": NAME,
            "train": "lora",
            "max_sequence_length": 32,
            "timestep_sampling": "shifted_logit_normal",
            "sample_frames": 9,
        },
        "data": {
            "path": str(targets),
            "control_dir": "../control",
            "resolution": 32,
            "video": {"frames": FRAMES},
            "cache": {"latents": False, "text_embeddings": True},
        },
        "train": {"micro_batch_size": 1, "max_steps": 4},
        "output": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(spec))
    assert main(["validate", str(path), "--num-gpus", "2"]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert "data.control_dir" in text and "1 of 2 target" in text and "b.mp4" in text, text
    (control / "b.mp4").write_bytes(moving_shape_av_mp4(6, 32, FRAMES))
    assert main(["validate", str(path), "--num-gpus", "2"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    with_references = load_spec(str(path), [])[0]
    without = with_references.model_copy(update={"data": with_references.data.model_copy(update={"control_dir": None})})
    folder = pipeline_folder(NAME)
    # the reference's tokens beside the clip's, every token with its own timestep: more than twice the clip's bytes
    full, alone = (sample_bytes(one, folder, FRAMES, 32, 32)[0] for one in (with_references, without))
    assert full > 2 * alone
    spec["data"]["cache"]["latents"] = True
    path.write_text(json.dumps(spec))
    assert main(["validate", str(path), "--num-gpus", "2", "--json"]) == 0
    cached = json.loads(capsys.readouterr().out)["memory"]["cache_disk_bytes"]
    spec["data"]["control_dir"] = None
    path.write_text(json.dumps(spec))
    assert main(["validate", str(path), "--num-gpus", "2", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)["memory"]["cache_disk_bytes"]
    assert cached > alone  # the references' entries (as large as their clips') beside the clips' and the text's


def test_references_train_from_the_latent_cache_as_from_their_files(built, tmp_path):
    """The real start-up (validate, cache build, loader) with data.cache.latents: each reference clip is cached
    beside its clip (its posterior mean, control_latent_mean, of the clip's latent shape) and a cached batch trains
    as the same samples read from the files (same loss); the sound is still read from the clips."""
    import yaml

    from dstune.data.index import list_samples
    from dstune.data.video import VideoCaptionDataset, collate_video
    from dstune.spec.models import DataSpec
    from loaded_models import CACHE_DIR, start_up

    targets, _ = write_pairs(tmp_path)
    spec = {
        "model": {
            "family": "video",
            "pretrained": NAME,
            "train": "lora",
            "max_sequence_length": TEXT_TOKENS,
            "timestep_sampling": "shifted_logit_normal",
        },
        "data": {
            "path": str(targets),
            "control_dir": "../control",
            "resolution": 32,
            "video": {"frames": FRAMES},
            "cache": {"latents": True, "dir": str(tmp_path / "cache")},
        },
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 1},
        "output": {"dir": str(tmp_path / "run"), "cache_dir": str(CACHE_DIR)},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    model, caches, loader = start_up(path)
    cached = next(iter(loader))
    assert cached["control_latent_mean"].shape == cached["latent_mean"].shape and "control_values" not in cached
    assert not torch.equal(cached["control_latent_mean"], cached["latent_mean"])
    data = DataSpec(path=str(targets), control_dir="../control", resolution=32, video={"frames": FRAMES})
    dataset = VideoCaptionDataset(data, list_samples(data, video=True), SEED, model.sound_rate)
    read = collate_video([dataset[int(i)] for i in cached["index"]])
    read["caption"] = cached["caption"]  # the same captions (the cached batch's dropout draws)
    with torch.no_grad():
        losses = [model.loss(model.trainable, model.encode_batch(b), SEED, STEP).item() for b in (cached, read)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_validate_takes_image_to_video_ic_lora_with_a_reference_and_a_first_frame_per_prompt(capsys, tmp_path):
    """model.image_to_video with data.control_dir validates when each sample prompt gives [reference clip, first
    frame]; one path per prompt is named with the fix (and a pair without image-to-video)."""
    from dstune.cli import main
    from dstune.data.synthetic import render_moving_shape

    targets, control = write_pairs(tmp_path)
    render_moving_shape(0, 32, FRAMES)[0][0].save(tmp_path / "first.png")
    pair = [str(control / "a.mp4"), str(tmp_path / "first.png")]
    spec = {
        "model": {
            "family": "video",
            "pretrained": NAME,
            "train": "lora",
            "max_sequence_length": 32,
            "timestep_sampling": "shifted_logit_normal",
            "image_to_video": True,
            "sample_frames": 9,
        },
        "data": {"path": str(targets), "control_dir": "../control", "resolution": 32, "video": {"frames": FRAMES}},
        "train": {"micro_batch_size": 1, "max_steps": 4},
        "sample": {"prompts": ["p"], "control_images": [pair]},
        "output": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / "spec.yaml"
    results = []
    for image_to_video, images in ((True, [pair]), (True, [pair[0]]), (False, [pair])):
        spec["model"]["image_to_video"], spec["sample"]["control_images"] = image_to_video, images
        path.write_text(json.dumps(spec))
        code = main(["validate", str(path), "--num-gpus", "2"])
        out = capsys.readouterr()
        results.append((code, out.out + out.err))
    assert results[0][0] == 0, results[0][1]
    assert results[1][0] == 1 and "[reference clip, first frame image]" in results[1][1]
    assert results[2][0] == 1 and "one reference clip: give one path per prompt" in results[2][1]
