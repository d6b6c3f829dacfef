"""The `model` section of Stable Diffusion 1.x/2.x (`model.family sd`, a UNet family), listed in the spec's union by
dstune.registry.FAMILY_SECTIONS. Torch-free."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from dstune.spec.model_sections import UNET_LORA_FORMATS, DenoiserModelBase


class SdModelSpec(DenoiserModelBase):
    PRESET_RESOLUTION: ClassVar[int] = 512
    PRESET_NAME: ClassVar[str] = "Stable Diffusion 1.x's size"
    PRESET_GUIDANCE: ClassVar[float] = 7.5
    LORA_FORMATS: ClassVar[dict[str, str]] = UNET_LORA_FORMATS
    SINGLE_FILE: ClassVar[bool] = True

    family: Literal["sd"] = Field(
        description="Model family. `sd`: Stable Diffusion 1.x/2.x (UNet, one CLIP text encoder)."
    )
    pretrained: str = Field(
        "builtin:tiny-sd",
        description="A diffusers pipeline folder (model_index.json + unet/vae/text_encoder/tokenizer/scheduler), "
        "a hub id already in the local Hugging Face cache, `builtin:tiny-sd` (a tiny model built offline), or a "
        "single checkpoint file (.safetensors/.ckpt, original key layout) together with `base_pipeline`.",
    )
    prediction: Optional[Literal["epsilon", "v_prediction"]] = Field(
        None, description="What the UNet predicts. Omitted: taken from the pipeline's scheduler config."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute UNet activations in backward (torch non-reentrant checkpointing): less memory, ~30% slower.",
    )
    min_snr_gamma: Optional[float] = Field(
        None, gt=0, description="Min-SNR loss weighting (Hang et al. 2023); 5.0 is the usual value. Omitted: plain MSE."
    )
    noise_offset: float = Field(
        0.0, ge=0, description="Offset noise strength (0.05-0.1 helps very dark/bright images)."
    )
