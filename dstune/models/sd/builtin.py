"""builtin:tiny-sd: a Stable-Diffusion-1.x-shaped pipeline with a trained tiny VAE (see dstune.builtin)."""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import (
    BUILD_THREADS,
    BuiltinModel,
    deterministic_cpu,
    tiny_clip_config,
    tiny_clip_tokenizer,
    train_tiny_vae,
)
from dstune.builtin.trained import TrainedPart, give_trained_weights
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, unet_case, unet_case_run
from dstune.memory.activations import unet_structure


TINY_SD_SEED = 0
VAE_PART = TrainedPart("tiny-sd-vae", train_tiny_vae)  # its VAE, trained on the shapes (dstune.builtin.trained)
TINY_SD_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=8,
)
# Two blocks: spatial factor 2 (32 px -> 16x16 latents). One norm group: with several groups, GroupNorm over a
# flat-coloured image erases most of the absolute colour, and this VAE has too few channels to carry it otherwise.
TINY_SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(8, 16),
    layers_per_block=1,
    norm_num_groups=1,
    sample_size=32,
    mid_block_add_attention=False,
)
# SD's schedule, rescaled to zero terminal SNR (Lin et al. 2024), hence v-prediction and "trailing" sampling steps.
# SD's own schedule leaves 7% of the image in x_T; on 16x16 latents that leak carries the mean colour as clearly as
# the caption does, the model learns to read it, and at sampling the colour comes from the seed, not the prompt.
TINY_SD_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    prediction_type="v_prediction",
    rescale_betas_zero_snr=True,
    timestep_spacing="trailing",
    steps_offset=1,
)


def build_tiny_sd(out: Path, needs: dict) -> dict:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    with quiet_hf_libraries():
        from diffusers import StableDiffusionPipeline

    with deterministic_cpu(TINY_SD_SEED, BUILD_THREADS):
        text_encoder = CLIPTextModel(tiny_clip_config())
        unet = UNet2DConditionModel(**TINY_SD_UNET)
        vae = AutoencoderKL(**TINY_SD_VAE)
        facts = give_trained_weights(VAE_PART, vae)
    vae.register_to_config(scaling_factor=facts["vae_scaling_factor"])
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tiny_clip_tokenizer(),
        unet=unet,
        scheduler=DDPMScheduler(**TINY_SD_SCHEDULER),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    with quiet_hf_libraries():
        pipeline.save_pretrained(out, safe_serialization=True)
    facts["unet_parameters"] = sum(p.numel() for p in unet.parameters())
    return facts


TINY_SD = BuiltinModel(
    name="tiny-sd",
    folder_name="tiny-sd-v3",
    family="sd",
    description="Stable-Diffusion-1.x-shaped pipeline: 0.8 M-parameter UNet, 32 px images, trained tiny VAE",
    build=build_tiny_sd,
    trained_parts=(VAE_PART.name,),
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


SD15_UNET = dict(
    act_fn="silu",
    attention_head_dim=8,
    block_out_channels=[320, 640, 1280, 1280],
    cross_attention_dim=768,
    layers_per_block=2,
    norm_num_groups=32,
    in_channels=4,
    out_channels=4,
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
)

ACTIVATION_CASES = (
    Case(
        "sd15-unet",
        "SD 1.x/2.x UNet (SD 1.5 structure, channels / 5)",
        unet_case(SD15_UNET),
        unet_case_run,
        sizes=((64, 77), (256, 77)),
        check_size=(576, 77),
        check_heads=1,
        check_precision="fp32",
        extra={"structure": unet_structure(SD15_UNET)},
    ),
)
