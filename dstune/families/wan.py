"""The `wan` family: Wan 2.1 / 2.2 video models (WanTransformer3DModel, AutoencoderKLWan, UMT5), by flow matching.

Clips (B, 3, frames, H, W) in [-1, 1] (dstune.data.video) are encoded by the causal 3D VAE into latents
(B, 16, 1 + (frames - 1) / 4, H / 8, W / 8), normalised per channel with the VAE config's latents_mean /
latents_std (as WanPipeline un-normalises them before decoding). Captions go through WanPipeline.encode_prompt: UMT5's
last hidden states of the caption's own tokens, zero-padded to max_sequence_length. The flow-matching pieces are
the flow family's (dstune.families.flow_matching): u per sample (compute_density_for_timestep_sampling), the
timestep and sigma tables of a FlowMatchEulerDiscreteScheduler with the model's shift (UniPC's flow_shift, the
scheduler Wan ships with, or FlowMatchEuler's shift), x_t = (1 - sigma) x0 + sigma noise (what the scheduler's
scale_noise computes), target noise - x0. Every draw comes from sample_generator(seed, step, index, purpose).

Two experts (Wan 2.2 A14B: `transformer` for the timesteps at or above boundary_ratio x 1000, `transformer_2` below):
a run trains one of them (model.expert), drawing its timesteps from its own range of the tables only (narrowed by
model.timestep_range); the other is never trained and is read from the folder only while samples render.

Image-to-video (Wan 2.1 I2V, Wan 2.2 I2V A14B) and Wan 2.2 TI2V (expand_timesteps): what a folder is comes from its
configs (dstune.wan_layouts, model.image_to_video); the first-frame conditioning is dstune.families.wan_i2v's.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from dstune import wan_layouts
from dstune.families import wan_i2v
from dstune.families.base import Family, FamilyError, LatentExtras, TextCache
from dstune.families.randomness import per_sample_randn, sample_generator
from dstune.families.diffusion import (batch_field, export_pipeline_folder, inputs_cast_to, load_component,
                                       load_trainable, non_reentrant_checkpoint, read_component_config,
                                       read_model_index, vae_posterior)
from dstune.families.flow_matching import flow_loss_per_sample, loss_weights, timestep_density
from dstune.families.flow_recipe import normalised_latents
from dstune.families.samples import save_clip_grid
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import SampleSpec, WanModel
from dstune.spec.video_models import expert_problems, expert_range, experts_in

COMPONENTS = {"transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan",
              "text_encoder": "UMT5EncoderModel", "tokenizer": None, "scheduler": None}
TEXT_CACHE_FOLDERS = ("text_encoder", "tokenizer")
TEXT_TENSORS = ("encoder_hidden_states",)
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default


@dataclass
class WanBuilt:
    folder: Path
    device: torch.device
    trainable: torch.nn.Module  # the transformer: the only part DeepSpeed wraps
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: object
    scheduler: object  # the folder's scheduler, as inference uses it
    train_timesteps: torch.Tensor
    train_sigmas: torch.Tensor
    settings: WanModel
    max_sequence_length: int
    transformer_config: dict
    trained_name: str = "transformer"  # the pipeline component trained: transformer, or transformer_2 (low noise)
    # two experts: the untrained one, loaded only while samples render (a 14 B expert is 28 GB in bf16, on every rank)
    other_expert: Optional[torch.nn.Module] = None
    frozen_dtype: torch.dtype = torch.float32
    boundary_ratio: Optional[float] = None
    positions: tuple[int, int] = (0, 0)  # (first table position, how many) this expert trains on; (0, 0): all
    kind: str = "t2v"  # the folder's layout (dstune.wan_layouts): t2v, i2v or ti2v
    image_to_video: bool = False  # this run denoises from first frames (model.image_to_video, or the folder's)
    image_encoder: Optional[torch.nn.Module] = None  # Wan 2.1 I2V's CLIPVisionModel, frozen
    image_processor: object = None  # its CLIPImageProcessor

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        image = {"image_encoder": self.image_encoder} if self.image_encoder is not None else {}
        return {"vae": self.vae, "text_encoder": self.text_encoder, **image}


# ---------------------------------------------------------------------------------------------------- build


def folder_problems(folder: Path, expert: Optional[str] = None, image_to_video: Optional[bool] = None,
                    timestep_range=None) -> list[str]:
    """Why `folder` is not a Wan pipeline folder dstune trains with model.expert `expert`, model.image_to_video
    `image_to_video` and model.timestep_range (empty: it is)."""
    index = read_model_index(folder)
    problems = expert_problems(index, expert, timestep_range)
    if "transformer_2" in experts_in(index) and not (folder / "transformer_2").is_dir():
        problems.append("model_index.json lists transformer_2 but there is no transformer_2/ subfolder")
    for name, expected in COMPONENTS.items():
        entry = index.get(name)
        listed = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if listed is None or not (folder / name).is_dir():
            problems.append(f"no `{name}` component (model_index.json entry and {name}/ subfolder)")
        elif expected is not None and listed != expected:
            problems.append(f"`{name}` is a {listed}; expected {expected}")
    if not problems:
        vae, text = read_component_config(folder, "vae"), read_component_config(folder, "text_encoder")
        for name in experts_in(index):
            transformer = read_component_config(folder, name)
            kind, found = wan_layouts.layout(index, transformer, vae)
            problems += [f"{name}: {problem}" for problem in found]
            if transformer.get("text_dim") != text.get("d_model"):
                problems.append(f"{name} text_dim {transformer.get('text_dim')} != {text.get('d_model')} (the text "
                                "encoder's d_model)")
            if kind is not None and not found:
                problem = wan_layouts.image_to_video(kind, image_to_video)[1]
                problems += [problem] if problem and problem not in problems else []
    return problems


def folder_mode(folder: Path, image_to_video: Optional[bool]) -> tuple[str, bool]:
    """(layout, whether the run trains image-to-video) of a folder folder_problems accepted."""
    index = read_model_index(folder)
    kind, _ = wan_layouts.layout(index, read_component_config(folder, "transformer"),
                               read_component_config(folder, "vae"))
    return kind, wan_layouts.image_to_video(kind, image_to_video)[0]


def train_tables(scheduler_config, shift: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(timesteps, sigmas, shift) that u indexes: a FlowMatchEulerDiscreteScheduler with `shift`, or the folder
    scheduler's own (UniPC's flow_shift; FlowMatchEuler's shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if shift is None:
        shift = scheduler_config.get("flow_shift") if "flow_shift" in scheduler_config else \
            scheduler_config.get("shift", 1.0)
    table = FlowMatchEulerDiscreteScheduler(num_train_timesteps=scheduler_config.get("num_train_timesteps", 1000),
                                            shift=float(shift))
    return table.timesteps.clone().float(), table.sigmas.clone().float(), float(shift)


def build(model: WanModel, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32,
          zero3_config: Optional[dict] = None) -> WanBuilt:
    """The transformer fp32 on `device` (partitioned with `zero3_config`), the VAE, UMT5 (and Wan 2.1 I2V's image
    encoder) frozen in `dtype_for_frozen`. Never downloads; FamilyError listing every problem of a folder that is
    not a Wan pipeline this spec can train."""
    import transformers
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    folder = folders["pretrained"]
    problems = folder_problems(folder, model.expert, model.image_to_video, model.timestep_range)
    if problems:
        raise FamilyError(f"{folder} cannot be used as a Wan pipeline (model.family wan):\n"
                          + "\n".join(f"  - {p}" for p in problems))
    device, index = torch.device(device), read_model_index(folder)
    kind, image_to_video = folder_mode(folder, model.image_to_video)
    with quiet_hf_libraries():
        import diffusers

        scheduler_class = getattr(diffusers, index["scheduler"][1])
    scheduler = load_component(folder, "scheduler", scheduler_class.from_pretrained)
    trained_name = "transformer_2" if model.expert == "low_noise" else "transformer"
    transformer = load_trainable(folder, trained_name, WanTransformer3DModel, device, zero3_config)
    if model.gradient_checkpointing:
        transformer.enable_gradient_checkpointing(gradient_checkpointing_func=non_reentrant_checkpoint)
    transformer.to(device).train().requires_grad_(True)
    vae = load_component(folder, "vae", AutoencoderKLWan.from_pretrained, torch_dtype=dtype_for_frozen).to(device)
    text_encoder = load_component(folder, "text_encoder", transformers.UMT5EncoderModel.from_pretrained,
                                  torch_dtype=dtype_for_frozen).to(device)
    tokenizer = load_component(folder, "tokenizer", transformers.AutoTokenizer.from_pretrained)
    image_encoder, image_processor = None, None
    if image_to_video and transformer.config.image_dim is not None:  # Wan 2.1 I2V: CLIP's image embedding
        image_encoder, image_processor = wan_i2v.load_image_encoder(folder, dtype_for_frozen, device)
    max_length = model.max_sequence_length or min(DEFAULT_MAX_SEQUENCE_LENGTH, tokenizer.model_max_length)
    timesteps, sigmas, _ = train_tables(dict(scheduler.config), model.shift)
    return WanBuilt(folder=folder, device=device, trainable=transformer, vae=vae.eval().requires_grad_(False),
                    text_encoder=text_encoder.eval().requires_grad_(False), tokenizer=tokenizer,
                    scheduler=scheduler, train_timesteps=timesteps, train_sigmas=sigmas, settings=model,
                    max_sequence_length=int(max_length), transformer_config=dict(transformer.config),
                    trained_name=trained_name, boundary_ratio=index.get("boundary_ratio"),
                    frozen_dtype=dtype_for_frozen,
                    positions=expert_positions(timesteps, model, index, scheduler.config),
                    kind=kind, image_to_video=image_to_video, image_encoder=image_encoder,
                    image_processor=image_processor)


def expert_positions(timesteps: torch.Tensor, model: WanModel, index: dict, scheduler_config) -> tuple[int, int]:
    """(first table position, count) of the timesteps a run trains on: the expert's side of the boundary
    (WanPipeline runs `transformer` at t >= boundary_ratio x num_train_timesteps and `transformer_2` below),
    narrowed by model.timestep_range. The tables descend from 1000, so they are one contiguous run."""
    low, high, inclusive = expert_range(index, model.expert, model.timestep_range,
                                        scheduler_config.num_train_timesteps)
    inside = (timesteps >= low) & ((timesteps <= high) if inclusive else (timesteps < high))
    if not inside.any():
        raise FamilyError(f"no training timestep of the shifted table falls in model.timestep_range "
                          f"{list(model.timestep_range)} (the tables' timesteps: {timesteps.min():.1f} to "
                          f"{timesteps.max():.1f}); widen it")
    first = int(inside.nonzero()[0])
    return first, int(inside.sum())


def _pipeline(built: WanBuilt, transformer=None, vae=None):
    """WanPipeline (WanImageToVideoPipeline for image-to-video samples) around the built parts (references, no
    copies); without transformer and VAE the text side. With two experts the trained one sits in its own slot and
    the other beside it."""
    experts = {"transformer": transformer}
    if transformer is not None and built.other_expert is not None:
        other = "transformer" if built.trained_name == "transformer_2" else "transformer_2"
        experts = {built.trained_name: transformer, other: built.other_expert}
    cls, extra = wan_i2v.pipeline_class(built, transformer)
    with quiet_hf_libraries():
        pipeline = cls(tokenizer=built.tokenizer, text_encoder=built.text_encoder, vae=vae, scheduler=built.scheduler,
                       boundary_ratio=built.boundary_ratio, **experts, **extra)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# --------------------------------------------------------------------------------------------- train step


def encode_captions(built: WanBuilt, captions: list[str]) -> dict[str, torch.Tensor]:
    """{"encoder_hidden_states": (B, max_sequence_length, d_model)} from WanPipeline.encode_prompt."""
    with torch.no_grad(), quiet_hf_libraries():
        embeds, _ = _pipeline(built).encode_prompt(list(captions), do_classifier_free_guidance=False,
                                                   max_sequence_length=built.max_sequence_length,
                                                   device=built.device)
    return {"encoder_hidden_states": embeds}


def wan_i2v_cache_key(model: WanModel, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """What keys the latent entries of an image-to-video run beside the VAE: the mode (the condition stored with
    the posterior) and the image encoder's folders, and the tensors stored; ("", (), ()) for text-to-video (the
    entries are the posterior's)."""
    kind, image = folder_mode(Path(folder), model.image_to_video)
    if not image:
        return "", (), ()
    if read_component_config(folder, "transformer").get("image_dim") is None:
        return f"image_to_video/{kind}", (), (wan_i2v.CONDITION,)
    return f"image_to_video/{kind}", ("image_encoder", "image_processor"), (wan_i2v.CONDITION, wan_i2v.IMAGE_EMBEDS)


def text_cache_settings(model: WanModel) -> str:
    return f"max_sequence_length={model.max_sequence_length}"


def encode_batch(built: WanBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The VAE posterior of the clips (mean, std: float32, (B, z_dim, f, h, w), unnormalised), the caption embeddings
    (in `dtype`), the dataset indices and, for image-to-video, the first frame's condition (dstune.families.wan_i2v);
    cached tensors are used as stored. No random draws."""
    indices = torch.as_tensor(batch_field(batch, "indices", "index"), dtype=torch.long)
    if "latent_mean" in batch:
        mean, std = batch["latent_mean"].to(built.device).float(), batch["latent_std"].to(built.device).float()
    else:
        mean, std = vae_posterior(built.vae, batch_field(batch, "pixel_values").to(built.device, built.vae.dtype))
    if mean.ndim != 5:
        raise ValueError(f"model.family wan trains on clips (B, 3, frames, H, W); the batch's latents are "
                         f"{tuple(mean.shape)}")
    patch = built.transformer_config["patch_size"]
    if mean.shape[-1] % patch[2] or mean.shape[-2] % patch[1]:
        factor = built.vae.config.scale_factor_spatial
        raise ValueError(f"the Wan transformer takes {patch[1]}x{patch[2]} latent patches, so clip sides must be "
                         f"multiples of {factor * patch[1]} px; got {mean.shape[-1] * factor}x{mean.shape[-2] * factor}"
                         ". Change data.resolution.")
    if "encoder_hidden_states" in batch:
        text = batch["encoder_hidden_states"].to(built.device)
        if text.shape[1] != built.max_sequence_length:
            raise ValueError(f"the cached text embeddings have {text.shape[1]} tokens, but max_sequence_length is "
                             f"{built.max_sequence_length}: delete data.cache.dir (or choose another) to re-encode.")
    else:
        text = encode_captions(built, list(batch_field(batch, "captions", "caption")))["encoder_hidden_states"]
    out = {"latent_mean": mean, "latent_std": std, "encoder_hidden_states": text.to(dtype), "indices": indices}
    if built.image_to_video:  # from the cache as stored, else from the clips' first frames
        cached = {name: batch[name].to(built.device) for name in (wan_i2v.CONDITION, wan_i2v.IMAGE_EMBEDS)
                  if name in batch}
        out.update(cached or wan_i2v.condition_tensors(built, batch_field(batch, "pixel_values")))
        problem = wan_i2v.needs_condition(built, out)
        if problem:
            raise ValueError(problem)
        if wan_i2v.IMAGE_EMBEDS in out:
            out[wan_i2v.IMAGE_EMBEDS] = out[wan_i2v.IMAGE_EMBEDS].to(dtype)
    return out


def noisy_and_target(built: WanBuilt, latents: torch.Tensor, noise: torch.Tensor, positions: torch.Tensor):
    """(timesteps, sigmas (B,1,1,1,1), x_t, target) at table positions: what FlowMatchEulerDiscreteScheduler's
    scale_noise makes of (latents, timestep, noise), and the velocity noise - latents the transformer predicts."""
    timesteps = built.train_timesteps[positions].to(latents.device)
    sigmas = built.train_sigmas[positions].to(latents.device).view(-1, 1, 1, 1, 1)
    return timesteps, sigmas, (1.0 - sigmas) * latents + sigmas * noise, noise - latents


def loss(built: WanBuilt, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """The flow-matching loss of one micro batch (mean over its samples): velocity noise - x0 over the clip's
    latents (Wan 2.2 TI2V image-to-video: over the latent frames after the first, which is the clean image)."""
    mean, std = encoded["latent_mean"], encoded["latent_std"]
    indices, device = encoded["indices"].tolist(), mean.device
    draw = lambda shape, purpose: per_sample_randn(shape, seed, step, indices, purpose).to(device)  # noqa: E731
    latents = normalised_latents(built.vae.config, mean + std * draw(mean.shape[1:], "vae_posterior"))
    noise = draw(latents.shape[1:], "noise")
    first, count = built.positions  # one expert's range of the tables (all of them with one expert)
    positions = (timestep_density(built.settings, seed, step, indices) * count).long()
    positions = first + positions.clamp(0, count - 1)  # u == 1.0 (a float32 sigmoid can round up)
    timesteps, sigmas, noisy, _ = noisy_and_target(built, latents, noise, positions)
    dtype = next(built.trainable.parameters()).dtype
    hidden, timestep, extra, first = wan_i2v.transformer_inputs(built, noisy, timesteps, encoded)
    prediction = trainable_forward(hidden_states=hidden.to(dtype), timestep=timestep.to(dtype),
                                   encoder_hidden_states=encoded["encoder_hidden_states"].to(dtype),
                                   return_dict=False, **{k: v.to(dtype) for k, v in extra.items()})[0]
    weights = loss_weights(built.settings.loss_weighting, sigmas)
    # TI2V image-to-video: the first latent frame was given clean, so only the frames after it count
    return flow_loss_per_sample(prediction[:, :, first:], noisy[:, :, first:], latents[:, :, first:],
                                noise[:, :, first:], sigmas, weights, False).mean()


# ------------------------------------------------------------------------------------------------- sampling


def sample(built: WanBuilt, transformer_module: torch.nn.Module, prompts: list[str], sample_spec: SampleSpec,
           resolution: int) -> list:
    """One clip (a list of PIL frames, model.sample_frames long) per prompt, by WanPipeline around
    `transformer_module` (image-to-video: WanImageToVideoPipeline from sample.control_images[i], the clip's first
    frame); prompt i starts from the noise of (sample_spec.seed, i)."""
    if not prompts:
        return []
    images = wan_i2v.sample_images(sample_spec.control_images, prompts) if built.image_to_video else None
    factor = built.vae.config.scale_factor_spatial * built.transformer_config["patch_size"][1]
    side = max(factor, resolution // factor * factor)
    was_training = transformer_module.training
    transformer_module.eval()
    clips = []
    try:
        with other_expert_loaded(built), quiet_hf_libraries(), \
                inputs_cast_to(transformer_module, next(transformer_module.parameters()).dtype):
            pipeline, text_side = _pipeline(built, transformer_module, built.vae), _pipeline(built)
            for number, prompt in enumerate(prompts):  # one generator per prompt (WanPipeline takes one)
                inputs = {"prompt": prompt} if images is None else {"image": images[number], **wan_i2v.prompt_inputs(
                    text_side, prompt, sample_spec.guidance, built.max_sequence_length, built.device)}
                result = pipeline(**inputs, height=side, width=side, num_frames=built.settings.sample_frames,
                                  guidance_scale=sample_spec.guidance, num_inference_steps=sample_spec.steps,
                                  generator=sample_generator(sample_spec.seed, 0, number, "sample"),
                                  output_type="pil", max_sequence_length=built.max_sequence_length)
                clips.append(list(result.frames[0]))
    finally:
        transformer_module.train(was_training)
    return clips


@contextlib.contextmanager
def other_expert_loaded(built: WanBuilt):
    """With two experts, the untrained one read from the folder onto the device for the duration (samples run both,
    each on its side of the boundary), then released: it is never held while training steps run."""
    if built.settings.expert is None:
        yield
        return
    from diffusers import WanTransformer3DModel

    name = "transformer" if built.trained_name == "transformer_2" else "transformer_2"
    built.other_expert = load_component(built.folder, name, WanTransformer3DModel.from_pretrained,
                                        torch_dtype=built.frozen_dtype).eval().requires_grad_(False).to(built.device)
    try:
        yield
    finally:
        built.other_expert = None
        gc.collect()


# --------------------------------------------------------------------------------------------------- export


def export(built: WanBuilt, transformer_state_dict: dict, out_dir, pretrained_folder=None) -> Path:
    """A complete pipeline folder of the source's class (WanPipeline, WanImageToVideoPipeline): the trained
    transformer (loaded strictly into a fresh one from the source config) and the other components copied
    unchanged, written atomically."""
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel.from_config(built.transformer_config)
    expected, given = set(transformer.state_dict()), set(transformer_state_dict)
    if expected != given:
        raise FamilyError(f"the trained weights do not fit the transformer of {built.folder}: missing "
                          f"{sorted(expected - given)[:3]}, unexpected {sorted(given - expected)[:3]}")
    transformer.load_state_dict(transformer_state_dict, strict=True)
    source = Path(pretrained_folder) if pretrained_folder is not None else built.folder
    return export_pipeline_folder(source, out_dir, built.trained_name, transformer)


def save_lora_weights(built: WanBuilt, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
    """pytorch_lora_weights.safetensors as WanPipeline writes it (WanPipeline.load_lora_weights reads it; a
    low-noise expert's with load_into_transformer_2=True)."""
    with quiet_hf_libraries():
        from diffusers import WanPipeline

        WanPipeline.save_lora_weights(folder, transformer_lora_layers=lora_layers,
                                      transformer_lora_adapter_metadata=adapter_metadata, safe_serialization=True)


FAMILY = Family(
    name="wan", modality="video", pretrained_fields=("pretrained",), build=build, encode_batch=encode_batch,
    loss=loss, sample=sample, save_samples=save_clip_grid, export=export, save_lora_weights=save_lora_weights,
    text_cache=TextCache(TEXT_CACHE_FOLDERS, TEXT_TENSORS, encode_captions, text_cache_settings),
    builds_partitioned=True, latent_extras=LatentExtras(wan_i2v_cache_key, wan_i2v.condition_tensors))
