"""The `flow` family: flow-matching transformers (the `transformer` subfolder, FlowMatchEulerDiscreteScheduler).

Two classes of pipeline folder, told apart by model_index.json and the transformer's config class:

    SD3-class  SD3Transformer2DModel; CLIP x2 (CLIPTextModelWithProjection) + T5. Prompt embeds: both CLIPs'
               penultimate hidden states side by side, zero-padded to the T5 width, then T5's along the sequence;
               pooled: both CLIP projections side by side. 16-channel VAE with shift_factor and scaling_factor.
    Flux-class FluxTransformer2DModel; CLIPTextModel (pooled only) + T5. Latents packed 2x2 into tokens, with
               img_ids / txt_ids positions and a guidance embedding when the transformer has guidance_embeds.

The text side is encoded by the pipeline's own `encode_prompt`, so training sees exactly what inference feeds.
The loss is diffusers' examples/dreambooth/train_dreambooth_sd3.py / train_dreambooth_flux.py: sample u with
compute_density_for_timestep_sampling (uniform, logit_normal, mode), index the scheduler's timestep and sigma
tables with it, x_t = (1 - sigma) x0 + sigma noise, target noise - x0, weighting none / sigma_sqrt / cosmap.
As in the sd family, every draw of a sample (VAE posterior, noise, u) comes from its own generator seeded by
(train.seed, optimizer step, dataset index, purpose), so results do not depend on the rank count.

    build(model: FlowModel, folders, device, dtype_for_frozen) -> FlowBuilt
    encode_batch(built, batch, dtype) -> {"latent_mean", "latent_std", "encoder_hidden_states",
                                          "pooled_projections", "indices"}
    loss(built, trainable_forward, encoded, seed, step) -> scalar tensor (mean over the micro batch)
    sample(built, transformer_module, prompts, sample_spec, resolution) -> list[PIL.Image]
    export(built, transformer_state_dict, out_dir, pretrained_folder=None) -> Path
    cache hooks: TEXT_CACHE_FOLDERS, TEXT_CACHE_TENSORS, cache_text_tensors (see dstune.families.base)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from dstune.families.base import Family, FamilyError, TextCache, per_sample_randn, sample_generator
from dstune.families.diffusion import (batch_field, export_pipeline_folder, inputs_cast_to, load_component,
                                       load_trainable, non_reentrant_checkpoint, read_model_index)
from dstune.families.flow_matching import (flow_loss_per_sample, image_ids, loss_weights, pack_latents,
                                           timestep_density, unpack_latents)
from dstune.families.samples import save_grid
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import FlowModel, SampleSpec

__all__ = ["FlowBuilt", "build", "encode_batch", "loss", "sample", "export", "FAMILY", "detect_kind",
           "cache_text_tensors", "TEXT_CACHE_FOLDERS", "TEXT_CACHE_TENSORS", "timestep_density", "loss_weights",
           "pack_latents", "unpack_latents", "image_ids", "save_lora_weights"]

# kind -> (transformer class, pipeline class, {component: accepted classes}); tokenizers/scheduler checked loosely
_KINDS = {
    "sd3": ("SD3Transformer2DModel", "StableDiffusion3Pipeline", {
        "text_encoder": "CLIPTextModelWithProjection", "text_encoder_2": "CLIPTextModelWithProjection",
        "text_encoder_3": "T5EncoderModel", "tokenizer": None, "tokenizer_2": None, "tokenizer_3": None}),
    "flux": ("FluxTransformer2DModel", "FluxPipeline", {
        "text_encoder": "CLIPTextModel", "text_encoder_2": "T5EncoderModel", "tokenizer": None, "tokenizer_2": None}),
}
_DEFAULT_SEQUENCE = {"sd3": 77, "flux": 512}  # the dreambooth scripts' --max_sequence_length defaults
_CLIP_TOKENS = 77  # SD3's CLIP part of the prompt embeds is always the CLIP tokenizers' 77 tokens

# Cache hooks (dstune.families.base): every folder that decides a caption's embeddings (a folder a kind lacks,
# Flux's text_encoder_3, adds nothing to the fingerprint), and the tensors stored per caption.
TEXT_CACHE_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
TEXT_CACHE_TENSORS = ("encoder_hidden_states", "pooled_projections")


@dataclass
class FlowBuilt:
    """The loaded model. `trainable` is the transformer (the only part DeepSpeed wraps); the VAE and the text
    encoders are frozen companions on `device`."""

    folder: Path
    device: torch.device
    kind: str  # "sd3" | "flux"
    trainable: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module  # CLIP (SD3: with projection)
    text_encoder_2: torch.nn.Module  # SD3: the second CLIP; Flux: T5
    text_encoder_3: Optional[torch.nn.Module]  # SD3: T5; Flux: None
    tokenizers: dict  # component name -> tokenizer
    scheduler: object  # the folder's FlowMatchEulerDiscreteScheduler, as inference uses it
    train_timesteps: torch.Tensor  # the tables u indexes (with model.shift applied when given)
    train_sigmas: torch.Tensor
    settings: FlowModel
    max_sequence_length: int
    transformer_config: dict

    @property
    def text_encoders(self) -> dict[str, torch.nn.Module]:
        names = ("text_encoder", "text_encoder_2", "text_encoder_3")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"vae": self.vae, **self.text_encoders}

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.transformer_config.get("guidance_embeds", False))


# ---------------------------------------------------------------------------------------------------- build


def _config(folder: Path, name: str, file: str = "config.json") -> dict:
    path = folder / name / file
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FamilyError(f"{path}: cannot read it ({err})") from None


def detect_kind(folder: Path) -> str:
    """'sd3' or 'flux' from model_index.json and transformer/config.json; FamilyError naming what is unsupported."""
    index = read_model_index(folder)
    supported = ", ".join(f"{t} ({p})" for t, p, _ in _KINDS.values())
    if not (folder / "transformer").is_dir():
        hint = " (a UNet pipeline: use model.family sd)" if "unet" in index else ""
        raise FamilyError(f"{folder} has no transformer/ subfolder{hint}; model.family 'flow' trains {supported}.")
    transformer_class = _config(folder, "transformer").get("_class_name")
    kinds = [kind for kind, (cls, _, _) in _KINDS.items() if cls == transformer_class]
    if not kinds:
        raise FamilyError(f"{folder / 'transformer'}: {transformer_class} is not supported by model.family 'flow'; "
                          f"supported transformers: {supported}.")
    kind = kinds[0]
    problems = []
    for name, expected in _KINDS[kind][2].items():
        entry = index.get(name)
        listed = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if listed is None or not (folder / name).is_dir():
            problems.append(f"no `{name}` component (model_index.json entry and {name}/ subfolder)")
        elif expected is not None and listed != expected:
            problems.append(f"`{name}` is a {listed}; expected {expected}")
    for name in ("vae", "scheduler"):
        if not (folder / name).is_dir():
            problems.append(f"missing subfolder {name}/")
    if problems:
        raise FamilyError(f"{folder} cannot be used as a {transformer_class} pipeline:\n"
                          + "\n".join(f"  - {p}" for p in problems))
    return kind


def _config_mismatches(folder: Path, kind: str) -> list[str]:
    transformer, vae = _config(folder, "transformer"), _config(folder, "vae")
    channels = vae.get("latent_channels", 4)
    if kind == "sd3":
        t5, clips = _config(folder, "text_encoder_3"), [_config(folder, n) for n in ("text_encoder", "text_encoder_2")]
        checks = [("in_channels", channels), ("joint_attention_dim", t5.get("d_model")),
                  ("pooled_projection_dim", sum(c.get("projection_dim", 0) for c in clips))]
    else:
        t5, clip = _config(folder, "text_encoder_2"), _config(folder, "text_encoder")
        checks = [("in_channels", 4 * channels), ("joint_attention_dim", t5.get("d_model")),
                  ("pooled_projection_dim", clip.get("hidden_size"))]
    return [f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
            for key, want in checks if transformer.get(key) != want]


def _train_tables(scheduler, shift) -> tuple[torch.Tensor, torch.Tensor]:
    """The timestep and sigma tables u indexes, as the scripts take them from a fresh scheduler: shifted by the
    config's shift, except with dynamic shifting (Flux), where the scripts train on unshifted sigmas. model.shift
    replaces either with a fixed shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if shift is not None:
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config, shift=shift,
                                                                use_dynamic_shifting=False)
    return scheduler.timesteps.clone().float(), scheduler.sigmas.clone().float()


def _load_text_side(folder: Path, kind: str, device, dtype) -> tuple[dict, dict]:
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    classes = {"CLIPTextModelWithProjection": CLIPTextModelWithProjection, "CLIPTextModel": CLIPTextModel,
               "T5EncoderModel": T5EncoderModel}
    encoders, tokenizers = {}, {}
    for name, expected in _KINDS[kind][2].items():
        if expected is None:
            tokenizers[name] = load_component(folder, name, AutoTokenizer.from_pretrained)
        else:
            module = load_component(folder, name, classes[expected].from_pretrained).to(device, dtype)
            encoders[name] = module.eval().requires_grad_(False)
    return encoders, tokenizers


def build(model: FlowModel, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32,
          zero3_config: Optional[dict] = None) -> FlowBuilt:
    """Load `model.pretrained`: the transformer fp32 on `device` (DeepSpeed casts it for bf16; partitioned with
    `zero3_config`, dstune.families.diffusion.load_trainable), the frozen parts
    in `dtype_for_frozen`. Never downloads; FamilyError for any folder that is not an SD3- or Flux-class pipeline."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    folder = folders["pretrained"]
    kind = detect_kind(folder)
    problems = _config_mismatches(folder, kind)
    if problems:
        raise FamilyError(f"{folder}: the components do not fit together:\n" + "\n".join(f"  - {p}" for p in problems))
    device = torch.device(device)
    scheduler = load_component(folder, "scheduler", FlowMatchEulerDiscreteScheduler.from_pretrained)
    with quiet_hf_libraries():
        import diffusers

    transformer_class = getattr(diffusers, _KINDS[kind][0])
    transformer = load_trainable(folder, "transformer", transformer_class, device, zero3_config)
    if model.gradient_checkpointing:
        transformer.enable_gradient_checkpointing(gradient_checkpointing_func=non_reentrant_checkpoint)
    transformer.to(device).train().requires_grad_(True)
    vae = load_component(folder, "vae", AutoencoderKL.from_pretrained, torch_dtype=dtype_for_frozen).to(device)
    vae.eval().requires_grad_(False)
    encoders, tokenizers = _load_text_side(folder, kind, device, dtype_for_frozen)
    t5_tokenizer = tokenizers["tokenizer_3" if kind == "sd3" else "tokenizer_2"]
    max_length = model.max_sequence_length or min(_DEFAULT_SEQUENCE[kind], t5_tokenizer.model_max_length)
    timesteps, sigmas = _train_tables(scheduler, model.shift)
    return FlowBuilt(folder=folder, device=device, kind=kind, trainable=transformer, vae=vae,
                     text_encoder=encoders["text_encoder"], text_encoder_2=encoders["text_encoder_2"],
                     text_encoder_3=encoders.get("text_encoder_3"), tokenizers=tokenizers, scheduler=scheduler,
                     train_timesteps=timesteps, train_sigmas=sigmas, settings=model,
                     max_sequence_length=int(max_length), transformer_config=dict(transformer.config))


def _pipeline(built: FlowBuilt, transformer=None, vae=None, scheduler=None):
    """The diffusers pipeline around the built parts (references, no copies); without transformer and VAE it is
    the text side only, which is all encode_prompt needs."""
    with quiet_hf_libraries():
        import diffusers

        cls = getattr(diffusers, _KINDS[built.kind][1])
        pipeline = cls(transformer=transformer, vae=vae, scheduler=scheduler or built.scheduler,
                       **built.text_encoders, **built.tokenizers)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# --------------------------------------------------------------------------------------------- train step


def encode_captions(built: FlowBuilt, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt embeds (B, T, D), pooled (B, P)) for `captions`, from the pipeline's own encode_prompt."""
    pipeline = _pipeline(built)
    with torch.no_grad(), quiet_hf_libraries():
        if built.kind == "sd3":
            embeds, _, pooled, _ = pipeline.encode_prompt(
                captions, captions, captions, device=built.device, do_classifier_free_guidance=False,
                max_sequence_length=built.max_sequence_length)
        else:
            embeds, pooled, _ = pipeline.encode_prompt(captions, captions, device=built.device,
                                                       max_sequence_length=built.max_sequence_length)
    return embeds, pooled


def cache_text_tensors(built: FlowBuilt, captions: list[str]) -> dict[str, torch.Tensor]:
    embeds, pooled = encode_captions(built, captions)
    return {"encoder_hidden_states": embeds, "pooled_projections": pooled}


def text_cache_settings(model: FlowModel) -> str:
    """Part of every text entry's key: the same encoders give other tensors at another max_sequence_length."""
    return f"max_sequence_length={model.max_sequence_length}"


def _check_cached_sequence(built: FlowBuilt, tokens: int) -> None:
    """A second guard behind text_cache_settings (which puts max_sequence_length in the key): embeddings of the
    wrong length never reach the transformer, whatever wrote them."""
    expected = built.max_sequence_length + (_CLIP_TOKENS if built.kind == "sd3" else 0)
    if tokens != expected:
        raise ValueError(f"the cached text embeddings have {tokens} tokens, but model.max_sequence_length "
                         f"{built.max_sequence_length} gives {expected}: they were cached with another "
                         "max_sequence_length. Delete data.cache.dir (or choose another) to re-encode them.")


def encode_batch(built: FlowBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The frozen encoders' view of a collated batch: the VAE posterior (mean, std; float32, unscaled), the prompt
    and pooled embeddings (in `dtype`) and the dataset indices. No random draws. Cached tensors are used as stored."""
    indices = torch.as_tensor(batch_field(batch, "indices", "index"), dtype=torch.long)
    if "latent_mean" in batch:
        mean, std = batch["latent_mean"].to(built.device).float(), batch["latent_std"].to(built.device).float()
    else:
        pixels = batch_field(batch, "pixel_values").to(built.device, built.vae.dtype)
        with torch.no_grad():
            posterior = built.vae.encode(pixels).latent_dist
        mean, std = posterior.mean.float(), posterior.std.float()
    if built.kind == "flux" and (mean.shape[-1] % 2 or mean.shape[-2] % 2):
        factor = 2 ** (len(built.vae.config.block_out_channels) - 1)
        raise ValueError(f"Flux packs 2x2 latents, so image sides must be multiples of {2 * factor} px; got "
                         f"{mean.shape[-1] * factor}x{mean.shape[-2] * factor}. Change data.resolution (or buckets).")
    if "encoder_hidden_states" in batch:
        embeds, pooled = batch["encoder_hidden_states"].to(built.device), batch["pooled_projections"].to(built.device)
        _check_cached_sequence(built, embeds.shape[1])
    else:
        embeds, pooled = encode_captions(built, list(batch_field(batch, "captions", "caption")))
    return {"latent_mean": mean, "latent_std": std, "encoder_hidden_states": embeds.to(dtype),
            "pooled_projections": pooled.to(dtype), "indices": indices}


def _predict(built: FlowBuilt, forward: Callable, noisy, timesteps, encoded: dict, dtype) -> torch.Tensor:
    embeds = encoded["encoder_hidden_states"].to(dtype)
    pooled = encoded["pooled_projections"].to(dtype)
    if built.kind == "sd3":
        return forward(hidden_states=noisy.to(dtype), timestep=timesteps, encoder_hidden_states=embeds,
                       pooled_projections=pooled, return_dict=False)[0]
    batch, _, height, width = noisy.shape
    guidance = None
    if built.guidance_embeds:
        guidance = torch.full((batch,), float(built.settings.guidance), device=noisy.device, dtype=dtype)
    prediction = forward(hidden_states=pack_latents(noisy).to(dtype), timestep=(timesteps / 1000).to(dtype),
                         guidance=guidance, pooled_projections=pooled, encoder_hidden_states=embeds,
                         txt_ids=torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=dtype),
                         img_ids=image_ids(height, width, dtype, noisy.device), return_dict=False)[0]
    return unpack_latents(prediction, height, width)


def loss(built: FlowBuilt, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """The flow-matching loss of one micro batch (mean over its samples); `seed` is train.seed, `step` the
    optimizer step: with the samples' dataset indices they fix every random draw."""
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    indices, shape, device = encoded["indices"].tolist(), tuple(mean.shape[1:]), mean.device
    draw = lambda purpose: per_sample_randn(shape, seed, step, indices, purpose).to(device)  # noqa: E731
    vae_config = built.vae.config
    latents = mean + std * draw("vae_posterior")
    latents = (latents - (getattr(vae_config, "shift_factor", None) or 0.0)) * vae_config.scaling_factor
    noise = draw("noise")
    positions = (timestep_density(built.settings, seed, step, indices) * len(built.train_sigmas)).long()
    positions = positions.clamp(0, len(built.train_sigmas) - 1)  # u == 1.0 (a float32 sigmoid can round up)
    timesteps = built.train_timesteps[positions].to(device)
    sigmas = built.train_sigmas[positions].to(device).view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    param_dtype = next(built.trainable.parameters()).dtype
    prediction = _predict(built, trainable_forward, noisy, timesteps, encoded, param_dtype)
    weights = loss_weights(built.settings.loss_weighting, sigmas)
    return flow_loss_per_sample(prediction, noisy, latents, noise, sigmas, weights,
                                built.settings.precondition_outputs).mean()


# ------------------------------------------------------------------------------------------------- sampling


def sample(built: FlowBuilt, transformer_module: torch.nn.Module, prompts: list[str], sample_spec: SampleSpec,
           resolution: int) -> list:
    """One image per prompt with the folder's own pipeline class around `transformer_module` (no weight copy).
    Prompt i starts from the noise of (sample_spec.seed, i), so grids of different steps are comparable. Flux-class:
    sample_spec.guidance feeds the guidance embedding (no classifier-free guidance pass), as FluxPipeline does."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if not prompts:
        return []
    factor = 2 ** (len(built.vae.config.block_out_channels) - 1) * 2  # the pipelines need sides of this multiple
    side = max(factor, resolution // factor * factor)
    pipeline = _pipeline(built, transformer_module, built.vae,
                         FlowMatchEulerDiscreteScheduler.from_config(built.scheduler.config))
    generators = [sample_generator(sample_spec.seed, 0, number, "sample") for number in range(len(prompts))]
    was_training = transformer_module.training
    transformer_module.eval()
    try:
        with inputs_cast_to(transformer_module, next(transformer_module.parameters()).dtype), quiet_hf_libraries():
            result = pipeline(prompt=list(prompts), height=side, width=side, guidance_scale=sample_spec.guidance,
                              num_inference_steps=sample_spec.steps, generator=generators, output_type="pil",
                              max_sequence_length=built.max_sequence_length)
    finally:
        transformer_module.train(was_training)
    return result.images


# --------------------------------------------------------------------------------------------------- export


def _fresh_transformer(built: FlowBuilt, state_dict: dict):
    with quiet_hf_libraries():
        import diffusers

    transformer = getattr(diffusers, _KINDS[built.kind][0]).from_config(built.transformer_config)
    expected, given = set(transformer.state_dict()), set(state_dict)
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise FamilyError(f"the trained weights do not fit the transformer of {built.folder}: {len(missing)} missing "
                          f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")
    transformer.load_state_dict(state_dict, strict=True)
    return transformer


def export(built: FlowBuilt, transformer_state_dict: dict, out_dir, pretrained_folder=None) -> Path:
    """Write a complete diffusers pipeline folder at `out_dir`: the trained transformer (safetensors, loaded strictly
    into a fresh one built from the source config) plus the source pipeline's other components copied unchanged.
    Written beside `out_dir` and renamed into place (an older export is replaced only once this one is complete)."""
    source = Path(pretrained_folder) if pretrained_folder is not None else built.folder
    return export_pipeline_folder(source, out_dir, "transformer", _fresh_transformer(built, transformer_state_dict))


def save_lora_weights(built: FlowBuilt, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
    """The transformer's LoRA as StableDiffusion3Pipeline / FluxPipeline write it (dstune.families.lora builds the layers)."""
    with quiet_hf_libraries():
        import diffusers

        getattr(diffusers, _KINDS[built.kind][1]).save_lora_weights(
            folder, transformer_lora_layers=lora_layers, transformer_lora_adapter_metadata=adapter_metadata,
            safe_serialization=True)


FAMILY = Family(
    name="flow", modality="image", pretrained_fields=("pretrained",), build=build, encode_batch=encode_batch,
    loss=loss, sample=sample, save_samples=save_grid, export=export, save_lora_weights=save_lora_weights,
    text_cache=TextCache(TEXT_CACHE_FOLDERS, TEXT_CACHE_TENSORS, cache_text_tensors, text_cache_settings),
    builds_partitioned=True)
