"""The Stable Diffusion 1.x / 2.x and SDXL (UNet) unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, image

UNIT = ModelUnit(
    name="sd",
    title="Stable Diffusion 1.x / 2.x and SDXL (UNet)",
    docs="docs/family-sdxl.md",
    names=r"sdxl|sd15|sd 1\.x|stable diffusion(?! 3)",
    spec_sections=("dstune.models.sd.spec:SdModelSpec", "dstune.models.sd.spec:SdxlModelSpec"),
    families={"sd": "dstune.models.sd.sd_family", "sdxl": "dstune.models.sd.sdxl_family"},
    facts=("dstune.models.sd.facts:SD_FACTS", "dstune.models.sd.facts:SDXL_FACTS"),
    activation_cases=("dstune.models.sd.builtin_sd:ACTIVATION_CASES",),
    builtins={
        "tiny-sd": "dstune.models.sd.builtin_sd:TINY_SD",
        "tiny-sdxl": "dstune.models.sd.builtin_sdxl:TINY_SDXL",
    },
    checkpoint_layouts={
        "conditioner.embedders.": ("sdxl", "an SDXL checkpoint (model.family sdxl)"),
        "model.diffusion_model.label_emb.": ("sdxl", "an SDXL checkpoint (model.family sdxl)"),
    },
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
