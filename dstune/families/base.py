"""The model-family contract: a `Family` value per family, with the functions the stages call and the capabilities
it declares, plus the per-sample random draws every family uses.

    family = get_family(spec.model.family)                      # dstune.families: the closed registry
    built = family.build(spec.model, folders, device, dtype_for_frozen)
    encoded = family.encode_batch(built, batch, compute_dtype)
    loss = family.loss(built, engine, encoded, train_seed, optimizer_step)
    outputs = family.sample(built, engine.module, prompts, spec.sample, resolution)
    path = family.save_samples(outputs, prompts, path)          # an image grid, or a folder of WAVs
    family.export(built, consolidated_state_dict, out_dir)

build(model_spec, folders, device, dtype_for_frozen) -> Built
    `folders` maps each of the family's `pretrained_fields` (spec keys such as "pretrained", "codec_pretrained") to
    a local folder, or None where the spec leaves the key unset; dstune.pretrained resolves them (built-in models,
    hub cache) before any family code runs. Load every component with `from_pretrained(folder, subfolder=...)`.
    Raises FamilyError (a ValueError) naming the folder and what is wrong. Never downloads anything.
encode_batch(built, batch, dtype) -> dict
    Everything the loss needs from a collated batch, computed by the frozen parts under torch.no_grad.
    Deterministic (no random draws), so the result could be cached.
loss(built, trainable_forward, encoded, seed, step) -> scalar tensor
    The training loss, the mean over the micro batch. `trainable_forward` is the DeepSpeed engine in training (a
    bare module in tests). Every random draw comes from `sample_generator(seed, step, index, purpose)`.
export(built, state_dict, out_dir, pretrained_folder=None)
    Write a complete folder the ecosystem loads (diffusers pipeline, transformers folder) with the trained weights,
    atomically (dstune.fsutil.publish_folder).

A Built holds at least `trainable` (the one nn.Module DeepSpeed wraps: train mode, requires_grad on), `folder`
(the resolved pretrained folder) and `device`; its frozen companions are built outside any zero.Init, are in eval
mode with requires_grad off, and never reach deepspeed.initialize. `frozen` (a property) maps each companion's
attribute name to the module: "vae" for the VAE, "image_encoder" for an image encoder, every other entry a text
encoder (or a codec).

Capabilities are declared, never probed: `modality` ("image", "video" or "audio": which data path and cache kinds
apply; a video family's batches hold clips (B, 3, frames, H, W), dstune.data.video),
`save_lora_weights` (None: the family cannot export a LoRA, so model.train: lora is refused before training), and
`text_cache` (None: no data.cache.text_embeddings), `single_file` (None: model.pretrained cannot be a single
checkpoint file). Latents need no hook: every image family's VAE posterior is
stored as latent_mean / latent_std; `latent_extras` adds tensors made from the same pixels (image-to-video's
condition). `frozen`'s "vae" and "image_encoder" are replaced by data.cache.latents, the others by the text
cache. Batches also carry each sample's `original_size` and `crop_top_left`
(dstune.data.images.crop_fields), from the image loader and from the cache alike (a UNet with size/crop time ids conditions on them).

Randomness. A sample's noise, timestep and the like depend only on (run seed, optimizer step, dataset index,
purpose; dstune.families.randomness): never on the global RNG, the rank, the micro-batch split or the device. So 1 rank x 4 accumulation
steps and 2 ranks x 2 draw the same noise for the same sample at the same step, and CPU and GPU runs agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional


class FamilyError(ValueError):
    """A model that cannot be used: the message names the folder or model, what is wrong and how to fix it."""


@dataclass(frozen=True)
class TextCache:
    """A family's text-embedding cache (data.cache.text_embeddings; dstune.cache.latents builds it)."""

    folders: tuple[str, ...]  # pipeline subfolders that decide a caption's embedding; their fingerprint keys entries
    tensors: tuple[str, ...]  # tensor names stored per caption: the batch keys encode_batch reads when present
    encode: Callable  # (built, captions) -> {name: Tensor[len(captions), ...]}, deterministic, frozen encoders
    settings: Optional[Callable] = None  # model spec -> text of the settings that shape the tensors (flow's length)
    tensors_of: Optional[Callable] = None  # model folder -> tensor names, where a family's models differ (flow)
    refusal: Optional[Callable] = None  # model folder -> why this model cannot cache text (an edit model), or None
    folders_of: Optional[Callable] = None  # model folder -> folder names, where a family's models differ (video)

    def tensor_names(self, model_folder) -> tuple[str, ...]:
        return tuple(self.tensors_of(model_folder)) if self.tensors_of else self.tensors

    def folder_names(self, model_folder) -> tuple[str, ...]:
        return tuple(self.folders_of(model_folder)) if self.folders_of else self.folders


@dataclass(frozen=True)
class LatentExtras:
    """Tensors a family stores beside each clip's VAE posterior in the latent cache (data.cache.latents), made from
    the same pixels by the frozen parts (image-to-video: the first frame's condition latents and image
    embedding), so that training from the cache needs no second VAE pass."""

    key: Callable  # (model spec, model folder) -> (settings text, subfolders whose fingerprint keys the entries,
    # the tensor names encode returns); ("", (), ()) when this run stores no extras (the plain posterior's entries)
    encode: Callable  # (built, pixels (B, 3, frames, H, W) in [-1, 1]) -> {name: Tensor[B, ...]}, deterministic


@dataclass(frozen=True)
class SingleFileLayout:
    """How a family's single checkpoint file (original, non-diffusers key layout) is laid out, for
    dstune.pretrained, which converts it with diffusers' `from_single_file` into a pipeline folder."""

    denoiser: str  # the pipeline component the file must hold ("unet")
    denoiser_prefixes: tuple[str, ...]  # key prefixes of the denoiser in the original layout
    companions: dict  # component -> key prefixes that show the file holds it; a component it lacks comes from the base


@dataclass(frozen=True)
class Speaker:
    """How `dstune synthesize` speaks from a speech family's export: whether a folder is one of its exports, and the
    clip for a text (from the folder alone: transformers and the codec, none of dstune's training code)."""

    recognizes: Callable  # folder -> bool
    synthesize: Callable  # (folder, text, seconds=, temperature=, seed=) -> Clip (wave, sample_rate)


@dataclass(frozen=True)
class Family:
    """One model family: what the stages call, and what it can do (see the module docstring)."""

    name: str
    modality: Literal["image", "video", "audio"]
    pretrained_fields: tuple[str, ...]  # model-spec keys naming folders dstune.pretrained resolves for build
    build: Callable
    encode_batch: Callable
    loss: Callable
    sample: Callable  # (built, trainable_module, prompts, sample_spec, resolution) -> outputs, on every rank
    save_samples: Callable  # (outputs, prompts, path) -> the path written (a PNG grid or a folder of WAVs)
    export: Callable
    save_lora_weights: Optional[Callable] = None  # (built, lora_layers, adapter_metadata, folder)
    text_cache: Optional[TextCache] = None
    single_file: Optional[SingleFileLayout] = None  # None: model.pretrained must be a folder (or hub id, built-in)
    # build also takes zero3_config= (the run's DeepSpeed JSON under ZeRO-3) and then builds its trainable module
    # partitioned (deepspeed.zero.Init), so no rank holds a whole copy of it
    builds_partitioned: bool = False
    latent_extras: Optional[LatentExtras] = None  # more tensors in each latent cache entry (None: the posterior only)
    # (built, folder, model spec, spec key): samples render that folder's transformer with the trained LoRA
    # (sample.pretrained, model.training_adapter); None: the family samples with the trained module only
    sampling_denoiser: Optional[Callable] = None
    # (built, sequence_parallel_size) -> the context-parallel plan that splits built.trainable's sequences, after
    # preparing the module for it (a model whose diffusers class has no _cp_plan); None (or a None result): the
    # class's own plan (dstune.families.ulysses)
    split_plan: Optional[Callable] = None
    speaker: Optional[Speaker] = None  # speech families: `dstune synthesize` from their exports
    # (spec, pretrained folder) -> None when the run's text encoders load on one rank per node (build then takes
    # text_encoders=False on the others and keeps them in built.text_encoders, which the start-up empties once the
    # text cache is built; samples read built.prompt_text), else why every rank loads them
    # (dstune.families.denoiser_facts.text_once_per_node); None: every rank always loads them
    text_once_per_node: Optional[Callable] = None
    negative_caption: Callable = lambda folder: ""  # pretrained folder -> the negative prompt its samples encode

    @property
    def supports_lora(self) -> bool:
        return self.save_lora_weights is not None
