"""Stable Diffusion 1.x / 2.x's card (torch-free, `model.family sd`): StableDiffusionPipeline folders (a UNet, one
CLIP text encoder, an AutoencoderKL), trained as diffusers' examples/text_to_image/train_text_to_image.py trains
them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dstune.card import ModelPreset, image
from dstune.families.folders import read_component_config
from dstune.families.unet_card import SingleFile, UnetCard, latent_channel_problems, unet_components
from dstune.memory.working import TextWork, VaeWork


@dataclass(frozen=True, kw_only=True)
class SdCard(UnetCard):
    def config_mismatches(self, folder: Path) -> list[str]:
        unet, vae = read_component_config(folder, "unet"), read_component_config(folder, "vae")
        text = read_component_config(folder, "text_encoder")
        problems = []
        if unet.get("addition_embed_type") is not None:
            problems.append(
                f"the UNet has addition_embed_type {unet['addition_embed_type']!r} (a UNet with pooled-text and "
                "time-id conditioning: another model's)"
            )
        problems += latent_channel_problems(unet, vae)
        if unet.get("cross_attention_dim") != text.get("hidden_size"):
            problems.append(
                f"unet cross_attention_dim {unet.get('cross_attention_dim')} != text_encoder hidden_size "
                f"{text.get('hidden_size')}"
            )
        return problems


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKL": VaeWork(
        encode=10.0, decode=12.004, measured_on="hub/stable-diffusion-v1-5/stable-diffusion-v1-5/vae"
    ),
    "CLIPTextModel": TextWork(hidden=8.0, ffn=6.0, square=1.0, measured_on="builtin/tiny-sd-v3/text_encoder"),
}


SD_CARD = SdCard(
    working=WORKING_MEMORY,
    guidance_batch=2,  # StableDiffusionPipeline: guidance's two halves in one batch
    key="sd",
    name="Stable Diffusion 1.x / 2.x",
    family="sd",
    unit="sd",
    model_class="dstune.models.sd.model:Sd",
    docs="docs/training.md",
    names=r"sd15|sd 1\.x|stable diffusion(?! 3| xl)",
    summary="Stable Diffusion 1.x/2.x (StableDiffusionPipeline: a UNet, one CLIP text encoder)",
    folder_classes={"StableDiffusionPipeline": 7.5},
    transformer_class="UNet2DConditionModel",
    pipeline_class="StableDiffusionPipeline",
    components={},  # unet_components: a class set and a required file per component
    unet_components=unet_components(("text_encoder", "CLIPTextModel")),
    text_tensors=("encoder_hidden_states",),
    text_cache_folders=("text_encoder", "tokenizer"),
    # the original layout: UNet under model.diffusion_model., VAE under first_stage_model., the CLIP text encoder
    # under cond_stage_model. (SD 2.x: its OpenCLIP naming)
    single_file=SingleFile(
        "unet", ("model.diffusion_model.",), {"vae": ("first_stage_model.",), "text_encoder": ("cond_stage_model.",)}
    ),
    activation_cases="dstune.models.sd.builtin:ACTIVATION_CASES",
    builtins={"tiny-sd": "dstune.models.sd.builtin:TINY_SD"},
    presets=(
        ModelPreset(
            "sd15",
            "Stable Diffusion 1.5 (UNet, CLIP ViT-L text encoder)",
            "sd",
            "stable-diffusion-v1-5/stable-diffusion-v1-5",
            "tiny-sd",
            image(
                512,
                7.5,
                30,
                **{"train.micro_batch_size": 4, "train.optimizer.lr": 1.0e-5, "model.gradient_checkpointing": True},
            ),
        ),
    ),
)
