"""The `model` section of the image families (one pydantic class per family; the speech families' are in
speech_models.py, the union on `model.family` in models.py), and the LoRA settings every family shares. Re-exported by dstune.spec.models; torch-free like the rest of the spec."""

from __future__ import annotations

import typing
from typing import Callable, ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from dstune import registry
from dstune.spec.section import DEFAULT_LORA_TARGET_MODULES, LM_LORA_TARGET_MODULES, Section  # noqa: F401


# --------------------------------------------------------------------------------------------------------- model


# model.base_precision -> bytes per stored weight element of each quantized layer (nn.Linear weights of the denoiser;
# biases, convolutions, norms and embeddings stay at train.precision), scales included: bitsandbytes int8 keeps one
# fp32 scale per output row (1 + 4 / in_features, rounded to 1 here), nf4 one fp32 absmax per 64 weights
# (0.5 + 4 / 64). "fp32"/"bf16" are the unquantized base at train.precision (base_precision omitted), for the
# memory plan. dstune.families.quantized_base stores exactly these.
BASE_PRECISION_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "nf4": 0.5625}
FP8_REFUSAL = (
    "fp8 is not available: bitsandbytes (the library dstune quantizes with) stores no fp8 weights, and torchao's "
    "quantized weights are tensor subclasses that fail in deepspeed.initialize, whose parameter broadcast views "
    "every weight as bytes (NotImplementedError: aten.view.dtype; seen with torchao 0.18's int8 weights, and its "
    "fp8 weights are the same kind of tensor). Use int8 (about half of bf16) or nf4 (about a quarter), or train on "
    "an fp8 checkpoint file with model.transformer_file (flow and video families)."
)


VAE_LATENTS_DESCRIPTION = (
    "What the training latents are, from each sample's VAE posterior (the latent cache stores its mean and std): "
    "`sample`, a draw mean + std x noise, per sample and step from dstune's seeded draws (latent_dist.sample(), as "
    "most diffusers training examples); `mean`, the posterior's mean (its mode, as other reference trainers take "
    "it). Omitted: the model's reference trainer's choice (docs/family-flow.md lists it per model)."
)


class LoraSpec(Section):
    type: Literal["lora", "lokr", "loha", "dora"] = Field(
        "lora",
        description="The adapter, through peft: lora (B @ A), dora (LoRA with a learned magnitude per output), lokr "
        "(Kronecker product), loha (Hadamard product of two low-rank pairs). lora and dora export in diffusers' "
        "keys (`pipe.load_lora_weights`) or kohya's; lokr and loha as a peft adapter folder (`adapter/`) or in "
        "LyCORIS/kohya keys (ComfyUI). See docs/lora-and-ema.md.",
    )
    rank: int = Field(16, gt=0, description="LoRA rank r: the inner size of each adapter (A: r x in, B: out x r).")
    alpha: Optional[float] = Field(
        None,
        gt=0,
        description="LoRA alpha: the adapter's output is scaled by alpha / rank. Omitted: equal to rank (scale 1).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES),
        description="Names (or dotted name suffixes, as peft matches them) of the linear/conv layers that get an "
        "adapter. The default, the attention projections to_q, to_k, to_v, to_out.0, fits diffusers UNets and "
        "transformers alike.",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: list[str]) -> list[str]:
        if not value or any(not name.strip() for name in value):
            raise ValueError(
                "give at least one module name, none empty (or leave target_modules out for the family's default)"
            )
        return value

    @model_validator(mode="after")
    def _dropout_of_the_type(self) -> "LoraSpec":
        if self.dropout and self.type in ("lokr", "loha"):
            raise ValueError(
                f"dropout with type {self.type}: peft's {self.type} has rank and module dropout, not LoRA's dropout "
                "on the adapter's input, so the setting would not mean what it says. Remove dropout."
            )
        return self

    @property
    def resolved_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else self.rank)


# A `model.pretrained` ending in one of these is a single checkpoint file (dstune.pretrained converts it).
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")


def single_file_families() -> list[str]:
    """The families whose model section loads single checkpoint files (SINGLE_FILE), from the sections defined."""
    found, pending = [], list(DenoiserModelBase.__subclasses__())
    while pending:
        section = pending.pop(0)
        pending += section.__subclasses__()
        if section.SINGLE_FILE and "family" in section.model_fields:
            found += typing.get_args(section.model_fields["family"].annotation)
    return found


def is_single_file(pretrained: str) -> bool:
    return pretrained.lower().endswith(SINGLE_FILE_SUFFIXES)


def vae_downscale(vae_config: dict) -> Optional[int]:
    """Pixels per latent pixel of a VAE from its config (as the diffusers pipelines compute vae_scale_factor):
    2^(stages - 1) for an AutoencoderKL, 2^(temporal stages) for the video-style VAEs (`temperal_downsample`)."""
    if "temperal_downsample" in vae_config:
        return 2 ** len(vae_config["temperal_downsample"]) * int(vae_config.get("patch_size") or 1)
    if vae_config.get("block_out_channels"):
        return 2 ** (len(vae_config["block_out_channels"]) - 1)
    return None


# The UNet models' LoRA files (output.lora_format, the default first -> the key scheme it is written in): their LoRAs
# are exchanged and loaded (ComfyUI, A1111/Forge, diffusers) as kohya files; ComfyUI maps diffusers' UNet LoRA keys
# only in diffusers' old attention-processor naming, so `comfyui` writes kohya's scheme too.
UNET_LORA_FORMATS = {"kohya": "kohya", "comfyui": "kohya", "diffusers": "diffusers"}


class DenoiserModelBase(Section):
    """What every diffusion family's model section shares: full fine-tuning or LoRA of the
    denoiser (the UNet or transformer the family trains). Subclass it for a new diffusion family's model section.

    What `dstune validate` checks of the folders offline (dstune.model_folders), declared per section:
    MODEL_FOLDER_FIELDS: the keys that name the model itself (their folder's class must be one its family's models
    train, their cards' folder_classes); COMPANION_FOLDERS: other folder keys -> the subfolder of `pretrained` used
    when the key is unset; FILE_FIELDS: keys that name one file."""

    MODEL_FOLDER_FIELDS: ClassVar[tuple[str, ...]] = ("pretrained", "base_pipeline")
    COMPANION_FOLDERS: ClassVar[dict[str, str]] = {}
    FILE_FIELDS: ClassVar[tuple[str, ...]] = ()

    modality: ClassVar[str] = "image"  # what the data is; a video family's section says "video"
    # LORA_FORMATS (Section): `comfyui` names the scheme ComfyUI's LoRA loader maps every key of and diffusers'
    # loader reads back too (docs/lora-and-ema.md); SINGLE_FILE: the Family's single_file says how it is laid out

    train: Literal["full", "lora"] = Field(
        "full",
        description="`full`: every weight of the denoiser (UNet/transformer) is trained. `lora`: the denoiser is "
        "frozen and only LoRA adapters (`lora`) are trained, checkpointed and exported (a LoRA file in the key scheme "
        "of `output.lora_format`). "
        "See docs/lora-and-ema.md.",
    )
    lora: Optional[LoraSpec] = Field(
        None,
        description="LoRA settings, only with `train: lora`: `rank` (16), `alpha` (= rank), `target_modules` "
        "([to_q, to_k, to_v, to_out.0]), `dropout` (0.0); omitted: those defaults. See docs/lora-and-ema.md.",
    )

    base_pipeline: Optional[str] = Field(
        None,
        description="Only when `pretrained` is a single checkpoint file (.safetensors/.ckpt in the original, "
        "non-diffusers key layout, e.g. `model.diffusion_model.*`): the diffusers pipeline folder, hub id already "
        "downloaded, or built-in model whose configs describe the file (nothing is downloaded) and which supplies "
        "every component the file does not hold (a UNet-only file takes VAE and text encoders from here). "
        "The UNet families load single files. See docs/lora-and-ema.md.",
    )
    # The square side, in pixels, that data.resolution defaults to when the model's configs cannot be read here.
    PRESET_RESOLUTION: ClassVar[int] = 1024
    PRESET_NAME: ClassVar[str] = "this family's usual models"

    def native_resolution(self, read: Callable[[str], Optional[dict]]) -> Optional[tuple[int, str]]:
        """The image size the model's own pipeline uses when no size is given, and how it was worked out, from its
        folder's config files (`read("vae/config.json")` -> the parsed file or None); None when they do not say.
        The diffusers pipelines compute it as the denoiser's sample_size (in latent pixels) x the VAE's
        downscaling factor."""
        denoiser, vae = read("unet/config.json") or read("transformer/config.json") or {}, read("vae/config.json") or {}
        factor = vae_downscale(vae)
        if denoiser.get("sample_size") and factor:
            size = int(denoiser["sample_size"]) * factor
            return (
                size,
                f"the denoiser's sample_size {denoiser['sample_size']} x the VAE's {factor}x: its pipeline's default",
            )
        return None

    # sample.guidance when the spec leaves it out and the folder's pipeline is unknown here (its model's card says
    # it otherwise: dstune.model_defaults)
    PRESET_GUIDANCE: ClassVar[float] = 5.0

    base_precision: Optional[Literal["int8", "nf4", "fp8"]] = Field(
        None,
        description="LoRA only: store the frozen denoiser's linear-layer weights quantized (QLoRA-style, with "
        "bitsandbytes) while the adapters train in full precision. `int8`: 1 byte per weight (LLM.int8 with one "
        "scale per row); `nf4`: 4-bit NormalFloat, 0.56 byte per weight. Both run on CPU and CUDA. Under ZeRO-3 "
        "int8 is dstune's own layer (int8 weights and per-row scales as plain parameters, partitioned); nf4 is "
        "ZeRO stage 0-2 only (validate refuses it under ZeRO-3); `fp8` is refused (no fp8 storage "
        "that DeepSpeed accepts). Omitted: the base is kept at train.precision. The exported LoRA loads into the "
        "full-precision pipeline. See docs/lora-and-ema.md.",
    )

    activation_offload: Literal["none", "cpu"] = Field(
        "none",
        description="With gradient_checkpointing: `cpu` copies each checkpointed block's inputs to host memory "
        "(pinned on a GPU) in forward and back to the device when backward recomputes the block: the GPU keeps one "
        "block's inputs instead of every block's, the host holds the rest. The copies are new tensors: an input "
        "several blocks read (the time embedding) stays where it is until nothing reads it. Costs a host copy and "
        "a device copy per block and step (PCIe time, overlapped with nothing). `none`: the inputs stay on the "
        'device. See docs/memory.md, "Activation offload".',
    )

    @field_validator("lora")
    @classmethod
    def _lora_needs_lora_training(cls, value, info):
        if value is not None and info.data.get("train", "full") != "lora":
            raise ValueError(
                "LoRA settings are given but `train` is 'full' (every weight is trained, no adapters). "
                "Set `train: lora` to train adapters, or remove `lora`."
            )
        return value

    @model_validator(mode="after")
    def _base_pipeline_with_a_single_file(self):
        pretrained = getattr(self, "pretrained", "")
        if is_single_file(pretrained) and not self.SINGLE_FILE:
            raise ValueError(
                f"pretrained {pretrained}: model.family {self.family} cannot load a single checkpoint file "
                "here; give its diffusers pipeline folder, a downloaded hub id or a built-in "
                f"({' and '.join(single_file_families())} load single files)"
            )
        if self.base_pipeline is not None and not is_single_file(pretrained):
            raise ValueError(
                f"base_pipeline applies only when pretrained is a single checkpoint file "
                f"({', '.join(SINGLE_FILE_SUFFIXES)}); pretrained is {pretrained!r}: remove base_pipeline"
            )
        if self.base_pipeline is None and is_single_file(pretrained):
            raise ValueError(
                f"pretrained {pretrained} is a single checkpoint file: set base_pipeline to the "
                f"diffusers {self.family} pipeline (folder, downloaded hub id or builtin:tiny-{self.family}) "
                "whose configs describe it and which supplies the components the file does not hold"
            )
        return self

    @model_validator(mode="after")
    def _activation_offload_needs_checkpointing(self):
        if self.activation_offload != "none" and not getattr(self, "gradient_checkpointing", False):
            raise ValueError(
                f"activation_offload {self.activation_offload!r} moves the inputs that gradient checkpointing keeps "
                "for each block; without checkpointing every activation of every block stays on the device and "
                "there is nothing to move: set gradient_checkpointing: true, or remove activation_offload"
            )
        return self

    @field_validator("base_precision")
    @classmethod
    def _base_precision_needs_lora(cls, value, info):
        if value == "fp8":
            raise ValueError(FP8_REFUSAL)
        if value is not None and info.data.get("train", "full") != "lora":
            raise ValueError(
                f"base_precision {value!r} quantizes the frozen base under LoRA, but `train` is 'full': "
                "every weight is trained, and quantized weights cannot be. Set `train: lora`, or remove "
                "base_precision."
            )
        return value

    @property
    def lora_settings(self) -> Optional[LoraSpec]:
        """The LoRA settings in effect: None for full training, the given or default LoraSpec for `train: lora`."""
        if self.train != "lora":
            return None
        return self.lora if self.lora is not None else LoraSpec()


def text_encoder_offload_field():
    """model.text_encoder_offload of the flow-matching families (their loaders place the text encoders)."""
    return Field(
        "none",
        description="`cpu`: the text encoders' weights stay in host memory while they build the text cache, and "
        "each layer's weights are copied to the GPU for its own forward only: the GPU holds one layer (the largest, "
        "the token embedding table) beside the pass's activations instead of the whole encoder (a 12 B encoder: "
        "about 2 GB instead of 24). The embeddings are the same bit for bit; the cost is the copies, the whole "
        "encoder over the host link once per chunk of captions (the cache build is slower; training is not). "
        "Only where the text encoders run for the text cache alone: data.cache.text_embeddings on and the "
        "encoders loaded once per node (docs/caching.md); validate says what stops it otherwise. `none`: the "
        'encoders sit whole on the GPU. See docs/memory.md, "Text encoder offload".',
    )


def transformer_file_field():
    """model.transformer_file of the flow-matching families (their transformer is one diffusers component)."""
    return Field(
        None,
        description="LoRA only: a quantized single-file transformer as people download it (a .safetensors: "
        "ComfyUI's / musubi-tuner's scaled fp8, float8 weights with a `scale_weight` each; or ComfyUI's quantized "
        "layers, `comfy_quant` with float8_e4m3fn, float8_e5m2 or int8_tensorwise and a `weight_scale` each) read "
        "as the frozen base instead of `pretrained`'s transformer/ weights; everything else (configs, VAE, text "
        "encoders) comes from `pretrained`. Its keys are the transformer's in diffusers' naming, or in the "
        "model's original naming where dstune maps it (docs/lora-and-ema.md lists the models; optionally under "
        "`model.diffusion_model.`). The quantized weights stay 1 byte "
        "each on the GPU (under ZeRO-3 partitioned as stored, 1/N each) and are dequantized layer by layer in each "
        "pass; the other tensors train at train.precision. Not with base_precision, training_adapter, lora.type "
        "dora, or NVMe parameter offload. `dstune validate` reads the file's header (its "
        "layout, and its keys against the folder's transformer where its weights are there). See "
        'docs/lora-and-ema.md, "A quantized single-file base".',
    )


def checked_transformer_file(value: Optional[str], data: dict) -> Optional[str]:
    """model.transformer_file against the section's keys read before it (`data`, pydantic's info.data): a
    ValueError that says what clashes and what to change."""
    if value is None:
        return value
    if not value.endswith(".safetensors"):
        raise ValueError(f"{value}: a quantized transformer is read from a .safetensors file")
    lora = data.get("lora")
    clashes = [
        (data.get("train", "full") != "lora", "train is 'full': quantized weights cannot be trained; set train: lora"),
        (data.get("base_precision") is not None, "base_precision quantizes the folder's transformer: remove one"),
        (bool(data.get("training_adapter")), "training_adapter is fused into full-precision weights: remove one"),
        (
            lora is not None and lora.type == "dora",
            "lora.type dora reads the base weight itself (its norm), which is stored quantized here: use lora, lokr "
            "or loha",
        ),
    ]
    found = [why for clash, why in clashes if clash]
    if found:
        raise ValueError("; ".join(found))
    return value


def first_builtin(family: str) -> str:
    """`model.pretrained`'s default for a shared core family: the first built-in of its first model (read when a
    spec leaves the key out, so that the registry's cards are read after the spec modules)."""
    return "builtin:" + next(name for card in registry.family_cards(family) for name in card.builtins)


class FlowModelSpec(DenoiserModelBase):
    """The flow family's `model` section: the flow-matching image transformers (dstune.families.flow_model), the
    model chosen by the folder (its card: dstune.families.flow_card)."""

    PRESET_NAME: ClassVar[str] = "the usual size of the flow-matching image models"
    LORA_FORMATS: ClassVar[dict[str, str]] = {"diffusers": "diffusers", "comfyui": "diffusers"}  # ComfyUI maps its

    # `transformer.` keys
    def native_resolution(self, read: Callable[[str], Optional[dict]]) -> Optional[tuple[int, str]]:
        """The transformer's sample_size x the VAE's factor where the transformer states one; else the VAE's
        sample_size (pipelines that fix their default in code made their VAEs for the same size); else, for a
        video-style VAE with none, the pipelines' default_sample_size of 128 latent pixels x the VAE's factor."""
        found = super().native_resolution(read)
        if found:
            return found
        vae = read("vae/config.json") or {}
        if vae.get("sample_size"):
            return int(vae["sample_size"]), f"the VAE's sample_size {vae['sample_size']}: the size it was made for"
        factor = vae_downscale(vae)
        if "temperal_downsample" in vae and factor:
            pipeline = (read("model_index.json") or {}).get("_class_name") or "its pipeline"
            return 128 * factor, f"{pipeline}'s default: 128 latent pixels x the VAE's {factor}x"
        return None

    family: Literal["flow"] = Field(
        description="Model family. `flow`: the flow-matching image transformers, the model told by the pipeline "
        "folder (the models, their pipelines and built-in tiny models: the table at the top of this page). See "
        "docs/family-flow.md."
    )
    pretrained: str = Field(
        default_factory=lambda: first_builtin("flow"),
        description="A diffusers pipeline folder (model_index.json + transformer/vae/text encoders/tokenizers/"
        "scheduler) of one of the flow models, a hub id already in the local Hugging Face cache, or a tiny model "
        "built offline (`builtin:NAME`). Omitted: the first flow model's built-in.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute transformer activations in backward (torch non-reentrant checkpointing)."
    )
    text_encoder_offload: Literal["none", "cpu"] = text_encoder_offload_field()
    timestep_sampling: Literal["logit_normal", "uniform", "mode"] = Field(
        "logit_normal",
        description="How the training timestep is drawn (diffusers' compute_density_for_timestep_sampling): "
        "logit_normal (logit_mean, logit_std), uniform, or mode (mode_scale).",
    )
    logit_mean: Optional[float] = Field(
        None,
        description="timestep_sampling logit_normal: mean of the normal before the sigmoid. Omitted: 0.0. "
        "A model whose training example shifts it with the image size adds that shift (docs/family-flow.md).",
    )
    logit_std: Optional[float] = Field(
        None,
        gt=0,
        description="timestep_sampling logit_normal: its standard deviation. Omitted: 1.0, or the "
        "model's training example's default where it has its own (docs/family-flow.md).",
    )
    mode_scale: Optional[float] = Field(
        None, description="timestep_sampling mode: how strongly mid timesteps are favoured. Omitted: 1.29."
    )
    shift: Optional[float] = Field(
        None,
        gt=0,
        description="Timestep shift for training (sigma -> shift*sigma / (1 + (shift-1)*sigma)). Omitted: the "
        "scheduler's: its config shift, or unshifted where it shifts dynamically, as the reference scripts train. "
        "Not for a model whose training example draws sigma itself (validate says so).",
    )
    vae_latents: Optional[Literal["sample", "mean"]] = Field(None, description=VAE_LATENTS_DESCRIPTION)
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = Field(
        "none",
        description="Per-sample loss weight (diffusers' compute_loss_weighting_for_sd3). sigma_sqrt (sigma^-2) "
        "needs precondition_outputs: true, where it cancels the sigma^2 of the x0 error (docs/family-flow.md).",
    )
    precondition_outputs: bool = Field(
        False,
        description="Compare x0 instead of the velocity: the prediction v becomes x_t - sigma v and the "
        "target x0, which weights each sample's squared velocity error by sigma^2 (--precondition_outputs 1, the "
        "default of diffusers' MMDiT scripts); false: the velocity loss of diffusers' other flow-matching scripts.",
    )
    guidance: float = Field(
        3.5,
        ge=0,
        description="Transformers with a guidance embedding (their config's guidance_embeds): the "
        "guidance value fed while training. Unused by the others.",
    )
    max_sequence_length: Optional[int] = Field(
        None,
        gt=0,
        description="Text tokens per caption (the long text encoder's: T5's, or the LLM prompt's). "
        "Omitted: the model's training example default, at most the tokenizer's model_max_length (each model's "
        "default: the table at the top of this page).",
    )
    training_adapter: Optional[str] = Field(
        None,
        description="A LoRA file (diffusers' pytorch_lora_weights.safetensors layout) fused into the frozen "
        "transformer for training only: train a LoRA through a distilled (few-step) model without "
        "breaking its few-step behaviour. It is left out of the exported LoRA and of the samples (they render "
        "`sample.pretrained`, or `pretrained` without it, with the trained LoRA). `train: lora` only, ZeRO stage 0-2. "
        'See docs/family-flow.md, "Distilled checkpoints".',
    )

    transformer_file: Optional[str] = transformer_file_field()
    FILE_FIELDS: ClassVar[tuple[str, ...]] = ("transformer_file",)

    @field_validator("transformer_file")
    @classmethod
    def _transformer_file_fits(cls, value, info):
        return checked_transformer_file(value, info.data)

    @model_validator(mode="after")
    def _no_unused_sampling_settings(self) -> "FlowModelSpec":
        used = {"logit_normal": {"logit_mean", "logit_std"}, "mode": {"mode_scale"}, "uniform": set()}
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
        if self.training_adapter and self.train != "lora":
            raise ValueError(
                "training_adapter is fused into the frozen base while adapters train, and kept out of "
                "the exported LoRA; with train: full the exported transformer would carry it: set "
                "train: lora, or remove training_adapter"
            )
        if self.loss_weighting == "sigma_sqrt" and not self.precondition_outputs:
            raise ValueError(
                "loss_weighting sigma_sqrt weights each sample by sigma^-2 on the velocity loss: on "
                "a logit-normal schedule a mean weight of about 186 and up to about 1e5 near sigma 0, so "
                "a few samples dominate every step. diffusers' MMDiT scripts pair it with their default "
                "--precondition_outputs 1, where it cancels to the plain velocity MSE: set "
                "precondition_outputs: true for that, or use loss_weighting none or cosmap"
            )
        return self
