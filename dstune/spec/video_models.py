"""The `model` section of the video family (the flow-matching core's video models: dstune.families.flow_model, their
cards dstune.families.video_card). Re-exported by dstune.spec.models; torch-free like the rest of the spec."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from dstune.spec.model_sections import (
    VAE_LATENTS_DESCRIPTION,
    DenoiserModelBase,
    checked_transformer_file,
    first_builtin,
    text_encoder_offload_field,
    transformer_file_field,
)
from dstune.spec.section import VIDEO_FAMILY, VIDEO_FAMILY_ALIAS


class VideoModelSpec(DenoiserModelBase):
    """The video family's `model` section (`model.family` VIDEO_FAMILY, or its old name VIDEO_FAMILY_ALIAS, which
    is read as VIDEO_FAMILY: dstune.spec.load notes it)."""

    modality: ClassVar[str] = "video"  # what the data is (dstune.spec.models.VIDEO_FAMILIES, AUDIO_FAMILIES)
    PRESET_RESOLUTION: ClassVar[int] = 480
    # the pipelines' save_lora_weights file; `comfyui`: the original checkpoint's layer names, where the model's card
    # gives them (its original_lora_names; validate refuses it for the others)
    LORA_FORMATS: ClassVar[dict[str, str]] = {"diffusers": "diffusers", "comfyui": "original"}
    PRESET_NAME: ClassVar[str] = "the video models' usual frame height"

    family: Literal[VIDEO_FAMILY, VIDEO_FAMILY_ALIAS] = Field(
        description=f"Model family. `{VIDEO_FAMILY}`: the video models, the model told by the pipeline folder (the "
        "models, their pipelines and built-in tiny models: the table at the top of this page), trained on clips by "
        f"flow matching. `{VIDEO_FAMILY_ALIAS}`, its first name, is read as `{VIDEO_FAMILY}`."
    )
    pretrained: str = Field(
        default_factory=lambda: first_builtin(VIDEO_FAMILY),
        description="A diffusers pipeline folder of one of the video models (model_index.json + transformer/vae/"
        "text encoders/tokenizers/scheduler, and the image encoder of an image-to-video pipeline), a hub id already "
        "in the local Hugging Face cache, or a tiny model built offline (`builtin:NAME`). Omitted: the first video "
        "model's built-in.",
    )

    @field_validator("family")
    @classmethod
    def _one_name(cls, value: str) -> str:
        return VIDEO_FAMILY

    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each transformer block's activations in backward (torch non-reentrant "
        "checkpointing): activations grow with frames x height x width tokens, so real clips need it.",
    )
    text_encoder_offload: Literal["none", "cpu"] = text_encoder_offload_field()
    transformer_file: Optional[str] = transformer_file_field()
    FILE_FIELDS: ClassVar[tuple[str, ...]] = ("transformer_file",)

    @field_validator("transformer_file")
    @classmethod
    def _transformer_file_fits(cls, value, info):
        return checked_transformer_file(value, info.data)

    timestep_sampling: Literal["logit_normal", "uniform", "mode", "shifted_logit_normal"] = Field(
        "uniform",
        description="How u in [0, 1] is drawn (diffusers' compute_density_for_timestep_sampling); u indexes the "
        "shifted timestep/sigma tables of the scheduler (see `shift`). uniform, logit_normal (logit_mean, "
        "logit_std) or mode (mode_scale). A model whose official trainer draws sigma itself takes "
        "shifted_logit_normal (logit-normal about a mean that follows the clip's tokens, stretched to [0, 1], 10% "
        "uniform; only such models) or uniform (sigma = u); its docs page says which it defaults to.",
    )
    logit_mean: Optional[float] = Field(None, description="logit_normal only: the normal's mean. Omitted: 0.0.")
    logit_std: Optional[float] = Field(None, gt=0, description="logit_normal only: its std. Omitted: 1.0.")
    mode_scale: Optional[float] = Field(
        None, description="mode only: how strongly mid timesteps are favoured. Omitted: 1.29."
    )
    shift: Optional[float] = Field(
        None,
        gt=0,
        description="Timestep shift of the training tables (sigma -> shift sigma / (1 + (shift - 1) "
        "sigma)). Omitted: the scheduler's (UniPC's flow_shift or FlowMatchEulerDiscreteScheduler's shift), or "
        "the model's official trainer's where it trains with its own (each model's docs page says which).",
    )
    vae_latents: Optional[Literal["sample", "mean"]] = Field(None, description=VAE_LATENTS_DESCRIPTION)
    loss_weighting: Literal["none", "cosmap"] = Field(
        "none", description="Per-sample loss weight (diffusers' compute_loss_weighting_for_sd3)."
    )
    max_sequence_length: Optional[int] = Field(
        None,
        gt=0,
        description="Text tokens per caption of the model's main text encoder (after its prompt "
        "template, zero-padded as its pipeline pads them). Omitted: the model's pipeline default, at most the "
        "tokenizer's model_max_length (each model's default: the table at the top of this page).",
    )

    expert: Optional[Literal["high_noise", "low_noise"]] = Field(
        None,
        description="Two-expert folders only (`transformer` and `transformer_2` with a "
        "boundary_ratio): which expert this run trains. `high_noise`: `transformer`, on the timesteps at or above "
        "boundary_ratio x 1000; `low_noise`: `transformer_2`, on those below. The other expert stays frozen in host "
        "memory and joins only for samples. Required for such folders, refused for one-expert ones.",
    )
    timestep_range: Optional[tuple[float, float]] = Field(
        None,
        description="[min, max]: train only on the scheduler timesteps t (0-1000, after the shift) with min <= "
        "t <= max. With model.expert the range must lie on that expert's side of the folder's boundary "
        "(high_noise: min >= boundary_ratio x 1000; low_noise: max <= boundary_ratio x 1000, and t == boundary "
        "stays the high-noise expert's, as in the two-expert pipelines). Omitted: every timestep (of the expert's side). "
        "`dstune validate` prints the range a run trains.",
    )
    image_to_video: Optional[bool] = Field(
        None,
        description="Train image-to-video: every clip is denoised from its own first frame, conditioned as "
        "the model's image-to-video pipeline conditions it (the first frame VAE-encoded as a condition with a mask, "
        "and an image embedding where the model has one; or, for a text-and-image model, the first latent frame "
        "replaced by the clean image latent, its tokens at timestep 0, left out of the loss: each model's docs page "
        "says which). Omitted: what the folder is (image-to-video folders: true; text-to-video and text-and-image "
        "folders: false). true on a text-to-video "
        "folder and false on an image-to-video one are refused. Samples then render from sample.control_images "
        "(one first frame per prompt).",
    )
    cfg_augmented_target: Optional[float] = Field(
        None,
        gt=1,
        description="Guidance-distilled models (their docs page says which take it): keep the guidance the model "
        "has built in while it is fine-tuned (plain fine-tuning drifts a guidance-distilled model back towards its "
        "undistilled behaviour). Each clip also runs, without gradient, on the empty caption, and the rearranged "
        "guidance (v_cond + (s - 1) v_uncond) / s, the prediction the model's built-in guidance of scale s was "
        "distilled from, is what fits the target: the model's own output keeps the guidance. s: that scale (4 in "
        "diffusion-pipe's example). One more forward a clip per step, no more backward. Omitted: the plain target.",
    )
    vae_tiling: bool = Field(
        False,
        description="Encode and decode through the VAE's own tiles (diffusers' enable_tiling: spatial tiles, "
        "each whole in time, their borders blended), for clips the VAE cannot hold whole: the cache's latents, "
        "the latents of a run without the cache and the samples' decode. Tiled latents are not the untiled ones "
        "(the blended borders, the VAE's attention within a tile), so they are cached apart; dstune cannot "
        "bound the difference without the model's weights, and never tiles unless this is set. `dstune validate "
        "--gpu-memory` suggests it where the cache or sample phase does not fit untiled (docs/memory.md). "
        "Only the VAEs whose tiles' memory dstune knows (the model's page says so).",
    )
    sample_frames: int = Field(
        5,
        gt=0,
        description="Frames of each clip rendered for `sample.prompts` during training (the counts the model's VAE takes, as data.video.frames: 4k+1, 8k+1 for a VAE 8x in time, 17k+5 for one of 17-frame chunks; the samples "
        "page plays them as animated WebP, with an MP4 of each step beside it).",
    )

    @model_validator(mode="after")
    def _no_unused_sampling_settings(self) -> "VideoModelSpec":
        used = {
            "logit_normal": {"logit_mean", "logit_std"},
            "mode": {"mode_scale"},
            "uniform": set(),
            "shifted_logit_normal": set(),
        }
        unused = sorted(
            name
            for name in {"logit_mean", "logit_std", "mode_scale"} - used[self.timestep_sampling]
            if getattr(self, name) is not None
        )
        if unused:
            raise ValueError(
                f"{', '.join(unused)} only apply to another timestep_sampling (it is "
                f"{self.timestep_sampling!r}): remove them or change timestep_sampling"
            )
        if self.timestep_range is not None and not 0 <= self.timestep_range[0] < self.timestep_range[1]:
            raise ValueError(
                f"timestep_range {list(self.timestep_range)} must be [min, max] with 0 <= min < max "
                "(scheduler timesteps, 0-1000)"
            )
        return self


def experts_in(index: dict) -> list[str]:
    """The denoiser components of a video pipeline folder's model_index.json: transformer, and transformer_2 when
    the folder has two experts (boundary_ratio splits the timesteps between them)."""
    return ["transformer"] + (["transformer_2"] if (index.get("transformer_2") or [None, None])[1] else [])


def expert_problems(
    index: dict, expert: Optional[str], timestep_range=None, num_train_timesteps: int = 1000
) -> list[str]:
    """Why model.expert / model.timestep_range do not fit a video folder's model_index.json (empty: they do)."""
    two = len(experts_in(index)) == 2
    if two and index.get("boundary_ratio") is None:
        return ["it has two experts (transformer, transformer_2) but no boundary_ratio in model_index.json"]
    if two and expert is None:
        return [
            "it has two experts: set model.expert to high_noise (transformer, timesteps at or "
            f"above {index['boundary_ratio']} x 1000) or low_noise (transformer_2, below); a run trains one"
        ]
    if not two and expert is not None:
        return [f"model.expert {expert} applies to two-expert folders (transformer_2); this one has one: remove it"]
    if not two or timestep_range is None:
        return []
    boundary = index["boundary_ratio"] * num_train_timesteps
    low, high = timestep_range
    if expert == "high_noise" and low < boundary:
        return [
            f"model.timestep_range {list(timestep_range)} reaches below the boundary {boundary:g} (boundary_ratio "
            f"{index['boundary_ratio']} x {num_train_timesteps} in model_index.json): the high_noise expert "
            f"only runs at t >= {boundary:g}; raise min to {boundary:g} or more, or train low_noise"
        ]
    if expert == "low_noise" and high > boundary:
        return [
            f"model.timestep_range {list(timestep_range)} reaches above the boundary {boundary:g} (boundary_ratio "
            f"{index['boundary_ratio']} x {num_train_timesteps} in model_index.json): the low_noise expert "
            f"only runs at t < {boundary:g}; lower max to {boundary:g} or less, or train high_noise"
        ]
    return []


def expert_range(
    index: dict, expert: Optional[str], timestep_range=None, num_train_timesteps: int = 1000
) -> tuple[float, float, bool]:
    """(min, max, max included) of the timesteps a run trains: the expert's side of the boundary (high_noise
    [boundary, 1000], low_noise [0, boundary) ), narrowed by model.timestep_range; [0, 1000] without either."""
    low, high, inclusive = 0.0, float(num_train_timesteps), True
    if expert is not None:
        boundary = index["boundary_ratio"] * num_train_timesteps
        low, high, inclusive = (boundary, high, True) if expert == "high_noise" else (0.0, boundary, False)
    if timestep_range is not None:
        low = max(low, timestep_range[0])
        if timestep_range[1] < high or (timestep_range[1] == high and inclusive):
            high, inclusive = timestep_range[1], True
    return low, high, inclusive


def expert_range_text(index: dict, expert: Optional[str], timestep_range=None, num_train_timesteps: int = 1000) -> str:
    """What `dstune validate` prints of a two-expert run's timesteps, e.g. "low_noise (transformer_2) trains timesteps
    0 to < 875 of 1000; transformer (high noise) ... frozen"."""
    low, high, inclusive = expert_range(index, expert, timestep_range, num_train_timesteps)
    span = f"{low:g} to {'' if inclusive else '< '}{high:g} of {num_train_timesteps}"
    if expert is None:
        return f"transformer trains timesteps {span}"
    trained, other = (
        ("transformer", "transformer_2 (low noise)")
        if expert == "high_noise"
        else ("transformer_2", "transformer (high noise)")
    )
    return (
        f"{expert} ({trained}) trains timesteps {span} (boundary_ratio {index['boundary_ratio']} in "
        f"model_index.json); {other} is never trained and loads only while samples render"
    )
