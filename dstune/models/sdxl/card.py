"""SDXL's card (torch-free, `model.family sdxl`): StableDiffusionXLPipeline folders (a UNet with text_time
conditioning, two CLIP text encoders, an AutoencoderKL), trained as diffusers'
examples/text_to_image/train_text_to_image_sdxl.py trains them: both encoders' penultimate hidden states, the
second's pooled projection and six size/crop time ids per image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dstune.card import ModelPreset, image
from dstune.families.folders import read_component_config
from dstune.families.unet_card import SingleFile, UnetCard, latent_channel_problems, unet_components
from dstune.memory.working import TextWork, VaeWork


@dataclass(frozen=True, kw_only=True)
class SdxlCard(UnetCard):
    time_ids: int  # the time ids per sample: original (h, w), crop top-left (top, left), target (h, w)

    def missing_hint(self, component: str) -> str:
        return " (an SDXL refiner, which has no text_encoder, is not supported)" if component == "text_encoder" else ""

    def config_mismatches(self, folder: Path) -> list[str]:
        def config(name: str) -> dict:
            return read_component_config(folder, name)

        unet, vae, te1, te2 = config("unet"), config("vae"), config("text_encoder"), config("text_encoder_2")
        problems = []
        if unet.get("addition_embed_type") != "text_time":
            problems.append(
                f"the UNet has addition_embed_type {unet.get('addition_embed_type')!r}, not 'text_time' "
                "(a UNet without pooled-text conditioning? use model.family: sd)"
            )
        problems += latent_channel_problems(unet, vae)
        hidden = (te1.get("hidden_size") or 0) + (te2.get("hidden_size") or 0)
        if unet.get("cross_attention_dim") != hidden:
            problems.append(
                f"unet cross_attention_dim {unet.get('cross_attention_dim')} != text_encoder hidden_size + "
                f"text_encoder_2 hidden_size ({hidden})"
            )
        pooled_and_times = self.time_ids * (unet.get("addition_time_embed_dim") or 0) + (te2.get("projection_dim") or 0)
        if (
            unet.get("addition_embed_type") == "text_time"
            and unet.get("projection_class_embeddings_input_dim") != pooled_and_times
        ):
            problems.append(
                f"unet projection_class_embeddings_input_dim {unet.get('projection_class_embeddings_input_dim')}"
                f" != {self.time_ids} x addition_time_embed_dim + text_encoder_2 projection_dim ({pooled_and_times}): "
                "a refiner-style UNet (aesthetic score) is not supported"
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
    "CLIPTextModelWithProjection": TextWork(
        hidden=8.0, ffn=6.0, square=1.0, measured_on="builtin/tiny-sdxl-v1/text_encoder_2"
    ),
}


SDXL_CARD = SdxlCard(
    working=WORKING_MEMORY,
    guidance_batch=2,  # StableDiffusionXLPipeline: guidance's two halves in one batch
    key="sdxl",
    name="Stable Diffusion XL",
    family="sdxl",
    unit="sdxl",
    model_class="dstune.models.sdxl.model:Sdxl",
    docs="docs/family-sdxl.md",
    names=r"sdxl|stable diffusion xl",
    summary="Stable Diffusion XL base (StableDiffusionXLPipeline: a UNet with text_time conditioning, two CLIP text "
    "encoders)",
    folder_classes={"StableDiffusionXLPipeline": 5.0},
    transformer_class="UNet2DConditionModel",
    pipeline_class="StableDiffusionXLPipeline",
    components={},
    unet_components=unet_components(
        ("text_encoder", "CLIPTextModel"), ("text_encoder_2", "CLIPTextModelWithProjection")
    ),
    text_tensors=("encoder_hidden_states", "text_embeds"),
    text_cache_folders=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    time_ids=6,
    # the original layout: UNet under model.diffusion_model., VAE under first_stage_model., the two text encoders
    # under conditioner.embedders.0. (CLIP ViT-L) and .1. (OpenCLIP ViT-bigG)
    single_file=SingleFile(
        "unet",
        ("model.diffusion_model.",),
        {
            "vae": ("first_stage_model.",),
            "text_encoder": ("conditioner.embedders.0.",),
            "text_encoder_2": ("conditioner.embedders.1.",),
        },
    ),
    checkpoint_layouts={
        "conditioner.embedders.": "an SDXL checkpoint (model.family sdxl)",
        "model.diffusion_model.label_emb.": "an SDXL checkpoint (model.family sdxl)",
    },
    activation_cases="dstune.models.sdxl.builtin:ACTIVATION_CASES",
    builtins={"tiny-sdxl": "dstune.models.sdxl.builtin:TINY_SDXL"},
    presets=(
        ModelPreset(
            "sdxl",
            "Stable Diffusion XL base 1.0 (UNet, two CLIP text encoders)",
            "sdxl",
            "stabilityai/stable-diffusion-xl-base-1.0",
            "tiny-sdxl",
            image(1024, 5.0, 30, **{"train.optimizer.lr": 1.0e-5, "model.gradient_checkpointing": True}),
        ),
    ),
)
