"""The `model` section of the video families (wan). Re-exported by dstune.spec.models; torch-free like the rest of
the spec."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from dstune.spec.model_sections import DenoiserModelBase


class WanModel(DenoiserModelBase):
    family: Literal["wan"] = Field(
        description="Model family. `wan`: Wan 2.1 / 2.2 video (WanTransformer3DModel, AutoencoderKLWan, UMT5): "
        "text-to-video, image-to-video (Wan 2.1 I2V with its CLIP image encoder, Wan 2.2 I2V A14B) and Wan 2.2 TI2V "
        "5B, trained on clips by flow matching. See docs/family-wan.md."
    )
    pretrained: str = Field(
        "builtin:tiny-wan",
        description="A diffusers WanPipeline or WanImageToVideoPipeline folder (model_index.json + transformer/vae/"
        "text_encoder/tokenizer/scheduler, and image_encoder/image_processor for Wan 2.1 I2V), e.g. "
        "Wan-AI/Wan2.1-T2V-14B-Diffusers already in the local Hugging Face cache, or a tiny model built offline: "
        "`builtin:tiny-wan`, `builtin:tiny-wan22` (two experts), `builtin:tiny-wan-i2v` (Wan 2.1 I2V layout), "
        "`builtin:tiny-wan22-ti2v` (Wan 2.2 TI2V layout).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in backward (torch non-reentrant "
        "checkpointing): activations grow with frames x height x width tokens, so real clips need it."
    )
    timestep_sampling: Literal["logit_normal", "uniform", "mode"] = Field(
        "uniform",
        description="How u in [0, 1] is drawn (diffusers' compute_density_for_timestep_sampling); u indexes the "
        "shifted timestep/sigma tables of the scheduler (see `shift`). uniform, logit_normal (logit_mean, "
        "logit_std) or mode (mode_scale).",
    )
    logit_mean: Optional[float] = Field(None, description="logit_normal only: the normal's mean. Omitted: 0.0.")
    logit_std: Optional[float] = Field(None, gt=0, description="logit_normal only: its std. Omitted: 1.0.")
    mode_scale: Optional[float] = Field(None, description="mode only: how strongly mid timesteps are favoured. "
                                        "Omitted: 1.29.")
    shift: Optional[float] = Field(
        None, gt=0, description="Timestep shift of the training tables (sigma -> shift sigma / (1 + (shift - 1) "
        "sigma)). Omitted: the scheduler's: UniPC's flow_shift (Wan 2.1: 3.0 at 480p, 5.0 at 720p) or "
        "FlowMatchEulerDiscreteScheduler's shift.",
    )
    loss_weighting: Literal["none", "cosmap"] = Field(
        "none", description="Per-sample loss weight (diffusers' compute_loss_weighting_for_sd3).")
    max_sequence_length: Optional[int] = Field(
        None, gt=0, description="UMT5 tokens per caption (zero-padded, as WanPipeline pads them). Omitted: 512, at "
        "most the tokenizer's model_max_length.",
    )

    expert: Optional[Literal["high_noise", "low_noise"]] = Field(
        None, description="Two-expert folders only (Wan 2.2 A14B: `transformer` and `transformer_2` with a "
        "boundary_ratio): which expert this run trains. `high_noise`: `transformer`, on the timesteps at or above "
        "boundary_ratio x 1000; `low_noise`: `transformer_2`, on those below. The other expert stays frozen in host "
        "memory and joins only for samples. Required for such folders, refused for one-expert ones.")
    image_to_video: Optional[bool] = Field(
        None, description="Train image-to-video: every clip is denoised from its own first frame, conditioned as "
        "WanImageToVideoPipeline conditions it (Wan 2.1 I2V / 2.2 I2V A14B: the first frame and zeros VAE-encoded, "
        "a first-frame mask, and Wan 2.1's CLIP image embedding; Wan 2.2 TI2V: the first latent frame replaced by "
        "the clean image latent, its tokens at timestep 0, left out of the loss). Omitted: what the folder is "
        "(image-to-video folders: true; text-to-video folders and Wan 2.2 TI2V: false). true on a text-to-video "
        "folder and false on an image-to-video one are refused. Samples then render from sample.control_images "
        "(one first frame per prompt).")
    sample_frames: int = Field(
        5, gt=0, description="Frames of each clip rendered for `sample.prompts` during training (4k+1; the samples "
        "page plays them as animated PNGs).")

    @model_validator(mode="after")
    def _no_unused_sampling_settings(self) -> "WanModel":
        used = {"logit_normal": {"logit_mean", "logit_std"}, "mode": {"mode_scale"}, "uniform": set()}
        unused = sorted(name for name in {"logit_mean", "logit_std", "mode_scale"} - used[self.timestep_sampling]
                        if getattr(self, name) is not None)
        if unused:
            raise ValueError(f"{', '.join(unused)} only apply to another timestep_sampling (it is "
                             f"{self.timestep_sampling!r}): remove them or change timestep_sampling")
        if (self.sample_frames - 1) % 4:
            raise ValueError(f"sample_frames {self.sample_frames} is not 4k+1 (the VAE keeps the first frame and "
                             "compresses the rest 4x)")
        return self
