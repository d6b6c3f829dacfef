"""HunyuanVideo 1.5 (its card and class, dstune.models.hunyuan_video15; model.family video, chosen by the folder) on
builtin:tiny-hunyuan-video15 and its image-to-video twin: the loss
against the official trainer's loss lines, the training tables, samples and the export the pipeline loads.

The reference re-computes the loss lines of Tencent-Hunyuan/HunyuanVideo-1.5's train.py (prepare_batch and
train_step): latents = the VAE posterior's sample x scaling_factor (encode_vae), get_condition's zeros of
latent channels + 1 for text-to-video, timestep_transform's shift of t / T, LinearInterpolationSchedule's
x_t = (1 - t / T) x0 + (t / T) noise, target noise - x0, the transformer on cat([x_t, condition]) at t, and
nn.functional.mse_loss over the whole batch. Its model is the official one; the reference feeds diffusers'
HunyuanVideo15Transformer3DModel instead, with the text tensors of HunyuanVideo15Pipeline.encode_prompt and the
zero image embedding HunyuanVideo15Pipeline gives text-to-video. The draws are dstune's (each sample's own
generator): the posterior draw, the noise and t, which the reference takes at the training table's entry u picks
(its own t is continuous; docs/family-hunyuan-video15.md lists this and the other differing defaults).
"""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.families import card_of
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.hunyuan_video15.card import HUNYUAN_VIDEO15_CARD, TRAIN_SHIFT, VISION_TOKENS
from dstune.models.hunyuan_video15.model import HunyuanVideo15
from dstune.pretrained import build_model
from dstune.spec.models import VideoModelSpec
from loaded_models import CACHE_DIR, with_attributes, with_settings
from tiny_batches import clip_batch

NAME = "builtin:tiny-hunyuan-video15"
SEED, STEP, INDICES = 7, 5, [3, 11]
TEXT_TOKENS = 48  # model.max_sequence_length: the tiny model's Qwen side, short to keep the test quick


@pytest.fixture(scope="module")
def built():
    return build_model(
        VideoModelSpec(family="video", pretrained=NAME, max_sequence_length=TEXT_TOKENS), CACHE_DIR, "cpu"
    )


def _reference_timestep_transform(timesteps: torch.Tensor, total: int, shift: float) -> torch.Tensor:
    """train.py's timestep_transform: t / T -> shift t / (1 + (shift - 1) t), back in [0, T]."""
    if shift == 1.0:
        return timesteps
    normalised = timesteps / total
    return shift * normalised / (1 + (shift - 1) * normalised) * total


def _reference_loss(built, encoded: dict, timesteps: torch.Tensor) -> torch.Tensor:
    """train.py's loss lines for text-to-video at `timesteps` (B,), from dstune's posterior draw and noise."""
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    latents = (
        mean + std * per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "vae_posterior")
    ) * built.vae.config.scaling_factor
    noise = per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "noise")
    b, c, f, h, w = latents.shape
    cond_latents = torch.zeros([b, c + 1, f, h, w])  # get_condition(latents, "t2v")
    t = (timesteps / 1000).view(-1, 1, 1, 1, 1)
    latents_noised = (1 - t) * latents + t * noise
    target = noise - latents
    with torch.no_grad():
        model_pred = built.trainable(
            hidden_states=torch.cat([latents_noised, cond_latents], dim=1),
            timestep=timesteps,
            encoder_hidden_states=encoded["encoder_hidden_states"],
            encoder_attention_mask=encoded["encoder_attention_mask"],
            encoder_hidden_states_2=encoded["encoder_hidden_states_2"],
            encoder_attention_mask_2=encoded["encoder_attention_mask_2"],
            image_embeds=torch.zeros(b, VISION_TOKENS, built.transformer_config["image_embed_dim"]),
            return_dict=False,
        )[0]
    return torch.nn.functional.mse_loss(model_pred, target.to(model_pred.dtype))


CASES = {  # dstune's settings: the trainer's defaults (lognorm t, shift 3.0), then another sampling and shift
    "trainer-defaults": dict(timestep_sampling="logit_normal"),
    "uniform-shift-5": dict(timestep_sampling="uniform", shift=5.0),
}


def test_builtins_are_hunyuan_video15_folders(built):
    for name in ("tiny-hunyuan-video15", "tiny-hunyuan-video15-i2v"):
        assert card_of("video", tiny.ensure_builtin_model(name, CACHE_DIR)) is HUNYUAN_VIDEO15_CARD
    assert built.card is HUNYUAN_VIDEO15_CARD and type(built) is HunyuanVideo15


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_the_official_trainers_loss_lines(built, case):
    model = with_settings(built, **CASES[case])
    if model.model_spec.shift is not None:  # the tables its load makes of model.shift
        model = with_attributes(model, **dict(zip(("train_timesteps", "train_sigmas"), model.train_tables())))
    encoded = model.encode_batch(clip_batch(INDICES, SEED))
    assert encoded["encoder_hidden_states"].shape[1] == TEXT_TOKENS
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    timesteps = model.train_timesteps[(u * 1000).long()]
    with torch.no_grad():
        ours = model.loss(model.trainable, encoded, SEED, STEP)
    assert ours.item() == pytest.approx(_reference_loss(model, encoded, timesteps).item(), rel=1e-5)


def test_training_tables_are_the_trainers_shifted_timesteps(built):
    """The tables u indexes are train.py's timestep_transform (shift 3.0 unless model.shift) of the unshifted
    1000-step grid, not the folder scheduler's sampling shift (5.0 for 480p)."""
    assert built.scheduler.config.shift == 5.0 and TRAIN_SHIFT == 3.0
    grid = torch.linspace(1000, 1, 1000)
    assert torch.allclose(built.train_timesteps, _reference_timestep_transform(grid, 1000, 3.0), atol=1e-3)
    assert torch.allclose(built.train_sigmas * 1000, built.train_timesteps, atol=1e-3)


def test_samples_render_as_clips_at_sample_guidance(built, tmp_path):
    """Samples: the folder's pipeline, its guider rebuilt at sample.guidance (1.0: one pass per step, 6.0 the
    classifier-free two), model.sample_frames frames each, saved as an animated WebP with an MP4 beside it."""
    import av

    from dstune.families.samples import save_clip_grid
    from dstune.spec.models import SampleSpec

    passes = []
    hook = built.trainable.register_forward_hook(lambda module, args, output: passes.append(1))
    try:
        guided = built.sample(built.trainable, ["a red circle moving left"], SampleSpec(steps=2, guidance=6.0), 32)
        count_guided = len(passes)
        plain = built.sample(built.trainable, ["a red circle moving left"], SampleSpec(steps=2, guidance=1.0), 32)
    finally:
        hook.remove()
    assert (count_guided, len(passes) - count_guided) == (4, 2)
    assert len(guided[0]) == 5 and guided[0][0].size == (32, 32) and len(plain[0]) == 5
    assert save_clip_grid(guided, ["a red circle moving left"], tmp_path / "step-000001.png").suffix == ".webp"
    with av.open(str(tmp_path / "step-000001.mp4")) as container:
        assert len(list(container.decode(container.streams.video[0]))) == 5


def test_export_loads_and_renders_and_the_lora_file_loads_into_the_pipelines_transformer(built, tmp_path):
    """The full export is a HunyuanVideo15Pipeline folder that loads and renders; the LoRA file (written by the
    HunyuanVideo LoRA loader's save_lora_weights: HunyuanVideo15Pipeline has no LoRA loader in diffusers 0.42) loads
    into the pipeline's transformer with load_lora_adapter and gives the trained adapters' loss."""
    from diffusers import HunyuanVideo15Pipeline
    from safetensors.torch import load_file

    from dstune.families.lora import apply_train_mode, export_lora

    state = {name: value + 0.01 for name, value in built.trainable.state_dict().items()}
    out = built.export(state, tmp_path / "full")
    saved = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(saved[k], state[k]) for k in state)
    pipeline = HunyuanVideo15Pipeline.from_pretrained(out)
    frames = pipeline(
        "a red circle moving left",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).frames
    assert frames.shape == (1, 5, 32, 32, 3) and torch.isfinite(torch.as_tensor(frames)).all()

    spec = VideoModelSpec(family="video", pretrained=NAME, train="lora", max_sequence_length=TEXT_TOKENS)
    model = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(model, spec, seed=0)
    with torch.no_grad():
        for name, param in model.trainable.named_parameters():
            if ".lora_B." in name:  # B starts at zero: "train" it
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    lora = export_lora(
        model, {k: v.detach().clone() for k, v in model.trainable.state_dict().items()}, tmp_path / "lora", spec
    )
    encoded = model.encode_batch(clip_batch([1], SEED))
    pipeline = HunyuanVideo15Pipeline.from_pretrained(model.folder)
    with torch.no_grad():
        base_loss = model.loss(pipeline.transformer, encoded, 0, 1)
    pipeline.transformer.load_lora_adapter(
        str(lora), weight_name="pytorch_lora_weights.safetensors", prefix="transformer"
    )
    with torch.no_grad():
        trained_loss, loaded = (model.loss(module, encoded, 0, 1) for module in (model.trainable, pipeline.transformer))
    assert loaded.item() == pytest.approx(trained_loss.item(), rel=1e-6) and loaded.item() != base_loss.item()


# ------------------------------------------------------------------------------------------- image-to-video
I2V_NAME = "builtin:tiny-hunyuan-video15-i2v"


@pytest.fixture(scope="module")
def i2v():
    return build_model(
        VideoModelSpec(
            family="video", pretrained=I2V_NAME, max_sequence_length=TEXT_TOKENS, timestep_sampling="logit_normal"
        ),
        CACHE_DIR,
        "cpu",
    )


def test_image_to_video_loss_equals_the_trainers_i2v_lines(i2v):
    """train.py's i2v task: get_condition(latents, "i2v") (the first latent frame and a mask channel of ones on it),
    vision_states of the first frame, the loss over every frame. The condition is the first frame's posterior mean
    (dstune; the pipeline's mode of the first frame encoded alone, which the causal VAE makes the same latents),
    where train.py takes that frame of its posterior sample: the one difference, documented."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    from dstune.models.hunyuan_video15.i2v import frame_images

    batch = clip_batch(INDICES, SEED)
    encoded = i2v.encode_batch(batch)
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    scale = i2v.vae.config.scaling_factor
    first = [
        HunyuanVideo15ImageToVideoPipeline._get_image_latents(i2v.vae, pipeline_processor(i2v), image, 32, 32, "cpu")
        for image in frame_images(batch["pixel_values"][:, :, 0])
    ]
    assert torch.allclose(torch.cat(first), mean[:, :, :1] * scale, atol=1e-5)
    embeds = torch.cat(
        [
            HunyuanVideo15ImageToVideoPipeline._get_image_embeds(
                i2v.parts["image_encoder"], i2v.parts["feature_extractor"], image, "cpu"
            )
            for image in frame_images(batch["pixel_values"][:, :, 0])
        ]
    )
    assert torch.allclose(encoded["image_embeds"], embeds, atol=1e-6) and embeds.abs().sum() > 0

    latents = (mean + std * per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "vae_posterior")) * scale
    noise = per_sample_randn(mean.shape[1:], SEED, STEP, INDICES, "noise")
    u = timestep_density(i2v.model_spec, SEED, STEP, INDICES)
    timesteps = i2v.train_timesteps[(u * 1000).long()]
    b, c, f, h, w = latents.shape
    cond = torch.zeros([b, c + 1, f, h, w])
    cond[:, :-1, :1] = mean[:, :, :1] * scale
    cond[:, -1, 0] = 1
    t = (timesteps / 1000).view(-1, 1, 1, 1, 1)
    with torch.no_grad():
        model_pred = i2v.trainable(
            hidden_states=torch.cat([(1 - t) * latents + t * noise, cond], dim=1),
            timestep=timesteps,
            image_embeds=embeds,
            return_dict=False,
            **{
                name: encoded[name]
                for name in (
                    "encoder_hidden_states",
                    "encoder_attention_mask",
                    "encoder_hidden_states_2",
                    "encoder_attention_mask_2",
                )
            },
        )[0]
        ours = i2v.loss(i2v.trainable, encoded, SEED, STEP)
    reference = torch.nn.functional.mse_loss(model_pred, noise - latents)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)


def pipeline_processor(built):
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    return HunyuanVideo15ImageProcessor(vae_scale_factor=built.vae.config.spatial_compression_ratio)


def test_image_to_video_caches_the_image_embedding_and_renders_from_first_frames(i2v, tmp_path):
    """The latent cache's extras are the first frame's SigLIP embedding, keyed by the image encoder's folders;
    samples render from sample.control_images; a text-to-video folder refuses model.image_to_video: true."""
    from PIL import Image

    from dstune.families.base import FamilyError
    from dstune.spec.models import SampleSpec

    clips = clip_batch(INDICES, SEED)["pixel_values"]
    assert i2v.card.latent_cache_key(i2v.model_spec, i2v.folder) == (
        "image_to_video/hunyuan_video15",
        ("image_encoder", "feature_extractor"),
        ("image_embeds",),
    )
    stored = i2v.condition_tensors(clips)
    cached = i2v.encode_batch({**clip_batch(INDICES, SEED), **stored})
    assert torch.equal(cached["image_embeds"], i2v.encode_batch(clip_batch(INDICES, SEED))["image_embeds"])
    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "first.png")
    spec = SampleSpec(
        prompts=["a red circle moving left"], steps=2, guidance=1.0, control_images=[str(tmp_path / "first.png")]
    )
    clips = i2v.sample(i2v.trainable, spec.prompts, spec, 32)
    assert len(clips[0]) == 5 and clips[0][0].size == (32, 32)
    with pytest.raises(FamilyError, match="image_to_video is true"):
        build_model(VideoModelSpec(family="video", pretrained=NAME, image_to_video=True), CACHE_DIR, "cpu")


def test_text_cache_entries_are_keyed_by_both_text_encoders_and_wans_keys_stay_as_they_were(built):
    """A cached caption's tensors depend on the Qwen and the ByT5 sides, so both folders key the entries; a Wan
    folder's key is its UMT5 and tokenizer only, as before HunyuanVideo 1.5 joined the family."""
    card = card_of("video", built.folder)
    assert card.text_cache_folders == ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    assert card.text_tensors == (
        "encoder_hidden_states",
        "encoder_attention_mask",
        "encoder_hidden_states_2",
        "encoder_attention_mask_2",
    )
    wan_folder = tiny.ensure_builtin_model("builtin:tiny-wan", CACHE_DIR)
    assert card_of("video", wan_folder).text_cache_folders == ("text_encoder", "tokenizer")
    assert card_of("video", wan_folder).text_tensors == ("encoder_hidden_states",)
