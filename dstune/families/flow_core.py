"""The flow-matching core that model.family flow (images) and the video family both run: one build,
encode_batch, loss, sample, export and LoRA file for every recipe (dstune.families.flow_recipe).

Latents are (B, C, H, W) for images and (B, C, F, H, W) for clips: frames are a dimension of the latents, and
every step below works on either. The loss is the one of diffusers' flow-matching training examples: sample u with
compute_density_for_timestep_sampling (uniform, logit_normal, mode), index the timestep and sigma tables with it
(one expert's range of them with two experts), x_t = (1 - sigma) x0 + sigma noise (what the scheduler's
scale_noise computes), target noise - x0 (or x0, model.precondition_outputs), weighting none / sigma_sqrt / cosmap.
Every draw of a sample (VAE posterior, noise, u) comes from its own generator seeded by (train.seed, optimizer step,
dataset index, purpose), so results do not depend on the rank count.

    build_from(recipe, model, folders, device, dtype_for_frozen, zero3_config) -> FlowBuilt
    encode_batch(built, batch, dtype) -> {"latent_mean", "latent_std", text tensors, conditions, "indices"} (and a
        recipe with a sound stream: "sound_latent", "has_sound"; dstune.families.flow_sound)
    loss(built, trainable_forward, encoded, seed, step) -> scalar tensor (mean over the micro batch)
    sample(...)                                 in dstune.families.flow_sampling
    export(built, transformer_state_dict, out_dir, pretrained_folder=None) -> Path
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from dstune.families.base import FamilyError
from dstune.families.denoiser_facts import TEXT_PARTS
from dstune.families.randomness import per_sample_randn
from dstune.families.diffusion import (
    batch_field,
    export_pipeline_folder,
    load_component,
    load_trainable,
    non_reentrant_checkpoint,
    vae_posterior,
)
from dstune.families.folders import read_model_index
from dstune.families.flow_distilled import fuse_training_adapter
from dstune.families.flow_matching import flow_loss_per_sample, loss_weights, timestep_density
from dstune.families.flow_recipe import (
    FlowRecipe,
    load_text_side,
    load_tokenizers,
    normalised_latents,
)
from dstune.families.flow_sound import encoded_sound, loss_per_kind
from dstune.hf import quiet_hf_libraries


@dataclass
class FlowBuilt:
    """The loaded model. `trainable` is the transformer (the only part DeepSpeed wraps); the VAE, the text encoders
    and the conditioning's modules are frozen companions on `device`."""

    folder: Path
    device: torch.device
    recipe: FlowRecipe
    trainable: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: dict  # component name -> frozen text encoder, as the pipeline names them
    tokenizers: dict  # component name -> tokenizer
    scheduler: object  # the folder's scheduler, as inference uses it
    train_timesteps: torch.Tensor  # the tables u indexes (with model.shift applied when given)
    train_sigmas: torch.Tensor
    settings: object  # the model spec (FlowModel, VideoModelSpec)
    max_sequence_length: int
    transformer_config: dict
    model_index: dict = field(default_factory=dict)  # the folder's model_index.json
    positions: tuple[int, int] = (0, 0)  # (first table position, how many) the run trains on
    trained_name: str = "transformer"  # the pipeline component trained (an expert: transformer_2)
    frozen_dtype: torch.dtype = torch.float32
    other_expert: Optional[torch.nn.Module] = None  # two experts: the untrained one, only while samples render
    parts: dict = field(default_factory=dict)  # the conditioning's pipeline parts (a processor, an image encoder)
    mode: object = None  # the recipe's mode of this run (video: its layout, image-to-video or not)
    sampling: object = None  # flow_distilled.SamplingDenoiser: samples use another transformer (None: the trained)
    # the ranks each sample's tokens are split over (deepspeed.sequence_parallel_size; set by split_plan): a stream
    # the split keeps whole on every rank (the sound) has its loss's gradient divided by it (flow_sound)
    sequence_split: int = 1
    # text encoders loaded on one rank per node and dropped after the text cache (text_encoders then maps each name
    # to None): sample prompt (and "", the negative) -> its cached text tensors, which samples render from
    prompt_text: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.recipe.kind

    @property
    def sound_rate(self) -> Optional[int]:
        """The sample rate (Hz) the dataset reads each clip's sound at; None: the recipe trains on no sound."""
        return self.recipe.sound.rate(self) if self.recipe.sound else None

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        modules = {name: part for name, part in self.parts.items() if isinstance(part, torch.nn.Module)}
        text = {name: encoder for name, encoder in self.text_encoders.items() if encoder is not None}
        return {"vae": self.vae, **text, **modules}


# ---------------------------------------------------------------------------------------------------- build


def folder_train_tables(scheduler, shift) -> tuple[torch.Tensor, torch.Tensor]:
    """The timestep and sigma tables u indexes, as the scripts take them from a fresh scheduler: shifted by the
    config's shift, except with dynamic shifting, where the scripts train on unshifted sigmas. model.shift
    replaces either with a fixed shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if shift is not None:
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            scheduler.config, shift=shift, use_dynamic_shifting=False
        )
    return scheduler.timesteps.clone().float(), scheduler.sigmas.clone().float()


def build_from(
    recipe: FlowRecipe,
    model,
    folders: dict,
    device,
    dtype_for_frozen: torch.dtype = torch.float32,
    zero3_config: Optional[dict] = None,
    text_encoders: bool = True,
) -> FlowBuilt:
    """Load the recipe's parts of `folders["pretrained"]` (already checked by the family): the trained transformer
    fp32 in host memory (the start-up casts it and moves it to `device`; partitioned with `zero3_config`), the frozen parts in
    `dtype_for_frozen`. Without `text_encoders` (a rank that reads only cached text: dstune.startup) the text
    encoders are not loaded, only named (None). Never downloads."""
    with quiet_hf_libraries():
        import diffusers

    folder, device = folders["pretrained"], torch.device(device)
    index = read_model_index(folder)
    scheduler_class = getattr(diffusers, recipe.scheduler_class or index["scheduler"][1])
    scheduler = load_component(folder, "scheduler", scheduler_class.from_pretrained)
    trained_name = recipe.experts.trained(model) if recipe.experts else "transformer"
    transformer = load_trainable(folder, trained_name, getattr(diffusers, recipe.transformer_class), zero3_config)
    if getattr(model, "training_adapter", None):  # fused into the frozen base, before any adapter of the run
        fuse_training_adapter(transformer, model.training_adapter)
    if model.gradient_checkpointing:
        transformer.enable_gradient_checkpointing(gradient_checkpointing_func=non_reentrant_checkpoint)
    transformer.train().requires_grad_(True)
    vae = load_component(
        folder, "vae", getattr(diffusers, recipe.latents.vae_class).from_pretrained, torch_dtype=dtype_for_frozen
    ).to(device)
    vae.eval().requires_grad_(False)
    encoders, tokenizers = _text_side(recipe, folder, index, device, dtype_for_frozen, text_encoders)
    parts, mode = {}, None
    if recipe.conditioning and recipe.conditioning.load:
        parts, mode = recipe.conditioning.load(folder, model, transformer.config, device, dtype_for_frozen)
    last = list(tokenizers.values())[-1]  # the long-text tokenizer (T5, an LLM's) is listed last
    longest = getattr(last, "tokenizer", last).model_max_length  # a processor (PixtralProcessor) holds its tokenizer
    max_length = model.max_sequence_length or min(recipe.text.default_max_sequence_length, longest)
    timesteps, sigmas = (recipe.train_tables or folder_train_tables)(scheduler, model.shift)
    positions = (
        recipe.experts.positions(timesteps, model, index, scheduler.config) if recipe.experts else (0, len(sigmas))
    )
    return FlowBuilt(
        folder=folder,
        device=device,
        recipe=recipe,
        trainable=transformer,
        vae=vae,
        text_encoders=encoders,
        tokenizers=tokenizers,
        scheduler=scheduler,
        train_timesteps=timesteps,
        train_sigmas=sigmas,
        settings=model,
        max_sequence_length=int(max_length),
        transformer_config=dict(transformer.config),
        model_index=index,
        positions=positions,
        trained_name=trained_name,
        frozen_dtype=dtype_for_frozen,
        parts=parts,
        mode=mode,
    )


def _text_side(recipe: FlowRecipe, folder: Path, index: dict, device, dtype, text_encoders: bool) -> tuple[dict, dict]:
    """(text encoders, tokenizers) as the recipe loads them; without `text_encoders` the tokenizers only, and the
    encoders named for the pipeline's constructor, which takes None for a part."""
    if text_encoders:
        return (recipe.text.load or load_text_side)(folder, recipe, device, dtype)
    encoders = {name: None for name in TEXT_PARTS if (index.get(name) or [None])[0]}
    return encoders, (recipe.text.load_tokenizers or load_tokenizers)(folder, recipe)


def pipeline_of(built: FlowBuilt, transformer=None, vae=None, scheduler=None):
    """The diffusers pipeline around the built parts (references, no copies); without transformer and VAE it is
    the text side only, which is all encode_prompt needs."""
    sampling = built.recipe.sampling
    with quiet_hf_libraries():
        import diffusers

        if sampling.pipeline:  # its extra arguments may put the transformer in another slot (an expert's)
            cls, extra = sampling.pipeline(built, transformer)
        else:
            cls, extra = getattr(diffusers, built.recipe.pipeline_class), built.parts
        components = {
            "transformer": transformer,
            "vae": vae,
            "scheduler": scheduler or built.scheduler,
            **built.text_encoders,
            **built.tokenizers,
            **extra,
        }
        pipeline = cls(**components)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# --------------------------------------------------------------------------------------------- train step


def encode_captions(built: FlowBuilt, captions: list[str], **text_inputs) -> dict[str, torch.Tensor]:
    """The recipe's text tensors for `captions` (prompt embeds (B, T, D) and the rest), from the pipeline's own
    encode_prompt; `text_inputs` are what the conditioning adds (an edit model's source images)."""
    return built.recipe.text.encode(pipeline_of(built), built, list(captions), **text_inputs)


def cache_text_tensors(built: FlowBuilt, captions: list[str]) -> dict[str, torch.Tensor]:
    return encode_captions(built, captions)


def text_cache_settings(model) -> str:
    """Part of every text entry's key: the same encoders give other tensors at another max_sequence_length."""
    return f"max_sequence_length={model.max_sequence_length}"


def _check_cached_sequence(built: FlowBuilt, tokens: int) -> None:
    """A second guard behind text_cache_settings (which puts max_sequence_length in the key): embeddings of the
    wrong length never reach the transformer, whatever wrote them."""
    expected = built.recipe.text.tokens(built)
    if tokens != expected:
        raise ValueError(
            f"the cached text embeddings have {tokens} tokens, but model.max_sequence_length "
            f"{built.max_sequence_length} gives {expected}: they were cached with another "
            "max_sequence_length. Delete data.cache.dir (or choose another) to re-encode them."
        )


def _check_latent_layout(built: FlowBuilt, mean: torch.Tensor) -> None:
    """Clips for a video model, images for an image one, and latent sides the transformer's patch divides."""
    space = built.recipe.latents
    if space.frames and mean.ndim != 5:
        raise ValueError(
            f"model.family {built.settings.family} trains on clips (B, 3, frames, H, W); "
            f"the batch's latents are {tuple(mean.shape)}"
        )
    rows, columns = space.patch(built)
    if mean.shape[-1] % columns or mean.shape[-2] % rows:
        factor = space.spatial_factor(built.vae.config)
        what = "clip" if space.frames else "image"
        raise ValueError(
            f"{built.recipe.transformer_class} takes {rows}x{columns} latent patches, so {what} heights "
            f"must be multiples of {rows * factor} px and widths of {columns * factor} px; got "
            f"{mean.shape[-1] * factor}x{mean.shape[-2] * factor} (width x height). Change "
            "data.resolution (or buckets)."
        )


def encode_batch(built: FlowBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The frozen encoders' view of a collated batch: the VAE posterior (mean, std; float32, unscaled), the recipe's
    text tensors (floating ones in `dtype`), the conditioning's tensors and the dataset indices. No random draws.
    Cached tensors are used as stored."""
    recipe = built.recipe
    indices = torch.as_tensor(batch_field(batch, "indices", "index"), dtype=torch.long)
    if "latent_mean" in batch:
        mean, std = batch["latent_mean"].to(built.device).float(), batch["latent_std"].to(built.device).float()
    else:
        mean, std = vae_posterior(built.vae, batch_field(batch, "pixel_values").to(built.device, built.vae.dtype))
    _check_latent_layout(built, mean)
    conditioning = recipe.conditioning
    conditions = conditioning.encode(built, batch, dtype) if conditioning and conditioning.encode else {}
    text_inputs = conditioning.text_inputs(conditions) if conditioning and conditioning.text_inputs else None
    if text_inputs is None and all(name in batch for name in recipe.text.tensors):
        text = {name: batch[name].to(built.device) for name in recipe.text.tensors}
        _check_cached_sequence(built, text["encoder_hidden_states"].shape[1])
    else:
        text = encode_captions(built, list(batch_field(batch, "captions", "caption")), **(text_inputs or {}))
    text = {name: value.to(dtype) if value.is_floating_point() else value for name, value in text.items()}
    sound = encoded_sound(built, batch)
    return {"latent_mean": mean, "latent_std": std, **text, **conditions, **sound, "indices": indices}


def noisy_latents(built: FlowBuilt, latents: torch.Tensor, noise: torch.Tensor, positions: torch.Tensor):
    """(timesteps, sigmas shaped to broadcast over the latents, x_t) at table positions: what
    FlowMatchEulerDiscreteScheduler's scale_noise makes of (latents, timestep, noise)."""
    timesteps = built.train_timesteps[positions].to(latents.device)
    sigmas = built.train_sigmas[positions].to(latents.device).view(-1, *(1,) * (latents.ndim - 1))
    return timesteps, sigmas, (1.0 - sigmas) * latents + sigmas * noise


def posterior_mean(built: FlowBuilt) -> bool:
    """Whether the training latents are the VAE posterior's mean (model.vae_latents: mean) rather than a draw from
    it; unset, the model's reference trainer's choice (its recipe's posterior_mode)."""
    choice = built.settings.vae_latents
    return built.recipe.latents.posterior_mode if choice is None else choice == "mean"


def loss(built: FlowBuilt, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """The flow-matching loss of one micro batch (mean over its samples); `seed` is train.seed, `step` the
    optimizer step: with the samples' dataset indices they fix every random draw. Latent frames the conditioning
    gives clean (a first frame) are not in it."""
    recipe = built.recipe
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    indices, device = encoded["indices"].tolist(), mean.device
    draw = lambda shape, purpose: per_sample_randn(shape, seed, step, indices, purpose).to(device)  # noqa: E731
    sample = mean if posterior_mean(built) else mean + std * draw(mean.shape[1:], "vae_posterior")
    to_model = recipe.latents.to_model
    latents = to_model(built, sample) if to_model else normalised_latents(built.vae.config, sample)
    noise = draw(latents.shape[1:], "noise")
    if recipe.draw_sigmas:  # a model whose example draws sigma itself, off the tables
        sigma = recipe.draw_sigmas(built, latents, seed, step, indices).to(device)
        timesteps, sigmas = sigma * 1000, sigma.view(-1, *(1,) * (latents.ndim - 1))
        noisy = (1.0 - sigmas) * latents + sigmas * noise
    else:
        first, count = built.positions  # one expert's range of the tables (all of them otherwise)
        positions = (timestep_density(built.settings, seed, step, indices) * count).long()
        positions = first + positions.clamp(0, count - 1)  # u == 1.0 (a float32 sigmoid can round up)
        timesteps, sigmas, noisy = noisy_latents(built, latents, noise, positions)
    param_dtype = next(built.trainable.parameters()).dtype
    conditions = {
        name: encoded[name].to(param_dtype) if encoded[name].is_floating_point() else encoded[name]
        for name in recipe.text.tensors
    }
    conditioning = recipe.conditioning
    if conditioning and conditioning.model_inputs:
        conditions.update(conditioning.model_inputs(built, encoded, param_dtype))
    heard = encoded.get("has_sound") if recipe.sound else None
    if heard is None or not heard.any():
        prediction = recipe.predict(built, trainable_forward, noisy, timesteps, conditions, param_dtype)
        return _video_loss(built, prediction, noisy, latents, noise, sigmas).mean()
    tokens = recipe.sound.to_tokens(built, encoded["sound_latent"])
    sound_noise = draw(tokens.shape[1:], "audio_noise")
    video = (noisy, timesteps, latents, noise, sigmas)
    per_sample = loss_per_kind(
        built, trainable_forward, video, conditions, heard, (tokens, sound_noise), param_dtype, _video_loss
    )
    return per_sample.mean()


def _video_loss(built: FlowBuilt, prediction, noisy, latents, noise, sigmas) -> torch.Tensor:
    """Each sample's weighted flow-matching error of the latents (B,); latent frames the conditioning gives clean (a
    first frame) are not in it."""
    recipe = built.recipe
    weights = loss_weights(built.settings.loss_weighting, sigmas)
    clean = recipe.conditioning.clean_frames(built) if recipe.conditioning else 0
    if clean:  # the first latent frames were given clean: only the frames after them are learned
        prediction, noisy, latents, noise = (t[:, :, clean:] for t in (prediction, noisy, latents, noise))
    return flow_loss_per_sample(
        prediction, noisy, latents, noise, sigmas, weights, recipe.preconditioned(built.settings)
    )


# --------------------------------------------------------------------------------------------------- export


def _fresh_transformer(built: FlowBuilt, state_dict: dict):
    with quiet_hf_libraries():
        import diffusers

    transformer = getattr(diffusers, built.recipe.transformer_class).from_config(built.transformer_config)
    expected, given = set(transformer.state_dict()), set(state_dict)
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise FamilyError(
            f"the trained weights do not fit the transformer of {built.folder}: {len(missing)} missing "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    transformer.load_state_dict(state_dict, strict=True)
    return transformer


def export(built: FlowBuilt, transformer_state_dict: dict, out_dir, pretrained_folder=None) -> Path:
    """Write a complete diffusers pipeline folder at `out_dir`: the trained transformer (safetensors, loaded strictly
    into a fresh one built from the source config) in its component (an expert's: transformer_2) plus the source
    pipeline's other components copied unchanged. Written beside `out_dir` and renamed into place (an older export
    is replaced only once this one is complete)."""
    source = Path(pretrained_folder) if pretrained_folder is not None else built.folder
    return export_pipeline_folder(
        source, out_dir, built.trained_name, _fresh_transformer(built, transformer_state_dict)
    )


def split_plan(built: FlowBuilt, size: int) -> Optional[dict]:
    """The context-parallel plan of the recipe's own (its transformer prepared for it), None: the class's plan.
    Called by the start-up that splits built.trainable over `size` ranks, which built then remembers."""
    built.sequence_split = size
    return built.recipe.sequence_split(built.trainable, size) if built.recipe.sequence_split else None


def save_lora_weights(built: FlowBuilt, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
    """The transformer's LoRA as the recipe's pipeline class writes it (dstune.families.lora builds the layers; a
    low-noise expert's LoRA loads with the pipeline's load_into_transformer_2=True)."""
    with quiet_hf_libraries():
        import diffusers

        getattr(diffusers, built.recipe.lora_class or built.recipe.pipeline_class).save_lora_weights(
            folder,
            transformer_lora_layers=lora_layers,
            transformer_lora_adapter_metadata=adapter_metadata,
            safe_serialization=True,
        )
