"""The `model` section of the video families (wan). Re-exported by dstune.spec.models; torch-free like the rest of
the spec."""

from __future__ import annotations

from typing import Callable, ClassVar, Literal, Optional

from pydantic import Field, model_validator

from dstune.spec.model_sections import DenoiserModelBase


class WanModel(DenoiserModelBase):
    modality: ClassVar[str] = "video"  # what the data is (dstune.spec.models.VIDEO_FAMILIES, AUDIO_FAMILIES)
    TRAINED_CLASSES: ClassVar[tuple[str, ...]] = ("WanPipeline", "WanImageToVideoPipeline",
                                                  "HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline",
                                                  "LTX2Pipeline")
    PRESET_RESOLUTION: ClassVar[int] = 480
    PRESET_NAME: ClassVar[str] = "Wan's frame height"
    PIPELINE_GUIDANCE: ClassVar[dict[str, float]] = {"WanPipeline": 5.0, "WanImageToVideoPipeline": 5.0,
                                                     "HunyuanVideo15Pipeline": 6.0,
                                                     "HunyuanVideo15ImageToVideoPipeline": 6.0,
                                                     "LTX2Pipeline": 3.0}

    def native_resolution(self, read: Callable[[str], Optional[dict]]) -> Optional[tuple[int, str]]:
        """WanPipeline's default frames are 480 x 832 (fixed in its code, whatever the folder): data.resolution is
        a square side (or, with buckets, the side of the pixel area), so its shorter side, 480."""
        return 480, "Wan's pipeline default frames are 480x832; the shorter side"

    family: Literal["wan"] = Field(
        description="Model family. `wan`: the video models, chosen by the folder: Wan 2.1 / 2.2 "
        "(WanTransformer3DModel, AutoencoderKLWan, UMT5): text-to-video, image-to-video (Wan 2.1 I2V with its CLIP "
        "image encoder, Wan 2.2 I2V A14B) and Wan 2.2 TI2V 5B; HunyuanVideo 1.5 (HunyuanVideo15Transformer3DModel, "
        "Qwen2.5-VL and ByT5): text- and image-to-video; LTX-2 (LTX2VideoTransformer3DModel, Gemma 3): text-to-video "
        "on clips without sound; trained on clips by flow matching. See docs/family-wan.md, "
        "docs/family-hunyuan-video15.md and docs/family-ltx2.md."
    )
    pretrained: str = Field(
        "builtin:tiny-wan",
        description="A diffusers WanPipeline or WanImageToVideoPipeline folder (model_index.json + transformer/vae/"
        "text_encoder/tokenizer/scheduler, and image_encoder/image_processor for Wan 2.1 I2V), e.g. "
        "Wan-AI/Wan2.1-T2V-14B-Diffusers already in the local Hugging Face cache, or a tiny model built offline: "
        "`builtin:tiny-wan`, `builtin:tiny-wan-a14b` (two experts), `builtin:tiny-wan-i2v` (Wan 2.1 I2V layout), "
        "`builtin:tiny-wan22-ti2v` (Wan 2.2 TI2V layout); or a HunyuanVideo15Pipeline / "
        "HunyuanVideo15ImageToVideoPipeline folder (hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v, ...; "
        "`builtin:tiny-hunyuan-video15`, `builtin:tiny-hunyuan-video15-i2v`); or an LTX2Pipeline folder "
        "(Lightricks/LTX-2; `builtin:tiny-ltx2`).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in backward (torch non-reentrant "
        "checkpointing): activations grow with frames x height x width tokens, so real clips need it."
    )
    timestep_sampling: Literal["logit_normal", "uniform", "mode", "shifted_logit_normal"] = Field(
        "uniform",
        description="How u in [0, 1] is drawn (diffusers' compute_density_for_timestep_sampling); u indexes the "
        "shifted timestep/sigma tables of the scheduler (see `shift`). uniform, logit_normal (logit_mean, "
        "logit_std) or mode (mode_scale). LTX-2 draws sigma itself, as ltx-trainer: shifted_logit_normal (LTX-2 "
        "only; ltx-trainer's default: logit-normal about a mean that follows the clip's tokens, stretched to [0, "
        "1], 10% uniform) or uniform (sigma = u).",
    )
    logit_mean: Optional[float] = Field(None, description="logit_normal only: the normal's mean. Omitted: 0.0.")
    logit_std: Optional[float] = Field(None, gt=0, description="logit_normal only: its std. Omitted: 1.0.")
    mode_scale: Optional[float] = Field(None, description="mode only: how strongly mid timesteps are favoured. "
                                        "Omitted: 1.29.")
    shift: Optional[float] = Field(
        None, gt=0, description="Timestep shift of the training tables (sigma -> shift sigma / (1 + (shift - 1) "
        "sigma)). Omitted: the scheduler's: UniPC's flow_shift (Wan 2.1: 3.0 at 480p, 5.0 at 720p) or "
        "FlowMatchEulerDiscreteScheduler's shift; HunyuanVideo 1.5: 3.0, its official trainer's. Not used by LTX-2 "
        "(its sampler draws sigma directly).",
    )
    loss_weighting: Literal["none", "cosmap"] = Field(
        "none", description="Per-sample loss weight (diffusers' compute_loss_weighting_for_sd3).")
    max_sequence_length: Optional[int] = Field(
        None, gt=0, description="UMT5 tokens per caption (zero-padded, as WanPipeline pads them). Omitted: 512, at "
        "most the tokenizer's model_max_length. HunyuanVideo 1.5: Qwen2.5-VL tokens after its template (omitted: "
        "1000, the pipeline's); ByT5's glyph tokens stay 256. LTX-2: Gemma 3 tokens, left-padded (omitted: 1024, "
        "the pipeline's).",
    )

    expert: Optional[Literal["high_noise", "low_noise"]] = Field(
        None, description="Two-expert folders only (Wan 2.2 A14B: `transformer` and `transformer_2` with a "
        "boundary_ratio): which expert this run trains. `high_noise`: `transformer`, on the timesteps at or above "
        "boundary_ratio x 1000; `low_noise`: `transformer_2`, on those below. The other expert stays frozen in host "
        "memory and joins only for samples. Required for such folders, refused for one-expert ones.")
    timestep_range: Optional[tuple[float, float]] = Field(
        None, description="[min, max]: train only on the scheduler timesteps t (0-1000, after the shift) with min <= "
        "t <= max. With model.expert the range must lie on that expert's side of the folder's boundary "
        "(high_noise: min >= boundary_ratio x 1000; low_noise: max <= boundary_ratio x 1000, and t == boundary "
        "stays the high-noise expert's, as in WanPipeline). Omitted: every timestep (of the expert's side). "
        "`dstune validate` prints the range a run trains.")
    image_to_video: Optional[bool] = Field(
        None, description="Train image-to-video: every clip is denoised from its own first frame, conditioned as "
        "WanImageToVideoPipeline conditions it (Wan 2.1 I2V / 2.2 I2V A14B: the first frame and zeros VAE-encoded, "
        "a first-frame mask, and Wan 2.1's CLIP image embedding; Wan 2.2 TI2V: the first latent frame replaced by "
        "the clean image latent, its tokens at timestep 0, left out of the loss). Omitted: what the folder is "
        "(image-to-video folders: true; text-to-video folders and Wan 2.2 TI2V: false). true on a text-to-video "
        "folder and false on an image-to-video one are refused. Samples then render from sample.control_images "
        "(one first frame per prompt).")
    sample_frames: int = Field(
        5, gt=0, description="Frames of each clip rendered for `sample.prompts` during training (4k+1; LTX-2: 8k+1; the samples "
        "page plays them as animated WebP, with an MP4 of each step beside it).")

    @model_validator(mode="after")
    def _no_unused_sampling_settings(self) -> "WanModel":
        used = {"logit_normal": {"logit_mean", "logit_std"}, "mode": {"mode_scale"}, "uniform": set(),
                "shifted_logit_normal": set()}
        unused = sorted(name for name in {"logit_mean", "logit_std", "mode_scale"} - used[self.timestep_sampling]
                        if getattr(self, name) is not None)
        if unused:
            raise ValueError(f"{', '.join(unused)} only apply to another timestep_sampling (it is "
                             f"{self.timestep_sampling!r}): remove them or change timestep_sampling")
        if self.timestep_range is not None and not 0 <= self.timestep_range[0] < self.timestep_range[1]:
            raise ValueError(f"timestep_range {list(self.timestep_range)} must be [min, max] with 0 <= min < max "
                             "(scheduler timesteps, 0-1000)")
        if (self.sample_frames - 1) % 4:
            raise ValueError(f"sample_frames {self.sample_frames} is not 4k+1 (the VAE keeps the first frame and "
                             "compresses the rest 4x)")
        return self


def experts_in(index: dict) -> list[str]:
    """The denoiser components of a Wan pipeline folder's model_index.json: transformer, and transformer_2 when
    the folder has two experts (Wan 2.2 A14B)."""
    return ["transformer"] + (["transformer_2"] if (index.get("transformer_2") or [None, None])[1] else [])


def expert_problems(index: dict, expert: Optional[str], timestep_range=None,
                    num_train_timesteps: int = 1000) -> list[str]:
    """Why model.expert / model.timestep_range do not fit a Wan folder's model_index.json (empty: they do)."""
    two = len(experts_in(index)) == 2
    if two and index.get("boundary_ratio") is None:
        return ["it has two experts (transformer, transformer_2) but no boundary_ratio in model_index.json"]
    if two and expert is None:
        return ["it has two experts (Wan 2.2 A14B): set model.expert to high_noise (transformer, timesteps at or "
                f"above {index['boundary_ratio']} x 1000) or low_noise (transformer_2, below); a run trains one"]
    if not two and expert is not None:
        return [f"model.expert {expert} applies to two-expert folders (transformer_2); this one has one: remove it"]
    if not two or timestep_range is None:
        return []
    boundary = index["boundary_ratio"] * num_train_timesteps
    low, high = timestep_range
    if expert == "high_noise" and low < boundary:
        return [f"model.timestep_range {list(timestep_range)} reaches below the boundary {boundary:g} (boundary_ratio "
                f"{index['boundary_ratio']} x {num_train_timesteps} in model_index.json): the high_noise expert "
                f"only runs at t >= {boundary:g}; raise min to {boundary:g} or more, or train low_noise"]
    if expert == "low_noise" and high > boundary:
        return [f"model.timestep_range {list(timestep_range)} reaches above the boundary {boundary:g} (boundary_ratio "
                f"{index['boundary_ratio']} x {num_train_timesteps} in model_index.json): the low_noise expert "
                f"only runs at t < {boundary:g}; lower max to {boundary:g} or less, or train high_noise"]
    return []


def expert_range(index: dict, expert: Optional[str], timestep_range=None,
                 num_train_timesteps: int = 1000) -> tuple[float, float, bool]:
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


def expert_range_text(index: dict, expert: Optional[str], timestep_range=None,
                      num_train_timesteps: int = 1000) -> str:
    """What `dstune validate` prints of a Wan run's timesteps, e.g. "low_noise (transformer_2) trains timesteps
    0 to < 875 of 1000; transformer (high noise) ... frozen"."""
    low, high, inclusive = expert_range(index, expert, timestep_range, num_train_timesteps)
    span = f"{low:g} to {'' if inclusive else '< '}{high:g} of {num_train_timesteps}"
    if expert is None:
        return f"transformer trains timesteps {span}"
    trained, other = ("transformer", "transformer_2 (low noise)") if expert == "high_noise" else \
        ("transformer_2", "transformer (high noise)")
    return (f"{expert} ({trained}) trains timesteps {span} (boundary_ratio {index['boundary_ratio']} in "
            f"model_index.json); {other} is never trained and loads only while samples render")
