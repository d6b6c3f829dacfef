"""The `model` section of SDXL (`model.family sdxl`, a UNet family), listed in the spec's union by
dstune.registry.FAMILY_SECTIONS. Torch-free."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from dstune.spec.model_sections import UNET_LORA_FORMATS, DenoiserModelBase


class SdxlModelSpec(DenoiserModelBase):
    PRESET_NAME: ClassVar[str] = "SDXL's size"
    LORA_FORMATS: ClassVar[dict[str, str]] = UNET_LORA_FORMATS
    SINGLE_FILE: ClassVar[bool] = True

    family: Literal["sdxl"] = Field(
        description="Model family. `sdxl`: Stable Diffusion XL (UNet with text_time conditioning, two CLIP text "
        "encoders, pooled text embeddings and size/crop time ids)."
    )
    pretrained: str = Field(
        "builtin:tiny-sdxl",
        description="A diffusers StableDiffusionXLPipeline folder (model_index.json + unet/vae/text_encoder/"
        "text_encoder_2/tokenizer/tokenizer_2/scheduler), a hub id already in the local Hugging Face cache, "
        "`builtin:tiny-sdxl` (a tiny model built offline), or a single checkpoint file (.safetensors/.ckpt, original "
        "key layout) together with `base_pipeline`.",
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
