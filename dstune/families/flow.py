"""The `flow` family: flow-matching transformers (the `transformer` subfolder, FlowMatchEulerDiscreteScheduler).

One core for every model; what differs per model is a recipe (dstune.families.flow_recipe), found by the
transformer's class in the folder (RECIPES: flow_sd3.py, flow_qwen.py, flow_zimage.py, flow_flux2.py; FLUX.2
[klein] and [dev] share a transformer class and are told apart by the pipeline class). The text side is encoded by the
pipeline's own `encode_prompt`, so training sees exactly what inference feeds. The loss is the one of diffusers'
examples/dreambooth/train_dreambooth_sd3.py / train_dreambooth_flux.py: sample u with
compute_density_for_timestep_sampling (uniform, logit_normal, mode), index the scheduler's timestep and sigma
tables with it, x_t = (1 - sigma) x0 + sigma noise, target noise - x0 (or x0, model.precondition_outputs),
weighting none / sigma_sqrt / cosmap (tests/unit/test_flow_loss_parity.py). As in the sd family, every draw of a
sample (VAE posterior, noise, u) comes from its own generator seeded by (train.seed, optimizer step, dataset index,
purpose), so results do not depend on the rank count.

    build(model: FlowModel, folders, device, dtype_for_frozen) -> FlowBuilt
    encode_batch(built, batch, dtype) -> {"latent_mean", "latent_std", "encoder_hidden_states",
                                          "pooled_projections", "indices"}
    loss(built, trainable_forward, encoded, seed, step) -> scalar tensor (mean over the micro batch)
    sample(built, transformer_module, prompts, sample_spec, resolution) -> list[PIL.Image]
    export(built, transformer_state_dict, out_dir, pretrained_folder=None) -> Path
    cache hooks: TEXT_CACHE_FOLDERS, TEXT_CACHE_TENSORS, cache_text_tensors (see dstune.families.base)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from dstune.families.base import Family, FamilyError, TextCache
from dstune.families.randomness import per_sample_randn, sample_generator
from dstune.families.diffusion import (batch_field, export_pipeline_folder, inputs_cast_to, load_component,
                                       load_trainable, non_reentrant_checkpoint, read_model_index, vae_posterior)
from dstune.families.flow_matching import (flow_loss_per_sample, image_ids, loss_weights, pack_latents,
                                           timestep_density, unpack_latents)
from dstune.families.flow_flux2 import FLUX2_DEV, FLUX2_KLEIN
from dstune.families.flow_qwen import QWEN_IMAGE
from dstune.families.flow_qwen_edit import QWEN_IMAGE_EDIT
from dstune.families.flow_recipe import (FlowRecipe, load_text_side, pick_recipe, normalised_latents, read_config,
                                         vae_spatial_factor)
from dstune.families.flow_sd3 import FLUX, SD3
from dstune.families.flow_zimage import ZIMAGE
from dstune.families.samples import read_control_images, save_grid
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import FlowModel, SampleSpec

__all__ = ["FlowBuilt", "build", "encode_batch", "loss", "sample", "export", "FAMILY", "detect_kind",
           "cache_text_tensors", "TEXT_CACHE_FOLDERS", "TEXT_CACHE_TENSORS", "timestep_density", "loss_weights",
           "pack_latents", "unpack_latents", "image_ids", "save_lora_weights"]

# kind -> recipe, one line per model (dstune.families.flow_recipe); detect_kind finds a folder's by its transformer
# (and, where recipes share one, by the pipeline class, or the text encoder class where that tells them apart)
RECIPES = {recipe.kind: recipe for recipe in (SD3, FLUX, QWEN_IMAGE, QWEN_IMAGE_EDIT, ZIMAGE, FLUX2_KLEIN, FLUX2_DEV)}

# Cache hooks (dstune.families.base): every folder that decides a caption's embeddings (a folder a kind lacks,
# Flux's text_encoder_3, adds nothing to the fingerprint), and the tensors stored per caption.
TEXT_CACHE_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
TEXT_CACHE_TENSORS = ("encoder_hidden_states", "pooled_projections")  # SD3 / Flux; each recipe states its own


@dataclass
class FlowBuilt:
    """The loaded model. `trainable` is the transformer (the only part DeepSpeed wraps); the VAE and the text
    encoders are frozen companions on `device`."""

    folder: Path
    device: torch.device
    recipe: FlowRecipe
    trainable: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: dict  # component name -> frozen text encoder, as the pipeline names them
    tokenizers: dict  # component name -> tokenizer (and a recipe's other non-module parts: an edit processor)
    scheduler: object  # the folder's FlowMatchEulerDiscreteScheduler, as inference uses it
    train_timesteps: torch.Tensor  # the tables u indexes (with model.shift applied when given)
    train_sigmas: torch.Tensor
    settings: FlowModel
    max_sequence_length: int
    transformer_config: dict

    @property
    def kind(self) -> str:
        return self.recipe.kind

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"vae": self.vae, **self.text_encoders}


# ---------------------------------------------------------------------------------------------------- build


def detect_kind(folder: Path) -> str:
    """The recipe's kind ('sd3', 'flux', ...) from model_index.json and transformer/config.json; FamilyError naming
    what is unsupported or missing."""
    index = read_model_index(folder)
    supported = ", ".join(f"{r.transformer_class} ({r.pipeline_class})" for r in RECIPES.values())
    if not (folder / "transformer").is_dir():
        hint = " (a UNet pipeline: use model.family sd)" if "unet" in index else ""
        raise FamilyError(f"{folder} has no transformer/ subfolder{hint}; model.family 'flow' trains {supported}.")
    transformer_class = read_config(folder, "transformer").get("_class_name")
    recipes = [recipe for recipe in RECIPES.values() if recipe.transformer_class == transformer_class]
    if not recipes:
        raise FamilyError(f"{folder / 'transformer'}: {transformer_class} is not supported by model.family 'flow'; "
                          f"supported transformers: {supported}.")
    recipe = pick_recipe(folder, index, recipes)
    problems = []
    for name, expected in recipe.components.items():
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
        raise FamilyError(f"{folder} cannot be used as a {transformer_class} pipeline ({recipe.pipeline_class}):\n"
                          + "\n".join(f"  - {p}" for p in problems))
    return recipe.kind


def _train_tables(scheduler, shift) -> tuple[torch.Tensor, torch.Tensor]:
    """The timestep and sigma tables u indexes, as the scripts take them from a fresh scheduler: shifted by the
    config's shift, except with dynamic shifting (Flux), where the scripts train on unshifted sigmas. model.shift
    replaces either with a fixed shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if shift is not None:
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config, shift=shift,
                                                                use_dynamic_shifting=False)
    return scheduler.timesteps.clone().float(), scheduler.sigmas.clone().float()


def build(model: FlowModel, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32,
          zero3_config: Optional[dict] = None) -> FlowBuilt:
    """Load `model.pretrained`: the transformer fp32 on `device` (DeepSpeed casts it for bf16; partitioned with
    `zero3_config`, dstune.families.diffusion.load_trainable), the frozen parts
    in `dtype_for_frozen`. Never downloads; FamilyError for any folder that is not an SD3- or Flux-class pipeline."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    folder = folders["pretrained"]
    recipe = RECIPES[detect_kind(folder)]
    problems = recipe.config_mismatches(folder)
    if problems:
        raise FamilyError(f"{folder}: the components do not fit together:\n" + "\n".join(f"  - {p}" for p in problems))
    device = torch.device(device)
    scheduler = load_component(folder, "scheduler", FlowMatchEulerDiscreteScheduler.from_pretrained)
    with quiet_hf_libraries():
        import diffusers

    transformer = load_trainable(folder, "transformer", getattr(diffusers, recipe.transformer_class), device,
                                 zero3_config)
    if model.gradient_checkpointing:
        transformer.enable_gradient_checkpointing(gradient_checkpointing_func=non_reentrant_checkpoint)
    transformer.to(device).train().requires_grad_(True)
    vae = load_component(folder, "vae", getattr(diffusers, recipe.vae_class).from_pretrained,
                         torch_dtype=dtype_for_frozen).to(device)
    vae.eval().requires_grad_(False)
    encoders, tokenizers = load_text_side(folder, recipe, device, dtype_for_frozen)
    extras = recipe.load_extras(folder) if recipe.load_extras else {}
    last = list(tokenizers.values())[-1]  # the long-text tokenizer (T5, an LLM's) is listed last
    longest = getattr(last, "tokenizer", last).model_max_length  # a processor (PixtralProcessor) holds its tokenizer
    max_length = model.max_sequence_length or min(recipe.default_max_sequence_length, longest)
    timesteps, sigmas = _train_tables(scheduler, model.shift)
    return FlowBuilt(folder=folder, device=device, recipe=recipe, trainable=transformer, vae=vae,
                     text_encoders=encoders, tokenizers={**tokenizers, **extras}, scheduler=scheduler,
                     train_timesteps=timesteps,
                     train_sigmas=sigmas, settings=model, max_sequence_length=int(max_length),
                     transformer_config=dict(transformer.config))


def _pipeline(built: FlowBuilt, transformer=None, vae=None, scheduler=None):
    """The diffusers pipeline around the built parts (references, no copies); without transformer and VAE it is
    the text side only, which is all encode_prompt needs."""
    with quiet_hf_libraries():
        import diffusers

        cls = getattr(diffusers, built.recipe.pipeline_class)
        pipeline = cls(transformer=transformer, vae=vae, scheduler=scheduler or built.scheduler,
                       **built.text_encoders, **built.tokenizers)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# --------------------------------------------------------------------------------------------- train step


def encode_captions(built: FlowBuilt, captions: list[str], controls=None) -> dict[str, torch.Tensor]:
    """The recipe's text tensors for `captions` (prompt embeds (B, T, D) and the rest), from the pipeline's own
    encode_prompt; an edit recipe encodes each caption with its control image (`controls`, pixels (B, 3, H, W))."""
    if built.recipe.control:
        return built.recipe.encode_captions(_pipeline(built), built, captions, controls=controls)
    return built.recipe.encode_captions(_pipeline(built), built, captions)


def text_cache_refusal(folder) -> str | None:
    """Why data.cache.text_embeddings cannot be used with the model in `folder` (an edit model), or None."""
    recipe = RECIPES[detect_kind(Path(folder))]
    return recipe.text_cache_refusal(folder) if recipe.text_cache_refusal else None


def _control_inputs(built: FlowBuilt, batch: dict) -> dict:
    """An edit recipe's source images: the pixels (the text side reads them) and the posterior mode of their latents
    (cached, or encoded now), unscaled float32 (B, C, h, w)."""
    if "control_values" not in batch:
        raise ValueError(f"{built.recipe.pipeline_class} trains on pairs: every target image needs its source "
                         "(control) image, but this batch has none. Give data.control_dir (or a `control_file_name` "
                         "per metadata.jsonl line): see docs/family-flow.md, Qwen-Image-Edit.")
    pixels = batch["control_values"].to(built.device)
    if "control_latent_mean" in batch:
        mean = batch["control_latent_mean"].to(built.device).float()
    else:
        mean = vae_posterior(built.vae, pixels.to(built.vae.dtype))[0]
    return {"control_values": pixels.float(), "control_latent": mean}


def cache_text_tensors(built: FlowBuilt, captions: list[str]) -> dict[str, torch.Tensor]:
    return encode_captions(built, captions)


def text_cache_settings(model: FlowModel) -> str:
    """Part of every text entry's key: the same encoders give other tensors at another max_sequence_length."""
    return f"max_sequence_length={model.max_sequence_length}"


def _check_cached_sequence(built: FlowBuilt, tokens: int) -> None:
    """A second guard behind text_cache_settings (which puts max_sequence_length in the key): embeddings of the
    wrong length never reach the transformer, whatever wrote them."""
    expected = built.recipe.text_tokens(built)
    if tokens != expected:
        raise ValueError(f"the cached text embeddings have {tokens} tokens, but model.max_sequence_length "
                         f"{built.max_sequence_length} gives {expected}: they were cached with another "
                         "max_sequence_length. Delete data.cache.dir (or choose another) to re-encode them.")


def encode_batch(built: FlowBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The frozen encoders' view of a collated batch: the VAE posterior (mean, std; float32, unscaled), the recipe's
    text tensors (floating ones in `dtype`) and the dataset indices. No random draws. Cached tensors are used as
    stored."""
    recipe = built.recipe
    indices = torch.as_tensor(batch_field(batch, "indices", "index"), dtype=torch.long)
    if "latent_mean" in batch:
        mean, std = batch["latent_mean"].to(built.device).float(), batch["latent_std"].to(built.device).float()
    else:
        mean, std = vae_posterior(built.vae, batch_field(batch, "pixel_values").to(built.device, built.vae.dtype))
    if mean.shape[-1] % recipe.packed_sides or mean.shape[-2] % recipe.packed_sides:
        factor = vae_spatial_factor(built.vae.config)
        raise ValueError(f"{recipe.transformer_class} packs {recipe.packed_sides}x{recipe.packed_sides} latents, so "
                         f"image sides must be multiples of {recipe.packed_sides * factor} px; got "
                         f"{mean.shape[-1] * factor}x{mean.shape[-2] * factor}. Change data.resolution (or buckets).")
    control = _control_inputs(built, batch) if recipe.control else {}
    if not recipe.control and all(name in batch for name in recipe.text_tensors):
        text = {name: batch[name].to(built.device) for name in recipe.text_tensors}
        _check_cached_sequence(built, text["encoder_hidden_states"].shape[1])
    else:
        text = encode_captions(built, list(batch_field(batch, "captions", "caption")), control.get("control_values"))
    text = {name: value.to(dtype) if value.is_floating_point() else value for name, value in text.items()}
    return {"latent_mean": mean, "latent_std": std, **text, **control, "indices": indices}


def loss(built: FlowBuilt, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """The flow-matching loss of one micro batch (mean over its samples); `seed` is train.seed, `step` the
    optimizer step: with the samples' dataset indices they fix every random draw."""
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    indices, device = encoded["indices"].tolist(), mean.device
    draw = lambda shape, purpose: per_sample_randn(shape, seed, step, indices, purpose).to(device)  # noqa: E731
    sample = mean if built.recipe.posterior_mode else mean + std * draw(mean.shape[1:], "vae_posterior")
    recipe = built.recipe
    latents = recipe.model_latents(built, sample) if recipe.model_latents else normalised_latents(built.vae.config,
                                                                                                   sample)
    noise = draw(latents.shape[1:], "noise")
    positions = (timestep_density(built.settings, seed, step, indices) * len(built.train_sigmas)).long()
    positions = positions.clamp(0, len(built.train_sigmas) - 1)  # u == 1.0 (a float32 sigmoid can round up)
    timesteps = built.train_timesteps[positions].to(device)
    sigmas = built.train_sigmas[positions].to(device).view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    param_dtype = next(built.trainable.parameters()).dtype
    text = {name: encoded[name].to(param_dtype) if encoded[name].is_floating_point() else encoded[name]
            for name in built.recipe.text_tensors}
    if recipe.control:  # the source's latents, normalised like the target's (no noise: it is the condition)
        text["control_latents"] = normalised_latents(built.vae.config, encoded["control_latent"]).to(param_dtype)
    prediction = built.recipe.predict(built, trainable_forward, noisy, timesteps, text, param_dtype)
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
    factor = vae_spatial_factor(built.vae.config) * 2  # the pipelines need sides of this multiple
    side = max(factor, resolution // factor * factor)
    pipeline = _pipeline(built, transformer_module, built.vae,
                         FlowMatchEulerDiscreteScheduler.from_config(built.scheduler.config))
    generators = [sample_generator(sample_spec.seed, 0, number, "sample") for number in range(len(prompts))]
    was_training = transformer_module.training
    transformer_module.eval()
    try:
        with inputs_cast_to(transformer_module, next(transformer_module.parameters()).dtype), quiet_hf_libraries():
            guidance = (built.recipe.sample_options(built, sample_spec, prompts) if built.recipe.sample_options
                        else {"guidance_scale": sample_spec.guidance})
            common = dict(height=side, width=side, **guidance, num_inference_steps=sample_spec.steps,
                          output_type="pil", max_sequence_length=built.max_sequence_length)
            if built.recipe.control:  # the edit pipeline takes one source image per call
                return [pipeline(prompt=prompt, image=source, generator=generator, **common).images[0]
                        for prompt, source, generator in zip(prompts, _sources(sample_spec), generators)]
            result = pipeline(prompt=list(prompts), generator=generators, **common)
    finally:
        transformer_module.train(was_training)
    return result.images


def _sources(sample_spec: SampleSpec) -> list:
    """sample.control_images as RGB images; FamilyError naming the one that cannot be read."""
    if not sample_spec.control_images:
        raise FamilyError("sample.prompts: an edit model renders from a source image; give sample.control_images, one "
                          "source image per prompt (or set sample.prompts: []).")
    try:
        return read_control_images(sample_spec.control_images)
    except ValueError as err:
        raise FamilyError(str(err)) from None


# --------------------------------------------------------------------------------------------------- export


def _fresh_transformer(built: FlowBuilt, state_dict: dict):
    with quiet_hf_libraries():
        import diffusers

    transformer = getattr(diffusers, built.recipe.transformer_class).from_config(built.transformer_config)
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
    """The transformer's LoRA as the recipe's pipeline class writes it (dstune.families.lora builds the layers)."""
    with quiet_hf_libraries():
        import diffusers

        getattr(diffusers, built.recipe.pipeline_class).save_lora_weights(
            folder, transformer_lora_layers=lora_layers, transformer_lora_adapter_metadata=adapter_metadata,
            safe_serialization=True)


FAMILY = Family(
    name="flow", modality="image", pretrained_fields=("pretrained",), build=build, encode_batch=encode_batch,
    loss=loss, sample=sample, save_samples=save_grid, export=export, save_lora_weights=save_lora_weights,
    text_cache=TextCache(TEXT_CACHE_FOLDERS, TEXT_CACHE_TENSORS, cache_text_tensors, text_cache_settings,
                         tensors_of=lambda folder: RECIPES[detect_kind(Path(folder))].text_tensors,
                         refusal=text_cache_refusal),
    builds_partitioned=True)
