"""The `sd` family: Stable Diffusion 1.x / 2.x (UNet2DConditionModel, one CLIP text encoder, AutoencoderKL).

The API the engine, loop and export call (see dstune.families.base for the shared contract):

    build(model: SdModelSpec, folders, device, dtype_for_frozen) -> SdBuilt
    encode_batch(built, batch, dtype) -> {"latent_mean", "latent_std", "encoder_hidden_states", "indices"}
    loss(built, trainable_forward, encoded, seed, step) -> scalar tensor (mean over the micro batch)
    sample(built, unet_module, prompts, sample_spec, resolution) -> list[PIL.Image]
    export(built, unet_state_dict, out_dir, pretrained_folder=None) -> Path

The loss is diffusers' examples/text_to_image/train_text_to_image.py: epsilon or v target, optional offset
noise, optional Min-SNR-gamma weighting. What differs is where randomness comes from: every draw of a sample
(VAE posterior, noise, offset noise, timestep) comes from its own generator, seeded by (train.seed, optimizer
step, dataset index, purpose), so results do not depend on the rank count or the accumulation split. That is also
why encode_batch returns the VAE posterior (mean, std) and the loss draws the latent: encode_batch stays
deterministic (cacheable), and the draw is per sample and per step like the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from dstune.models import registry
from dstune.families.base import Family, FamilyError, SingleFileLayout, TextCache
from dstune.families.precision import at_least_float32
from dstune.families.randomness import per_sample_randint, per_sample_randn, sample_generator
from dstune.families.diffusion import (
    batch_field,
    export_pipeline_folder,
    inputs_cast_to,
    load_component,
    load_trainable,
    non_reentrant_checkpoint,
)
from dstune.families.folders import read_component_config, read_model_index
from dstune.families.samples import save_grid
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import SampleSpec
from dstune.models.sd.spec import SdModelSpec

__all__ = [
    "SdBuilt",
    "FAMILY",
    "build",
    "encode_batch",
    "loss",
    "sample",
    "export",
    "save_lora_weights",
    "check_sd_folder",
    "cache_text_tensors",
    "unet_component_problems",
    "training_noise_scheduler",
    "render",
    "unet_pipeline_parts",
]

# component -> (accepted class names, or None for any diffusers scheduler; the file that must exist in it)
_COMPONENTS = {
    "unet": ({"UNet2DConditionModel"}, "config.json"),
    "vae": ({"AutoencoderKL"}, "config.json"),
    "text_encoder": ({"CLIPTextModel"}, "config.json"),
    "tokenizer": ({"CLIPTokenizer", "CLIPTokenizerFast"}, "tokenizer_config.json"),
    "scheduler": (None, "scheduler_config.json"),
}
# Pipelines people mistake for SD 1.x/2.x ones: SDXL's, every model on a shared core (its unit's title), and two
# transformers dstune does not train
_OTHER_PIPELINES = {
    "StableDiffusionXLPipeline": "SDXL",
    **{name: unit.title for unit in registry.UNITS for name in unit.pipelines},
    "PixArtSigmaPipeline": "PixArt",
    "PixArtAlphaPipeline": "PixArt",
    "SanaPipeline": "Sana",
}


@dataclass
class SdBuilt:
    """The loaded model. `trainable` is the UNet (train mode, requires_grad on) and the only part DeepSpeed wraps;
    vae, text_encoder, tokenizer and noise_scheduler are frozen companions on `device` (eval, no grad)."""

    folder: Path  # the resolved pipeline folder everything was loaded from
    device: torch.device
    trainable: torch.nn.Module  # UNet2DConditionModel
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: object
    noise_scheduler: object  # DDPMScheduler with the resolved prediction_type registered
    prediction_type: str  # "epsilon" | "v_prediction"
    min_snr_gamma: Optional[float]
    noise_offset: float
    unet_config: dict  # the source UNet's config: export builds a fresh UNet from it

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"vae": self.vae, "text_encoder": self.text_encoder}


# ---------------------------------------------------------------------------------------------------- build


def check_sd_folder(folder: Path) -> None:
    """Raise one FamilyError listing everything that keeps `folder` from being an SD 1.x/2.x pipeline."""
    index = read_model_index(folder)
    kind = index.get("_class_name")
    if kind in _OTHER_PIPELINES:
        raise FamilyError(
            f"{folder} holds a {kind} ({_OTHER_PIPELINES[kind]}) model; model.family 'sd' is for "
            "Stable Diffusion 1.x/2.x (StableDiffusionPipeline) only."
        )
    problems = unet_component_problems(folder, index, _COMPONENTS)
    if not problems:
        problems = _config_mismatches(folder)
    if problems:
        raise FamilyError(
            f"{folder} cannot be used as an `sd` (Stable Diffusion 1.x/2.x) model:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def unet_component_problems(
    folder: Path, index: dict, components: dict, missing_hints: Optional[dict] = None
) -> list[str]:
    """What keeps the components of a UNet pipeline folder from loading: `components` maps each name to (accepted
    class names, or None for any; the file that must exist in its subfolder); `missing_hints` adds a reason to a
    component that model_index.json lacks (SDXL: a refiner has no text_encoder). The flow and video cores' check
    (dstune.families.diffusion.component_problems) takes one class per component and no required file, and words its
    problems otherwise."""
    problems = []
    for name, (classes, required_file) in components.items():
        entry = index.get(name)
        listed = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if listed is None:
            problems.append(f"model_index.json has no `{name}` component{(missing_hints or {}).get(name, '')}")
        elif classes is not None and listed not in classes:
            problems.append(f"`{name}` is a {listed}; expected {' or '.join(sorted(classes))}")
        if not (folder / name).is_dir():
            problems.append(f"missing subfolder {name}/")
        elif not (folder / name / required_file).is_file():
            problems.append(f"missing {name}/{required_file}")
    return problems


def _config_mismatches(folder: Path) -> list[str]:
    def config(name: str) -> dict:
        return read_component_config(folder, name)

    unet, vae, text = config("unet"), config("vae"), config("text_encoder")
    problems = []
    if unet.get("addition_embed_type") is not None:
        problems.append(f"the UNet has addition_embed_type {unet['addition_embed_type']!r} (an SDXL-style UNet)")
    if unet.get("in_channels") != vae.get("latent_channels", 4):
        problems.append(
            f"unet in_channels {unet.get('in_channels')} != vae latent_channels "
            f"{vae.get('latent_channels', 4)} (inpainting UNets are not supported)"
        )
    if unet.get("cross_attention_dim") != text.get("hidden_size"):
        problems.append(
            f"unet cross_attention_dim {unet.get('cross_attention_dim')} != text_encoder hidden_size "
            f"{text.get('hidden_size')}"
        )
    return problems


def training_noise_scheduler(folder: Path, prediction: Optional[str]):
    """(the training DDPMScheduler with the resolved prediction type registered, that type): model.prediction, else
    the scheduler's own; epsilon or v_prediction, and no epsilon on a zero-terminal-SNR schedule."""
    from diffusers import DDPMScheduler

    noise_scheduler = load_component(folder, "scheduler", DDPMScheduler.from_pretrained)
    prediction_type = prediction or noise_scheduler.config.prediction_type
    if prediction_type not in ("epsilon", "v_prediction"):
        raise FamilyError(
            f"{folder / 'scheduler'}: prediction_type {prediction_type!r} is not supported; set "
            "model.prediction to epsilon or v_prediction"
        )
    if prediction_type == "epsilon" and float(noise_scheduler.alphas_cumprod[-1]) == 0.0:
        raise FamilyError(
            f"{folder / 'scheduler'} has zero terminal SNR (rescale_betas_zero_snr), where an "
            "epsilon-predicting model cannot denoise its first sampling step (x_T holds no image). Use "
            "model.prediction: v_prediction (or leave it unset)."
        )
    noise_scheduler.register_to_config(prediction_type=prediction_type)
    return noise_scheduler, prediction_type


def build(
    model: SdModelSpec,
    folders: dict,
    device,
    dtype_for_frozen: torch.dtype = torch.float32,
    zero3_config: Optional[dict] = None,
) -> SdBuilt:
    """Load `model.pretrained`. The UNet is fp32 in host memory (the start-up casts and moves it), built partitioned
    with `zero3_config` (dstune.families.diffusion.load_trainable); the frozen parts are cast to `dtype_for_frozen`.
    Never downloads; raises FamilyError for any unusable folder."""
    folder = folders["pretrained"]
    check_sd_folder(folder)
    return SdBuilt(**unet_pipeline_parts(model, folder, device, dtype_for_frozen, zero3_config))


def unet_pipeline_parts(
    model, folder: Path, device, dtype_for_frozen: torch.dtype, zero3_config: Optional[dict]
) -> dict:
    """What SD and SDXL load alike, as SdBuilt's fields: the trainable UNet, the VAE, the first CLIP text encoder
    and tokenizer, and the training noise scheduler with the resolved prediction type."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    device = torch.device(device)
    noise_scheduler, prediction_type = training_noise_scheduler(folder, model.prediction)
    # diffusers models get their dtype at load time: ModelMixin.to(dtype) warns on every call (diffusers 0.42).
    unet = load_trainable(folder, "unet", UNet2DConditionModel, zero3_config)
    if model.gradient_checkpointing:
        unet.enable_gradient_checkpointing(gradient_checkpointing_func=non_reentrant_checkpoint)
    unet.train().requires_grad_(True)
    vae = load_component(folder, "vae", AutoencoderKL.from_pretrained, torch_dtype=dtype_for_frozen).to(device)
    text_encoder = load_component(folder, "text_encoder", CLIPTextModel.from_pretrained).to(device, dtype_for_frozen)
    for part in (vae, text_encoder):
        part.eval().requires_grad_(False)
    return {
        "folder": folder,
        "device": device,
        "trainable": unet,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": load_component(folder, "tokenizer", CLIPTokenizer.from_pretrained),
        "noise_scheduler": noise_scheduler,
        "prediction_type": prediction_type,
        "min_snr_gamma": model.min_snr_gamma,
        "noise_offset": model.noise_offset,
        "unet_config": dict(unet.config),
    }


# --------------------------------------------------------------------------------------------- train step


def encode_batch(built: SdBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The frozen encoders' view of a collated batch: the VAE posterior (mean, std; float32, unscaled), the text
    embeddings (in `dtype`, the trainable's compute dtype) and the samples' dataset indices. No random draws.
    A batch from the cache (dstune.data.cached) already holds latent_mean/latent_std and/or encoder_hidden_states;
    those are used as stored, and only the missing part is encoded here."""
    indices = torch.as_tensor(batch_field(batch, "indices", "index"), dtype=torch.long)
    if "latent_mean" in batch:
        mean, std = batch["latent_mean"].to(built.device).float(), batch["latent_std"].to(built.device).float()
    else:
        pixels = batch_field(batch, "pixel_values").to(built.device, built.vae.dtype)
        with torch.no_grad():
            posterior = built.vae.encode(pixels).latent_dist
        mean, std = at_least_float32(posterior.mean), at_least_float32(posterior.std)
    if "encoder_hidden_states" in batch:
        hidden = batch["encoder_hidden_states"].to(built.device)
    else:
        hidden = encode_captions(built, list(batch_field(batch, "captions", "caption")))
    return {"latent_mean": mean, "latent_std": std, "encoder_hidden_states": hidden.to(dtype), "indices": indices}


def encode_captions(built: SdBuilt, captions: list[str]) -> torch.Tensor:
    """The text encoder's last hidden state for `captions`, in the text encoder's dtype."""
    max_length = min(built.tokenizer.model_max_length, built.text_encoder.config.max_position_embeddings)
    token_ids = built.tokenizer(
        captions, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids.to(built.device)
    with torch.no_grad():
        return built.text_encoder(token_ids, return_dict=False)[0]


def min_snr_weights(noise_scheduler, timesteps: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Per-sample Min-SNR-gamma loss weights, as diffusers' train_text_to_image.py computes them; one difference:
    with a zero-terminal-SNR schedule, epsilon's min(snr, gamma) / snr is 0 / 0 at the last timestep, where diffusers
    gives NaN and this gives the limit, 1."""
    from diffusers.training_utils import compute_snr

    snr = compute_snr(noise_scheduler, timesteps)
    weights = torch.stack([snr, gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    if prediction_type == "epsilon":
        return torch.where(snr > 0, weights / snr.clamp_min(torch.finfo(snr.dtype).tiny), torch.ones_like(snr))
    return weights / (snr + 1)


def loss(built: SdBuilt, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """The diffusion loss of one micro batch (mean over its samples). `seed` is train.seed, `step` the optimizer
    step; with the samples' dataset indices they fix every random draw (see dstune.families.base)."""
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    indices, shape, device = encoded["indices"].tolist(), tuple(mean.shape[1:]), mean.device
    draw = lambda purpose, size: per_sample_randn(size, seed, step, indices, purpose).to(device)  # noqa: E731
    vae_config = built.vae.config
    latents = mean + std * draw("vae_posterior", shape)
    latents = (latents - (getattr(vae_config, "shift_factor", None) or 0.0)) * vae_config.scaling_factor
    noise = draw("noise", shape)
    if built.noise_offset:
        noise = noise + built.noise_offset * draw("noise_offset", (shape[0], 1, 1))
    scheduler = built.noise_scheduler
    timesteps = per_sample_randint(scheduler.config.num_train_timesteps, seed, step, indices, "timestep").to(device)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    target = noise if built.prediction_type == "epsilon" else scheduler.get_velocity(latents, noise, timesteps)
    param_dtype = next(built.trainable.parameters()).dtype
    prediction = trainable_forward(
        noisy.to(param_dtype), timesteps, encoded["encoder_hidden_states"].to(param_dtype), return_dict=False
    )[0]
    error = F.mse_loss(at_least_float32(prediction), at_least_float32(target), reduction="none")
    per_sample = error.mean(dim=(1, 2, 3))
    if built.min_snr_gamma:
        per_sample = per_sample * min_snr_weights(scheduler, timesteps, built.min_snr_gamma, built.prediction_type)
    return per_sample.mean()


# ------------------------------------------------------------------------------------------------- sampling


def sample(
    built: SdBuilt, unet_module: torch.nn.Module, prompts: list[str], sample_spec: SampleSpec, resolution: int
) -> list:
    """Render one image per prompt with a StableDiffusionPipeline around `unet_module` (no weight copy) and a DDIM
    scheduler. Prompt i always starts from the noise of sample_spec.seed and i, so grids of different steps are
    comparable. The UNet's train/eval mode is restored afterwards. The side is rounded down to a multiple of 8
    (the pipeline's requirement)."""
    from diffusers import DDIMScheduler

    if not prompts:
        return []
    with quiet_hf_libraries():
        from diffusers import StableDiffusionPipeline

        scheduler = DDIMScheduler.from_config(built.noise_scheduler.config, set_alpha_to_one=False)
    pipeline = StableDiffusionPipeline(
        vae=built.vae,
        text_encoder=built.text_encoder,
        tokenizer=built.tokenizer,
        unet=unet_module,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return render(pipeline, unet_module, prompts, sample_spec, resolution)


def render(pipeline, unet_module: torch.nn.Module, prompts: list[str], sample_spec: SampleSpec, resolution: int):
    """One image per prompt from a UNet pipeline built around `unet_module`: the side rounded down to a multiple of
    8, prompt i from the noise of (sample_spec.seed, i), the UNet's train/eval mode restored afterwards."""
    pipeline.set_progress_bar_config(disable=True)
    side = max(8, resolution // 8 * 8)
    generators = [sample_generator(sample_spec.seed, 0, number, "sample") for number in range(len(prompts))]
    was_training = unet_module.training
    unet_module.eval()
    try:
        with inputs_cast_to(unet_module, next(unet_module.parameters()).dtype), quiet_hf_libraries():
            result = pipeline(
                prompt=list(prompts),
                height=side,
                width=side,
                guidance_scale=sample_spec.guidance,
                num_inference_steps=sample_spec.steps,
                generator=generators,
                output_type="pil",
            )
    finally:
        unet_module.train(was_training)
    return result.images


# --------------------------------------------------------------------------------------------------- export


def _fresh_unet(built: SdBuilt, state_dict: dict):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_config(built.unet_config)
    expected, given = set(unet.state_dict()), set(state_dict)
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise FamilyError(
            f"the trained weights do not fit the UNet of {built.folder}: {len(missing)} missing "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    unet.load_state_dict(state_dict, strict=True)
    return unet


def _set_prediction_type(scheduler_dir: Path, prediction_type: str) -> None:
    """Record the trained prediction type, so inference with the export uses the right target."""
    path = scheduler_dir / "scheduler_config.json"
    config = json.loads(path.read_text())
    if config.get("prediction_type") != prediction_type:
        config["prediction_type"] = prediction_type
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export(built: SdBuilt, unet_state_dict: dict, out_dir, pretrained_folder=None) -> Path:
    """Write a complete diffusers pipeline folder at `out_dir`: the trained UNet (safetensors, loaded strictly into a
    fresh UNet built from the source config) plus the source pipeline's other components copied unchanged.
    Written beside `out_dir` and renamed into place, replacing an older export only once complete."""
    source = Path(pretrained_folder) if pretrained_folder is not None else built.folder
    return export_pipeline_folder(
        source,
        out_dir,
        "unet",
        _fresh_unet(built, unet_state_dict),
        finish=lambda work: _set_prediction_type(work / "scheduler", built.prediction_type),
    )


def save_lora_weights(built: SdBuilt, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
    """The UNet's LoRA as StableDiffusionPipeline writes it (dstune.families.lora builds the layers, in diffusers naming)."""
    from diffusers import StableDiffusionPipeline

    StableDiffusionPipeline.save_lora_weights(
        folder, unet_lora_layers=lora_layers, unet_lora_adapter_metadata=adapter_metadata, safe_serialization=True
    )


def cache_text_tensors(built: SdBuilt, captions: list[str]) -> dict[str, torch.Tensor]:
    """The text cache's tensors: the one encoder's last hidden state."""
    return {"encoder_hidden_states": encode_captions(built, captions)}


# The original Stable Diffusion checkpoint layout (what from_single_file reads): UNet under model.diffusion_model.,
# VAE under first_stage_model., the CLIP text encoder under cond_stage_model. (SD 2.x: its OpenCLIP naming).
SINGLE_FILE = SingleFileLayout(
    "unet", ("model.diffusion_model.",), {"vae": ("first_stage_model.",), "text_encoder": ("cond_stage_model.",)}
)

FAMILY = Family(
    name="sd",
    modality="image",
    pretrained_fields=("pretrained",),
    build=build,
    encode_batch=encode_batch,
    loss=loss,
    sample=sample,
    save_samples=save_grid,
    export=export,
    save_lora_weights=save_lora_weights,
    text_cache=TextCache(("text_encoder", "tokenizer"), ("encoder_hidden_states",), cache_text_tensors),
    single_file=SINGLE_FILE,
    builds_partitioned=True,
)
