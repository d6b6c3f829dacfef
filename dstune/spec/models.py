"""The spec: what a user writes in YAML, as frozen pydantic models.

Every field carries its documentation (`description`), from which `dstune init` and the spec reference are
generated. This module imports neither torch nor deepspeed, so `dstune validate` stays fast.
Cross-field rules that need the world size (batch divisibility) live in `dstune.plan`, not here.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from dstune import registry
from dstune.card import load
from dstune.spec.section import VIDEO_FAMILY, Section

# The shared sections live in their own modules; they are imported here (and re-exported) so the whole spec is
# importable from one place.
from dstune.spec.model_sections import (  # noqa: F401
    BASE_PRECISION_BYTES,
    DEFAULT_LORA_TARGET_MODULES,
    DenoiserModelBase,
    FlowModelSpec,
    LoraSpec,
    is_single_file,
)
from dstune.spec.speech_models import CodebooksModelSpec
from dstune.spec.video_models import VideoModelSpec
from dstune.spec.data_sections import BucketsSpec, CacheSpec, DataSetSpec, DataSpec, VideoSpec  # noqa: F401
from dstune.spec.data_checks import data_family_problem, sets_problems  # noqa: F401
from dstune.spec.sample_section import SampleSpec  # noqa: F401

# One model section per family: the shared cores' (flow-matching images, video, multi-codebook speech) and the
# sections of the families a model unit owns (dstune.registry.FAMILY_SECTIONS), images first, then video, then
# speech. The family lists below are derived from them (each section's `family` literal and its `modality`), so
# adding a family adds nothing to this module.
_UNIT_SECTIONS = tuple(map(load, registry.FAMILY_SECTIONS))
MODEL_SECTIONS = (
    *(s for s in _UNIT_SECTIONS if s.modality == "image"),
    FlowModelSpec,
    VideoModelSpec,
    *(s for s in _UNIT_SECTIONS if s.modality == "audio"),
    CodebooksModelSpec,
)
Model = Annotated[Union[MODEL_SECTIONS], Field(discriminator="family")]
FAMILIES = tuple(typing.get_args(section.model_fields["family"].annotation)[0] for section in MODEL_SECTIONS)
# families that train on clips (B, 3, frames, H, W): data.video applies
VIDEO_FAMILIES = tuple(f for f, section in zip(FAMILIES, MODEL_SECTIONS) if section.modality == "video")
# families that train on speech: data is audio + text, not images
AUDIO_FAMILIES = tuple(f for f, section in zip(FAMILIES, MODEL_SECTIONS) if section.modality == "audio")
SECTIONS_BY_FAMILY = dict(zip(FAMILIES, MODEL_SECTIONS))


def lora_format_problem(family: str, train: str, lora_format) -> str | None:
    """Why output.lora_format cannot be used with this model section, or None. Unset is always fine."""
    if lora_format is None:
        return None
    choices = SECTIONS_BY_FAMILY[family].LORA_FORMATS
    if not choices:
        return f"model.family {family} has no LoRA training, so there is no LoRA file to format: remove it"
    if train != "lora":
        return f"applies to model.train: lora, but model.train is {train!r}: remove it or set model.train: lora"
    if lora_format not in choices:
        return (
            f"{lora_format!r} is not a LoRA format of model.family {family}; choices: {', '.join(choices)} "
            f"(default {next(iter(choices))})"
        )
    return None


def lora_file_scheme(family: str, lora_format) -> tuple[str, str]:
    """(the format in effect, the key scheme it is written in) for a LoRA family: output.lora_format, or the
    family's default when it is unset."""
    choices = SECTIONS_BY_FAMILY[family].LORA_FORMATS
    chosen = lora_format or next(iter(choices))
    return chosen, choices[chosen]


# Optimizers whose update is scaled by their own RMS clipping; DeepSpeed's default global-norm clipping (1.0 since
# DeepSpeed 0.19.3) fights with it, so their automatic clipping is 0.0.
ADAFACTOR_STYLE = frozenset({"adafactor"})
# Validation context key: "pending" while deepspeed.config may still give the batch numbers, "read" once it has.
BATCH_FROM_FILE = "batch_from_deepspeed_config"


# --------------------------------------------------------------------------------------------------------- train


# The optimizers that pick their own step size (Prodigy: lr is a multiplier of its estimate, 1.0) or replace the
# decay schedule (schedule-free: the averaging is the schedule); what each allows of train.lr_scaling and
# train.scheduler is checked in dstune.ds_json.blocks (optimizer_refusals).
ADAPTIVE_LR = frozenset({"prodigy"})
SCHEDULE_FREE = frozenset({"adamw_schedulefree"})
# The default lr of each optimizer type where it is not OptimizerSpec.lr's 1e-4
DEFAULT_LR = {"prodigy": 1.0}


class OptimizerSpec(Section):
    type: Literal["adamw", "adam", "adafactor", "lion", "sgd", "prodigy", "adamw_schedulefree", "adamw8bit", "muon"] = (
        Field(
            "adamw",
            description="Optimizer. prodigy: Adam with its own step-size estimate (lr 1.0 is the estimate as is; "
            "tune `d_coef`); adamw_schedulefree: schedule-free AdamW (no decay schedule; samples, checkpoints and "
            "the export hold its averaged weights); adamw8bit: bitsandbytes' AdamW with 8-bit moments; muon: "
            "DeepSpeed's Muon for the matrices (`muon_lr`, `muon_momentum`) with Adam for the rest (`lr`, `betas`, "
            "`eps`). See docs/training.md.",
        )
    )
    lr: float = Field(
        1e-4,
        gt=0,
        description="Learning rate at the reference batch size (see `train.lr_scaling`); default 1.0 for prodigy, "
        "where it multiplies the estimated step size. With muon: the Adam half's.",
    )
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay (adamw, lion) or L2 (adam, sgd).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam/Lion betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum.")
    muon_lr: float = Field(0.02, gt=0, description="muon: the learning rate of the Muon half (the matrices).")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="muon: the Muon half's momentum.")
    d_coef: float = Field(
        1.0, gt=0, description="prodigy: multiplies its step-size estimate (0.5 to 2 typical; the way to tune it)."
    )

    @model_validator(mode="before")
    @classmethod
    def _default_lr_of_the_type(cls, data):
        if isinstance(data, dict) and "lr" not in data and data.get("type") in DEFAULT_LR:
            return {**data, "lr": DEFAULT_LR[data["type"]]}
        return data

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        return betas


class SchedulerSpec(Section):
    type: Literal["constant", "constant_with_warmup", "linear", "cosine"] = Field(
        "constant",
        description="LR schedule over optimizer steps. linear/cosine decay to `min_lr_ratio` x lr at the last step.",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0, in optimizer steps (not micro-batches).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR of linear/cosine, as a fraction of the peak LR.")

    @model_validator(mode="after")
    def _warmup_needs_warmup_type(self) -> "SchedulerSpec":
        if self.type == "constant" and self.warmup_steps:
            raise ValueError("scheduler type 'constant' has no warmup; use 'constant_with_warmup'")
        return self


class EmaSpec(Section):
    decay: float = Field(
        0.9999,
        gt=0,
        lt=1,
        description="EMA decay per update: shadow = decay x shadow + (1 - decay) x weights. With `warmup` this is "
        "the ceiling the decay grows toward.",
    )
    warmup: bool = Field(
        True,
        description="Use min(decay, (1 + n) / (10 + n)) at the n-th update (diffusers' EMAModel default), so "
        "a short run's EMA is not stuck near the starting weights.",
    )
    every_steps: int = Field(1, ge=1, description="Update the EMA every N optimizer steps (the decay is per update).")
    device: Literal["cpu", "same"] = Field(
        "cpu",
        description="Where the EMA copy lives: `cpu` (host memory, off the accelerator) or `same` (beside the "
        "weights). Each rank keeps only its 1/world-size share of every trained weight.",
    )
    export: Literal["ema", "raw"] = Field(
        "ema",
        description="Which weights the export holds, and which weights samples during training show: the "
        "EMA (`ema`) or the trained weights as they are (`raw`). Checkpoints always hold both.",
    )


class TrainSpec(Section):
    global_batch_size: Optional[int] = Field(
        None,
        gt=0,
        description="Samples per optimizer step over all ranks = micro x accumulation x data-parallel ranks.",
    )
    micro_batch_size: Optional[int] = Field(None, gt=0, description="Samples per forward pass on each GPU.")
    gradient_accumulation_steps: Optional[int] = Field(
        None, gt=0, description="Micro batches per optimizer step. Give any two of the three batch numbers."
    )
    epochs: Optional[int] = Field(None, gt=0, description="Passes over the whole dataset by all ranks together.")
    max_steps: Optional[int] = Field(None, gt=0, description="Optimizer steps to train (instead of `epochs`).")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="Optimizer settings.")
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec, description="Learning-rate schedule.")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="Scale `optimizer.lr` by (global batch / reference_batch_size), or its square root."
    )
    reference_batch_size: Optional[int] = Field(
        None, gt=0, description="The global batch size `optimizer.lr` was tuned for."
    )
    allow_clipping_with_adafactor: bool = Field(
        False, description="Opt in to gradient_clipping > 0 with Adafactor (it already clips its own updates)."
    )
    gradient_clipping: Optional[float] = Field(
        None, ge=0, description="Global gradient-norm clip. Omitted: 1.0 for Adam-family, 0.0 (off) for Adafactor."
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Training precision. fp16 needs a CUDA GPU (DeepSpeed's CPU accelerator has no fp16)."
    )
    seed: int = Field(
        0, ge=0, description="Seeds the data order, noise and timesteps (per sample, independent of the world size)."
    )
    compile: Literal["off", "blocks"] = Field(
        "off",
        description="`blocks`: compile each repeated block of the denoiser (the transformer or UNet blocks its "
        "diffusers class lists in `_repeated_blocks`) with torch.compile (inductor) in place, as diffusers' "
        "compile_repeated_blocks does: the same weights and names, one compilation per block class and shape, "
        "paid in the first step (the log says how long). Diffusion families, ZeRO stage 0-2, without sequence "
        'parallelism (validate refuses the rest). `off`: nothing compiled. See docs/training.md, "Compiled '
        'blocks".',
    )
    ema: Optional[EmaSpec] = Field(
        None,
        description="Exponential moving average of the trained weights (all of them, or the LoRA adapters): "
        "`decay` (0.9999), `warmup` (true), `every_steps` (1), `device` (cpu or same), `export` (ema or raw); `{}` "
        "for those defaults. Omitted: no EMA. See docs/lora-and-ema.md.",
    )

    # Cross-field rules are field validators (fields are validated in order), so each error names its own key.
    @field_validator("micro_batch_size")
    @classmethod
    def _a_batch_number(cls, value, info):
        if value is None and info.data.get("global_batch_size") is None and "global_batch_size" in info.data:
            from_file = (info.context or {}).get(BATCH_FROM_FILE)
            if from_file == "pending":
                return value  # the DeepSpeed JSON may give them (train_micro_batch_size_per_gpu / train_batch_size)
            hint = (
                " here or as train_micro_batch_size_per_gpu / train_batch_size in the deepspeed.config file"
                if from_file
                else ""
            )
            raise ValueError(
                f"give `micro_batch_size` or `global_batch_size`{hint} (and optionally one more batch number)"
            )
        return value

    @field_validator("max_steps")
    @classmethod
    def _one_length(cls, value, info):
        if "epochs" in info.data and (info.data["epochs"] is None) == (value is None):
            raise ValueError("give exactly one of `epochs` or `max_steps`")
        return value

    @field_validator("reference_batch_size")
    @classmethod
    def _reference_for_scaling(cls, value, info):
        scaling = info.data.get("lr_scaling", "none")
        if scaling != "none" and value is None:
            raise ValueError(
                f"lr_scaling '{scaling}' needs `reference_batch_size` (the global batch the lr was tuned for)"
            )
        return value

    @field_validator("gradient_clipping")
    @classmethod
    def _no_double_clipping(cls, value, info):
        optimizer = info.data.get("optimizer")
        if (
            optimizer is not None
            and optimizer.type in ADAFACTOR_STYLE
            and value
            and not info.data.get("allow_clipping_with_adafactor", False)
        ):
            raise ValueError(
                f"{value} with adafactor: Adafactor already clips its own update (RMS clipping), and clipping the "
                "gradient norm as well changes its step size. Remove `gradient_clipping` (dstune then writes 0.0) "
                "or set `allow_clipping_with_adafactor: true`."
            )
        return value

    @property
    def resolved_gradient_clipping(self) -> float:
        """Clipping always ends up explicit: DeepSpeed's own default changed from 0.0 to 1.0 in 0.19.3."""
        if self.gradient_clipping is not None:
            return float(self.gradient_clipping)
        return 0.0 if self.optimizer.type in ADAFACTOR_STYLE else 1.0


# ----------------------------------------------------------------------------------------------------- deepspeed


class OffloadSpec(Section):
    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where to keep it: none (GPU), cpu, or nvme.")
    nvme_path: Optional[str] = Field(None, description="Folder on a fast local NVMe drive; required for device nvme.")
    pin_memory: bool = Field(True, description="Pinned host memory for faster transfers.")

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "OffloadSpec":
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device 'nvme' needs `nvme_path` (a folder on a local NVMe drive)")
        return self


def _offload_shorthand(value):
    """Accept `offload_optimizer: cpu` as well as `offload_optimizer: {device: cpu}`."""
    return {"device": value} if isinstance(value, str) else value


class ActivationCheckpointingSpec(Section):
    partition_activations: bool = Field(
        False, description="Split checkpointed activations across ranks (DeepSpeed API)."
    )
    cpu_checkpointing: bool = Field(False, description="Keep checkpointed activations in CPU memory (DeepSpeed API).")
    contiguous_memory_optimization: bool = Field(False, description="Copy checkpoints into one contiguous buffer.")
    number_checkpoints: Optional[int] = Field(
        None, gt=0, description="Checkpoints per forward, for the contiguous buffer."
    )


class DeepSpeedSpec(Section):
    zero_stage: int = Field(
        2, ge=0, le=3, description="ZeRO stage: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters."
    )
    offload_optimizer: OffloadSpec = Field(
        default_factory=OffloadSpec, description="ZeRO optimizer-state offload (stage >= 1)."
    )
    offload_param: OffloadSpec = Field(
        default_factory=OffloadSpec, description="ZeRO parameter offload (stage 3 only)."
    )
    activation_checkpointing: ActivationCheckpointingSpec = Field(
        default_factory=ActivationCheckpointingSpec,
        description="DeepSpeed activation checkpointing; only used when partitioning or CPU checkpointing is asked "
        "for. `model.gradient_checkpointing` alone uses torch's non-reentrant checkpointing.",
    )
    reduce_bucket_size: int = Field(50_000_000, gt=0, description="ZeRO gradient reduce bucket, in elements.")
    allgather_bucket_size: int = Field(50_000_000, gt=0, description="ZeRO 1/2 all-gather bucket, in elements.")
    overlap_comm: bool = Field(
        False, description="Overlap gradient reduction with backward (more memory, faster on GPUs)."
    )
    config: Optional[str] = Field(
        None,
        description='Path of a DeepSpeed JSON you already have (HF Trainer / accelerate style, "auto" allowed), '
        "relative to the spec's folder (to the current directory when given with --set). "
        "Its values fill every key this spec leaves unset (ZeRO stage, offload, "
        "precision, batch numbers, clipping, optimizer values, ...); \"auto\" takes this spec's value or dstune's "
        "default; a key set in both places to different values is an error naming both lines. See "
        "docs/deepspeed-config.md.",
    )
    timeout_minutes: int = Field(
        30, gt=0, description="Collective-operation timeout: a dead rank stops the others after this."
    )
    bf16_optimizer_states: bool = Field(
        False,
        description="Keep the master weights, gradients and Adam moments in bf16 under CPU optimizer offload "
        "(DeepSpeed's CPU Adam: 8 host bytes per trained parameter instead of 16). Needs train.precision bf16, "
        "zero_stage >= 1, offload_optimizer cpu and optimizer adam or adamw. Rounds every update to bf16: for "
        "models too large for fp32 states, not a free saving.",
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Sequence parallelism (DeepSpeed Ulysses): N ranks share each sample, each holding 1/N of "
        "its tokens between the attention all-to-alls, so activations per GPU shrink N-fold. The ranks form "
        "world / N data-parallel groups; the batch numbers (micro, accumulation, global) count data-parallel ranks. N "
        "must divide the number of ranks, the transformer's attention heads and every bucket's tokens per sample. "
        f"Flow-matching transformers only (model.family flow or {VIDEO_FAMILY}). See docs/sequence-parallel.md.",
    )

    _offload_opt = field_validator("offload_optimizer", mode="before")(
        classmethod(lambda cls, v: _offload_shorthand(v))
    )
    _offload_par = field_validator("offload_param", mode="before")(classmethod(lambda cls, v: _offload_shorthand(v)))

    @model_validator(mode="after")
    def _offload_fits_stage(self) -> "DeepSpeedSpec":
        if self.offload_param.device != "none" and self.zero_stage != 3:
            raise ValueError(
                f"offload_param needs zero_stage 3 (it is {self.zero_stage}): only stage 3 partitions parameters"
            )
        if self.offload_optimizer.device != "none" and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage >= 1: stage 0 does not partition optimizer states")
        return self


# -------------------------------------------------------------------------------------------------------- output


def user_cache_dir() -> str:
    """output.cache_dir when the spec leaves it out: $DSTUNE_CACHE, else $XDG_CACHE_HOME/dstune, else
    ~/.cache/dstune (absolute, so that it is the same folder from wherever a run starts)."""
    given = os.environ.get("DSTUNE_CACHE")
    if given:
        return str(Path(given).expanduser().absolute())
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return str(Path(base).expanduser().absolute() / "dstune")


class OutputSpec(Section):
    dir: str = Field(
        "runs/dstune",
        description="Run folder: checkpoints, metrics.jsonl, samples, export."
        " A relative path is taken from the spec file's folder (from the current directory when given with --set); "
        "the default is under the current directory.",
    )
    cache_dir: Optional[str] = Field(
        None,
        description="Cache for built-in models, converted single-file checkpoints and (unless data.cache.dir says "
        "otherwise) the encoded caches; shared between runs. Omitted: the DSTUNE_CACHE environment variable, else "
        "the user's cache folder (`$XDG_CACHE_HOME/dstune`, by default `~/.cache/dstune`): one cache for every "
        "run on this machine, whatever folder it starts from. A relative path is taken from the spec file's folder "
        "(from the current directory when given with --set).",
    )
    save_every_steps: Optional[int] = Field(
        None, gt=0, description="Checkpoint every N optimizer steps (and always at the end)."
    )
    keep_last: int = Field(
        2, ge=1, description="Checkpoints kept; older ones are deleted once a newer one is complete."
    )
    log_every_steps: int = Field(1, ge=1, description="Write a metrics line every N optimizer steps.")
    export: Literal["diffusers", "none"] = Field(
        "diffusers",
        description="At the end, write the trained model (safetensors): a folder its library loads (diffusers or "
        "transformers), or with model.train: lora its LoRA file. `none`: checkpoints only (`dstune export RUN` "
        "writes it later).",
    )
    tensorboard: bool = Field(
        True,
        description="Also write the metrics (loss, LR, grad norm, samples/s, data wait, memory, held-out loss) and "
        "the sample images/audio as TensorBoard event files in `<output.dir>/tensorboard` (rank 0). See "
        "docs/training.md.",
    )
    wandb: bool = Field(
        False,
        description="Also log them to a Weights & Biases run in offline mode under `<output.dir>/wandb` (rank 0; "
        "nothing is uploaded: `wandb sync` does that later). Needs the `wandb` package, which dstune does not install.",
    )

    @model_validator(mode="before")
    @classmethod
    def _user_cache_by_default(cls, data):
        if isinstance(data, dict) and data.get("cache_dir") is None:
            return {**data, "cache_dir": user_cache_dir()}
        return data

    lora_format: Optional[Literal["diffusers", "kohya", "comfyui", "peft"]] = Field(
        None,
        description="With model.train: lora, the key scheme of the exported LoRA file: `kohya` (lora_unet_... "
        'names with per-layer alpha), `comfyui` (a file ComfyUI loads without "lora key not loaded": kohya\'s '
        "scheme for the UNets, the diffusers file for the transformers), `diffusers` or `peft` (an adapter folder "
        "beside the merged model). Each family's formats, the default (what most users load its LoRAs with) first: "
        + "; ".join(
            f"{family}: {', '.join(section.LORA_FORMATS)}"
            for family, section in SECTIONS_BY_FAMILY.items()
            if section.LORA_FORMATS
        )
        + ". See docs/lora-and-ema.md.",
    )


# ---------------------------------------------------------------------------------------------------------- spec


class Spec(Section):
    model: Model = Field(description="What is trained.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    train: TrainSpec = Field(description="Batches, length, optimizer, precision.")
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec, description="DeepSpeed ZeRO settings.")
    output: OutputSpec = Field(default_factory=OutputSpec, description="Where results go.")
    sample: SampleSpec = Field(default_factory=SampleSpec, description="Samples rendered during training.")

    @model_validator(mode="after")
    def _data_fits_family(self) -> "Spec":
        problem = data_family_problem(
            self.model.family in AUDIO_FAMILIES, self.model.family, self.data, self.model.family in VIDEO_FAMILIES
        )
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _voice_prompts_for_codebook_models(self) -> "Spec":
        if self.sample.voice_prompts and self.model.family != "tts_codebooks":
            raise ValueError(
                f"sample.voice_prompts: model.family {self.model.family} does not continue a reference "
                "voice (model.family tts_codebooks does, for the classes docs/tts.md names); remove "
                "sample.voice_prompts"
            )
        return self

    @model_validator(mode="after")
    def _distilled_checkpoints_fit(self) -> "Spec":
        """sample.pretrained renders the trained LoRA on another folder's transformer; a training adapter is fused
        into weights that ZeRO-3 would have partitioned before it could be."""
        model = self.model
        if self.sample.pretrained and (model.family != "flow" or getattr(model, "train", "full") != "lora"):
            raise ValueError(
                "sample.pretrained renders the trained LoRA on another folder's transformer: it needs "
                f"model.family flow with model.train: lora (here {model.family}, "
                f"{getattr(model, 'train', 'full')}); remove sample.pretrained"
            )
        if getattr(model, "training_adapter", None) and self.deepspeed.zero_stage == 3:
            raise ValueError(
                "model.training_adapter is fused into the whole frozen transformer before training, "
                "which ZeRO-3 partitions as it loads: use deepspeed.zero_stage 0-2 (a LoRA's frozen "
                "base is not partitioned by ZeRO-1/2 either way), or remove training_adapter"
            )
        return self

    @model_validator(mode="after")
    def _compiled_blocks_where_they_run(self) -> "Spec":
        if self.train.compile == "off":
            return self
        if not isinstance(self.model, DenoiserModelBase):
            raise ValueError(
                f"train.compile {self.train.compile!r} compiles a diffusers denoiser's repeated blocks; "
                f"model.family {self.model.family} trains no diffusers denoiser: remove train.compile"
            )
        if self.deepspeed.zero_stage == 3:
            raise ValueError(
                "train.compile 'blocks' under deepspeed.zero_stage 3: ZeRO-3 gathers and releases each block's "
                "parameters in module hooks that torch.compile would have to trace through, which dstune has not "
                "verified; use zero_stage 0-2 with compile, or train.compile: off under ZeRO-3"
            )
        if self.deepspeed.sequence_parallel_size > 1:
            raise ValueError(
                "train.compile 'blocks' with deepspeed.sequence_parallel_size > 1: the attention all-to-alls run "
                "inside the blocks, which dstune has not verified compiled; remove one of them"
            )
        return self

    @model_validator(mode="after")
    def _no_deepspeed_activation_checkpointing_for_diffusers(self) -> "Spec":
        wanted = self.deepspeed.activation_checkpointing
        if wanted.partition_activations or wanted.cpu_checkpointing:
            raise ValueError(
                "deepspeed.activation_checkpointing (partition_activations / cpu_checkpointing) is not supported for "
                f"model.family {self.model.family}: DeepSpeed 0.19.8 frees a checkpointed input's storage after "
                "offloading it, and diffusers blocks reuse inputs (the time embedding) across layers, so training "
                "fails in backward. Use model.gradient_checkpointing: true (torch's non-reentrant checkpointing); "
                "partition_activations only splits activations across model-parallel ranks, which dstune does not use."
            )
        return self
