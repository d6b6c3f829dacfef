"""builtin:tiny-sdxl: a Stable-Diffusion-XL-shaped pipeline small enough for CPU tests, built offline.

What makes it SDXL: a UNet with `addition_embed_type="text_time"` (pooled text embeddings plus six size/crop
time ids), two CLIP text encoders (CLIPTextModel + CLIPTextModelWithProjection) whose penultimate hidden states
are concatenated, and SDXL's own noise schedule (epsilon, scaled_linear, "leading" steps). The two encoders have
different widths (32 and 48) on purpose, so a mix-up of which encoder feeds what fails loudly instead of passing.

The VAE is builtin:tiny-sd's trained VAE, copied byte for byte from that model's folder in the same cache (built
first if needed): same latents, and its training is not paid twice. Text encoders and UNet are random.
dstune.builtin registers TINY_SDXL, which names tiny-sd in `needs`; the registry's cache protocol (lock,
marker, atomic rename) applies unchanged. Bump `folder_name` whenever the output changes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, tiny_clip_config, tiny_clip_tokenizer
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, unet_case, unet_case_run
from dstune.memory.activations import unet_structure

TINY_SDXL_SEED = 0
TEXT_ENCODER_WIDTH, TEXT_ENCODER_2_WIDTH = 32, 48
TIME_EMBED_DIM = 8  # per time id; 6 time ids (original size, crop top-left, target size)
TINY_SDXL_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(16, 32),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    norm_num_groups=8,
    transformer_layers_per_block=(1, 1),
    addition_embed_type="text_time",
    addition_time_embed_dim=TIME_EMBED_DIM,
    # the UNet sees [te1 penultimate ; te2 penultimate] and [pooled te2 projection ; embedded time ids]
    cross_attention_dim=TEXT_ENCODER_WIDTH + TEXT_ENCODER_2_WIDTH,
    projection_class_embeddings_input_dim=6 * TIME_EMBED_DIM + TEXT_ENCODER_2_WIDTH,
)
# SDXL base 1.0's scheduler_config.json (epsilon; steps "leading" with offset 1).
TINY_SDXL_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    prediction_type="epsilon",
    timestep_spacing="leading",
    steps_offset=1,
)


def build_tiny_sdxl(out: Path, needs: dict) -> dict:
    """Write the pipeline into the empty folder `out`; returns facts for the builtin marker."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    with quiet_hf_libraries():
        from diffusers import StableDiffusionXLPipeline

    vae_folder = needs["tiny-sd"] / "vae"
    with deterministic_cpu(TINY_SDXL_SEED, BUILD_THREADS):
        text_encoder = CLIPTextModel(tiny_clip_config(TEXT_ENCODER_WIDTH))
        text_encoder_2 = CLIPTextModelWithProjection(tiny_clip_config(TEXT_ENCODER_2_WIDTH))
        unet = UNet2DConditionModel(**TINY_SDXL_UNET)
    with quiet_hf_libraries():
        vae = AutoencoderKL.from_pretrained(vae_folder)
    pipeline = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tiny_clip_tokenizer(),
        tokenizer_2=tiny_clip_tokenizer(),
        unet=unet,
        scheduler=DDPMScheduler(**TINY_SDXL_SCHEDULER),
        add_watermarker=False,
    )
    with quiet_hf_libraries():
        pipeline.save_pretrained(out, safe_serialization=True)
    shutil.rmtree(Path(out) / "vae")
    shutil.copytree(vae_folder, Path(out) / "vae")  # the exact bytes: save_pretrained may re-serialise
    return {
        "unet_parameters": sum(p.numel() for p in unet.parameters()),
        "vae_from": "builtin:tiny-sd",
        "vae_scaling_factor": vae.config.scaling_factor,
    }


TINY_SDXL = BuiltinModel(
    name="tiny-sdxl",
    folder_name="tiny-sdxl-v1",
    family="sdxl",
    description="Stable-Diffusion-XL-shaped pipeline: two CLIP encoders, text_time UNet, 32 px, tiny-sd's VAE",
    build=build_tiny_sdxl,
    needs=("tiny-sd",),
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


SDXL_UNET = dict(
    act_fn="silu",
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    attention_head_dim=[5, 10, 20],
    block_out_channels=[320, 640, 1280],
    cross_attention_dim=2048,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    in_channels=4,
    layers_per_block=2,
    norm_num_groups=32,
    out_channels=4,
    projection_class_embeddings_input_dim=2816,
    transformer_layers_per_block=[1, 2, 10],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    use_linear_projection=True,
)


ACTIVATION_CASES = (
    Case(
        "sdxl-unet",
        "SDXL UNet (channels / 5)",
        unet_case(SDXL_UNET),
        unet_case_run,
        sizes=((64, 77), (256, 77)),
        check_size=(144, 77),
        check_heads=1,
        check_precision="fp32",
        extra={"structure": unet_structure(SDXL_UNET)},
    ),
)
