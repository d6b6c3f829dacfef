"""Image-to-video for Wan (its class, dstune.models.wan) on builtin:tiny-wan-i2v (Wan 2.1 I2V layout) and builtin:tiny-wan22-ti2v (Wan 2.2
TI2V layout): the transformer inputs dstune builds equal what diffusers' pipelines feed the same transformer, the
loss equals the reference trainers' (musubi-tuner for Wan 2.1 I2V, DiffSynth-Studio for TI2V) on the same draws, and
folders and settings that do not fit are refused with the key and the fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of, load_model
from dstune.families.base import FamilyError
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.wan import i2v as wan_i2v
from dstune.models.wan.card import WAN_CARD
from dstune.pretrained import build_model
from dstune.spec.models import SampleSpec, VideoModelSpec
from loaded_models import CACHE_DIR
from tiny_batches import clip_batch

SEED, STEP, INDICES = 5, 2, [1, 8, 13]
I2V, TI2V = "builtin:tiny-wan-i2v", "builtin:tiny-wan22-ti2v"


def _batch(indices=INDICES, frames=5) -> dict:
    return clip_batch(indices, SEED, frames)


@pytest.fixture(scope="module")
def i2v():
    return build_model(VideoModelSpec(family="video", pretrained=I2V), CACHE_DIR, "cpu")


@pytest.fixture(scope="module")
def ti2v_image():
    return build_model(VideoModelSpec(family="video", pretrained=TI2V, image_to_video=True), CACHE_DIR, "cpu")


def _captured(pipeline, transformer_name="transformer", **call) -> dict:
    """The keyword arguments of the transformer's first call while `pipeline` renders one step."""
    seen = {}
    module = getattr(pipeline, transformer_name)
    hook = module.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.setdefault("kwargs", kwargs) and None, with_kwargs=True
    )
    try:
        pipeline(
            height=32, width=32, num_frames=5, num_inference_steps=1, guidance_scale=1.0, output_type="latent", **call
        )
    finally:
        hook.remove()
    return seen["kwargs"]


def test_wan21_i2v_inputs_are_what_wan_image_to_video_pipeline_feeds_the_transformer(i2v):
    """mask + condition channels and the image embedding: the pipeline is given the clip's first frame as the image
    and dstune's own noisy latents and text, and its transformer call is captured."""
    from diffusers import WanImageToVideoPipeline

    pipeline = WanImageToVideoPipeline.from_pretrained(i2v.folder)
    batch = _batch([3])
    encoded = i2v.encode_batch(batch)
    noisy = per_sample_randn((16, 2, 4, 4), SEED, STEP, [3], "noise")
    seen = _captured(
        pipeline,
        image=wan_i2v.frame_images(batch["pixel_values"][:, :, 0])[0],
        prompt_embeds=encoded["encoder_hidden_states"],
        latents=noisy.clone(),
    )
    t = pipeline.scheduler.timesteps[:1]
    hidden, timestep, extra, first = wan_i2v.transformer_inputs(i2v, noisy, t, encoded)
    assert hidden.shape == seen["hidden_states"].shape == (1, 36, 2, 4, 4) and first == 0
    assert torch.allclose(hidden, seen["hidden_states"], atol=1e-6)
    assert torch.equal(hidden[:, 16:20, 0], torch.ones(1, 4, 4, 4)) and not hidden[:, 16:20, 1:].any()
    assert torch.equal(timestep, seen["timestep"])
    assert torch.allclose(extra["encoder_hidden_states_image"], seen["encoder_hidden_states_image"], atol=1e-6)
    image = wan_i2v.frame_images(batch["pixel_values"][:, :, 0])  # and the pipeline's own encode_image
    assert torch.allclose(encoded["image_embeds"], pipeline.encode_image(image, "cpu"), atol=1e-6)
    assert encoded["image_embeds"].shape == (1, 17, 32)  # CLIP's 16 patches + class token, hidden_states[-2]


def test_wan21_i2v_loss_is_the_reference_trainers_on_the_same_draws(i2v):
    """musubi-tuner's Wan I2V step: y = cat(mask, condition latents), clip_fea = CLIP's hidden_states[-2], the
    transformer on cat(noisy, y), MSE against noise - latents over the whole clip. Rebuilt here from the pipeline's
    own prepare_latents / encode_image on the same posterior draw, noise and timesteps."""
    from diffusers import WanImageToVideoPipeline

    pipeline = WanImageToVideoPipeline.from_pretrained(i2v.folder)
    batch = _batch()
    encoded = i2v.encode_batch(batch)
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    shift = torch.tensor(i2v.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    scale = torch.tensor(i2v.vae.config.latents_std).view(1, -1, 1, 1, 1)
    latents = (mean + std * per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "vae_posterior") - shift) / scale
    noise = per_sample_randn(latents.shape[1:], SEED, STEP, INDICES, "noise")
    positions = (timestep_density(i2v.model_spec, SEED, STEP, INDICES) * 1000).long().clamp(0, 999)
    t, sigma = i2v.train_timesteps[positions], i2v.train_sigmas[positions].view(-1, 1, 1, 1, 1)
    noisy = (1 - sigma) * latents + sigma * noise
    losses = []
    for row, frame in enumerate(wan_i2v.frame_images(batch["pixel_values"][:, :, 0])):
        image = pipeline.video_processor.preprocess(frame, height=32, width=32)
        _, y = pipeline.prepare_latents(image, 1, 16, 32, 32, 5, torch.float32, "cpu")
        clip_fea = pipeline.encode_image([frame], "cpu")
        with torch.no_grad():
            prediction = i2v.trainable(
                hidden_states=torch.cat([noisy[row : row + 1], y], dim=1),
                timestep=t[row : row + 1],
                encoder_hidden_states=encoded["encoder_hidden_states"][row : row + 1],
                encoder_hidden_states_image=clip_fea,
                return_dict=False,
            )[0]
        losses.append(torch.nn.functional.mse_loss(prediction, noise[row : row + 1] - latents[row : row + 1]))
    with torch.no_grad():
        value = i2v.loss(i2v.trainable, encoded, SEED, STEP)
    assert value.item() == pytest.approx(torch.stack(losses).mean().item(), rel=1e-6)


def test_wan21_i2v_image_embedding_reaches_the_loss(i2v):
    """diffusers' WanAttnProcessor takes all but the last 512 context tokens as the image embedding's: the text is
    512 tokens (the tiny folder's tokenizer said 32, and the image tokens were read as text, so the image projections
    got no gradient), and every image key/value projection gets one."""
    encoded = i2v.encode_batch(_batch())
    assert encoded["encoder_hidden_states"].shape[1] == 512
    i2v.trainable.zero_grad(set_to_none=True)
    i2v.loss(i2v.trainable, encoded, SEED, STEP).backward()
    grads = {n: p.grad for n, p in i2v.trainable.named_parameters() if ".add_k_proj." in n or ".add_v_proj." in n}
    i2v.trainable.zero_grad(set_to_none=True)
    assert len(grads) == 8 and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_ti2v_text_to_video_timesteps_are_expanded_per_token_as_wan_pipeline_does():
    from diffusers import WanPipeline

    built = build_model(VideoModelSpec(family="video", pretrained=TI2V), CACHE_DIR, "cpu")
    assert (built.mode.layout, built.mode.image_to_video) == ("ti2v", False)
    pipeline = WanPipeline.from_pretrained(built.folder)
    assert pipeline.config.expand_timesteps and pipeline.vae.config.z_dim == 48
    encoded = built.encode_batch(_batch([2]))
    assert encoded["latent_mean"].shape == (1, 48, 2, 2, 2) and "condition_mean" not in encoded
    noisy = per_sample_randn((48, 2, 2, 2), SEED, STEP, [2], "noise")
    seen = _captured(pipeline, prompt_embeds=encoded["encoder_hidden_states"], latents=noisy.clone())
    hidden, timestep, _, first = wan_i2v.transformer_inputs(built, noisy, pipeline.scheduler.timesteps[:1], encoded)
    assert torch.equal(hidden, seen["hidden_states"]) and first == 0
    assert timestep.shape == seen["timestep"].shape == (1, 2) and torch.equal(timestep, seen["timestep"])


def test_ti2v_image_to_video_replaces_the_first_latent_frame_and_zeroes_its_timesteps(ti2v_image):
    """WanImageToVideoPipeline with expand_timesteps (built from the TI2V folder's parts, as diffusers documents for
    Wan 2.2 TI2V image-to-video): the first latent frame is the image's VAE mode, its tokens at timestep 0."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    parts = WanPipeline.from_pretrained(ti2v_image.folder).components
    pipeline = WanImageToVideoPipeline(
        **{k: v for k, v in parts.items() if k != "transformer_2"}, expand_timesteps=True
    )
    batch = _batch([4], frames=9)
    encoded = ti2v_image.encode_batch(batch)
    assert encoded["condition_mean"].shape == (1, 48, 1, 2, 2)
    noisy = per_sample_randn((48, 3, 2, 2), SEED, STEP, [4], "noise")
    seen = {}
    hook = pipeline.transformer.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.setdefault("kwargs", kwargs) and None, with_kwargs=True
    )
    first_frame = wan_i2v.frame_images(batch["pixel_values"][:, :, 0])[0]
    pipeline(
        image=first_frame,
        prompt_embeds=encoded["encoder_hidden_states"],
        latents=noisy.clone(),
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=1,
        guidance_scale=1.0,
        output_type="latent",
    )
    hook.remove()
    t = pipeline.scheduler.timesteps[:1]
    hidden, timestep, _, first = wan_i2v.transformer_inputs(ti2v_image, noisy, t, encoded)
    assert first == 1 and torch.allclose(hidden, seen["kwargs"]["hidden_states"], atol=1e-6)
    assert torch.equal(hidden[:, :, 1:], noisy[:, :, 1:]) and not torch.equal(hidden[:, :, :1], noisy[:, :, :1])
    assert torch.equal(timestep, seen["kwargs"]["timestep"])
    assert timestep[0, :1].eq(0).all() and timestep[0, 1:].eq(t).all()


def test_ti2v_image_to_video_loss_leaves_the_given_first_frame_out_as_diffsynth_does(ti2v_image):
    """DiffSynth-Studio's TI2V step: the noisy latents' first frame replaced by the clean image latent, timestep 0 on
    its tokens, and the MSE against noise - latents over the latent frames after the first."""
    batch = _batch(INDICES, frames=9)
    encoded = ti2v_image.encode_batch(batch)
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    config = ti2v_image.vae.config
    shift, scale = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
    latents = (mean + std * per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "vae_posterior") - shift) / scale
    noise = per_sample_randn(latents.shape[1:], SEED, STEP, INDICES, "noise")
    positions = (timestep_density(ti2v_image.model_spec, SEED, STEP, INDICES) * 1000).long().clamp(0, 999)
    t, sigma = ti2v_image.train_timesteps[positions], ti2v_image.train_sigmas[positions].view(-1, 1, 1, 1, 1)
    noisy = (1 - sigma) * latents + sigma * noise
    noisy[:, :, :1] = (encoded["condition_mean"] - shift) / scale
    per_token = torch.ones(3, 1, 1)
    per_token[0] = 0
    timestep = per_token.flatten()[None] * t[:, None]
    with torch.no_grad():
        prediction = ti2v_image.trainable(
            hidden_states=noisy,
            timestep=timestep,
            return_dict=False,
            encoder_hidden_states=encoded["encoder_hidden_states"],
        )[0]
        value = ti2v_image.loss(ti2v_image.trainable, encoded, SEED, STEP)
    reference = torch.nn.functional.mse_loss(prediction[:, :, 1:], (noise - latents)[:, :, 1:])
    assert value.item() == pytest.approx(reference.item(), rel=1e-6)
    full = torch.nn.functional.mse_loss(prediction, noise - latents)  # the first frame's error is not in it
    assert value.item() != pytest.approx(full.item(), rel=1e-3)


def test_i2v_trains_and_samples_render_from_a_first_frame(i2v, tmp_path):
    encoded = i2v.encode_batch(_batch())
    value = i2v.loss(i2v.trainable, encoded, SEED, STEP)
    value.backward()
    grads = [p.grad for p in i2v.trainable.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    i2v.trainable.zero_grad(set_to_none=True)
    frames = wan_i2v.frame_images(_batch([0, 1])["pixel_values"][:, :, 0])
    paths = []
    for number, frame in enumerate(frames):
        paths.append(str(tmp_path / f"first{number}.png"))
        frame.save(paths[-1])
    prompts = ["a red circle moving left", "a red circle moving right"]
    clips = i2v.sample(i2v.trainable, prompts, SampleSpec(prompts=prompts, control_images=paths, steps=2), 32)
    assert len(clips) == 2 and len(clips[0]) == 5 and clips[0][0].size == (32, 32)
    other = i2v.sample(
        i2v.trainable, prompts[:1], SampleSpec(prompts=prompts[:1], control_images=paths[1:], steps=2), 32
    )
    assert clips[0][0].tobytes() != other[0][0].tobytes()  # the image decides the clip
    with pytest.raises(FamilyError, match="sample.control_images: image-to-video renders each clip from a first"):
        i2v.sample(i2v.trainable, prompts, SampleSpec(prompts=prompts, steps=2), 32)


def _load(spec: VideoModelSpec, folder):
    """The model of a local folder as start-up loads it: its card (by the folder's classes), then the class."""
    return load_model(card_of("video", folder), spec, {"pretrained": folder}, "cpu", torch.float32)


def test_settings_that_do_not_fit_the_folder_are_refused_with_the_key_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="model.image_to_video is false, but this is an image-to-video folder"):
        build_model(VideoModelSpec(family="video", pretrained=I2V, image_to_video=False), CACHE_DIR, "cpu")
    with pytest.raises(ValueError, match="model.image_to_video is true, but this is a text-to-video folder"):
        build_model(VideoModelSpec(family="video", image_to_video=True), CACHE_DIR, "cpu")
    copy = tmp_path / "no-processor"
    shutil.copytree(tiny.ensure_builtin_model(I2V, CACHE_DIR), copy)
    index = json.loads((copy / "model_index.json").read_text())
    del index["image_processor"]
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="has an image_encoder but no image_processor"):
        _load(VideoModelSpec(family="video"), copy)
    config = json.loads((copy / "transformer" / "config.json").read_text())
    (copy / "transformer" / "config.json").write_text(json.dumps({**config, "in_channels": 20}))
    with pytest.raises(ValueError, match="in_channels 20 is neither the VAE's z_dim 16"):
        _load(VideoModelSpec(family="video"), copy)


def test_a_cache_without_the_condition_is_refused(i2v):
    batch = {name: value for name, value in i2v.encode_batch(_batch([1])).items() if name != "image_embeds"}
    with pytest.raises(ValueError, match="no image_embeds for image-to-video.*Delete data.cache.dir"):
        i2v.encode_batch({**batch, "index": batch["indices"], "caption": ["x"]})


def test_the_latent_cache_key_changes_with_the_mode_and_text_to_video_keeps_the_plain_entries():
    folder = tiny.ensure_builtin_model(TI2V, CACHE_DIR)
    assert WAN_CARD.latent_cache_key(VideoModelSpec(family="video", pretrained=TI2V), folder) == ("", (), ())
    assert WAN_CARD.latent_cache_key(VideoModelSpec(family="video", pretrained=TI2V, image_to_video=True), folder) == (
        "image_to_video/ti2v",
        (),
        ("condition_mean",),
    )
    assert WAN_CARD.latent_cache_key(
        VideoModelSpec(family="video", pretrained=I2V), tiny.ensure_builtin_model(I2V, CACHE_DIR)
    ) == (
        "image_to_video/i2v",
        ("image_encoder", "image_processor"),
        ("condition_mean", "image_embeds"),
    )


def _validate(tmp_path, capsys, model: dict, sample: dict, cache: bool = True) -> tuple[int, str]:
    import yaml

    from dstune.cli import main

    spec = {
        "model": {"family": "video", "train": "full", **model},
        "data": {
            "path": "builtin:moving-shapes",
            "video": {"frames": 5},
            "cache": {"latents": cache, "text_embeddings": cache},
        },
        "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 4},
        "sample": sample,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["validate", str(path), "--num-gpus", "2", "--json"])
    return code, capsys.readouterr()


def test_validate_plans_image_to_video_offline_and_refuses_what_startup_would(tmp_path, capsys):
    """The image encoder is a frozen companion (cached with the latents, whose entries grow by the condition and
    the CLIP hidden states); TI2V's 16x VAE quarters the tokens; the mode and sample problems name their key."""
    from dstune import registry
    from dstune.families.video_card import token_factors
    from dstune.memory.counts import STORE
    from dstune.models.wan.card import clip_tokens

    code, out = _validate(tmp_path, capsys, {"pretrained": I2V}, {"prompts": []})
    assert code == 0, out
    memory = json.loads(out.out)["memory"]
    assert memory["parameters"]["companions"]["image_encoder"] > 0
    assert "image_encoder" in memory["parameters"]["cached_companions"]
    # per clip: posterior mean+std (2 x 16 x 2 x 4 x 4 float32), condition 16 x 2 x 4 x 4, CLIP 17 x 32 (fp32), text
    per_clip = 4 * (2 * 16 * 32 + 16 * 32 + 17 * 32) + 512 * 32 * 4
    assert memory["cache_disk_bytes"] == 144 * per_clip
    config = json.loads((STORE / "builtin" / "tiny-wan22-ti2v-v1" / "transformer" / "config.json").read_text())
    assert clip_tokens(config, 64, 5, 16) == clip_tokens(config, 32, 5, 8)
    assert token_factors(registry.family_cards("video"), TI2V)[:2] == (
        16,
        (1, 2, 2),
    )  # its VAE's 8x stages, then the VAE's own 2x2 pixel patches
    code, out = _validate(tmp_path, capsys, {"pretrained": I2V}, {"prompts": ["a red circle moving left"]})
    assert code != 0 and "sample.prompts: image-to-video renders each clip from a first frame" in out.err + out.out
    code, out = _validate(tmp_path, capsys, {"image_to_video": True}, {"prompts": []})
    assert (
        code != 0
        and "model.image_to_video: model.image_to_video is true, but this is a text-to-video" in out.err + out.out
    )
    code, out = _validate(tmp_path, capsys, {"pretrained": TI2V, "image_to_video": True}, {"prompts": []})
    assert code == 0, out
    code, out = _validate(tmp_path, capsys, {"pretrained": I2V, "max_sequence_length": 256}, {"prompts": []})
    assert (
        code != 0
        and "model.max_sequence_length: 256: a Wan 2.1 image-to-video transformer takes all but the "
        "last 512 context tokens as the image embedding's"
        in out.err + out.out
    )
    code, out = _validate(tmp_path, capsys, {"pretrained": I2V, "max_sequence_length": 512}, {"prompts": []})
    assert code == 0, out


@pytest.fixture(scope="module")
def a14b_i2v_folder(tmp_path_factory):
    """The Wan 2.2 I2V A14B layout at tiny size: WanImageToVideoPipeline with two 36-channel experts, no image
    encoder (image_dim None) and boundary_ratio 0.9 (the A14B image-to-video value), on tiny-wan's VAE and UMT5."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel

    from dstune.models.wan.builtin import TINY_WAN_TRANSFORMER, WAN_SCHEDULER

    from diffusers import WanPipeline

    parts = WanPipeline.from_pretrained(tiny.ensure_builtin_model("tiny-wan", CACHE_DIR))
    experts = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        experts.append(WanTransformer3DModel(**{**TINY_WAN_TRANSFORMER, "in_channels": 36}))
    pipeline = WanImageToVideoPipeline(
        tokenizer=parts.tokenizer,
        text_encoder=parts.text_encoder,
        vae=parts.vae,
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER),
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=0.9,
    )
    folder = tmp_path_factory.mktemp("a14b-i2v") / "Wan2.2-I2V-A14B-tiny"
    pipeline.save_pretrained(folder, safe_serialization=True)
    return folder


def test_wan22_i2v_a14b_layout_trains_one_expert_from_first_frames(a14b_i2v_folder, tmp_path):
    """Two experts with condition channels and no image encoder: image-to-video is what the folder is; the
    low-noise expert sees timesteps below 0.9 x 1000 only, and its inputs are what WanImageToVideoPipeline feeds
    transformer_2 (mask + condition channels, no image embedding); samples run both experts from a first frame."""
    from diffusers import WanImageToVideoPipeline

    built = build_model(
        VideoModelSpec(family="video", pretrained=str(a14b_i2v_folder), expert="low_noise"), CACHE_DIR, "cpu"
    )
    assert (
        built.mode.image_to_video
        and built.trained_component() == "transformer_2"
        and "image_encoder" not in built.parts
    )
    first, count = built.positions
    assert count > 0 and (built.train_timesteps[first : first + count] < 900).all()
    assert (built.train_timesteps[:first] >= 900).all()
    batch = _batch([3])
    encoded = built.encode_batch(batch)
    assert "image_embeds" not in encoded or encoded["image_embeds"] is None
    pipeline = WanImageToVideoPipeline.from_pretrained(a14b_i2v_folder)
    pipeline.scheduler.set_timesteps(4)
    low_t = [t for t in pipeline.scheduler.timesteps if t < 900][0]
    noisy = per_sample_randn((16, 2, 4, 4), SEED, STEP, [3], "noise")
    seen = {}
    hook = pipeline.transformer_2.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.setdefault("kwargs", kwargs) and None, with_kwargs=True
    )
    try:  # the steps before low_t run `transformer`; the first transformer_2 call is at low_t on these latents
        pipeline.scheduler.set_timesteps(4)
        pipeline(
            image=wan_i2v.frame_images(batch["pixel_values"][:, :, 0])[0],
            prompt_embeds=encoded["encoder_hidden_states"],
            latents=noisy.clone(),
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=1.0,
            output_type="latent",
        )
    finally:
        hook.remove()
    hidden, timestep, extra, _ = wan_i2v.transformer_inputs(
        built, seen["kwargs"]["hidden_states"][:, :16], low_t.reshape(1), encoded
    )
    assert hidden.shape == (1, 36, 2, 4, 4) and torch.allclose(hidden, seen["kwargs"]["hidden_states"], atol=1e-6)
    assert seen["kwargs"].get("encoder_hidden_states_image") is None and not extra.get("encoder_hidden_states_image")
    value = built.loss(built.trainable, encoded, SEED, STEP)
    value.backward()
    assert torch.isfinite(value) and any(p.grad is not None for p in built.trainable.parameters())
    first_frame = tmp_path / "first.png"
    wan_i2v.frame_images(batch["pixel_values"][:, :, 0])[0].save(first_frame)
    prompt = ["a red circle moving left"]
    clips = built.sample(
        built.trainable, prompt, SampleSpec(prompts=prompt, control_images=[str(first_frame)], steps=3), 32
    )
    assert len(clips[0]) == 5 and built.other_expert is None  # both experts ran; the other one is released
