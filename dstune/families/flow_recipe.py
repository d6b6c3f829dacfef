"""What one model of the flow-matching core is: a recipe that dstune.families.flow_core follows, for images
(B, C, H, W latents: model.family flow) and video (B, C, F, H, W: the video family) alike.

The core does what every flow-matching transformer shares: load the folder, draw u, index the timestep and sigma
tables, x_t = (1 - sigma) x0 + sigma noise, the loss against noise - x0, sampling with the folder's own pipeline,
export and LoRA files. A recipe says what differs between models, in a few required fields and four optional
groups, each of which a model either needs whole or not at all:

    components         the pipeline folder's parts and their classes (model_index.json); tokenizers loosely
    text               TextSide: the caption tensors, through the pipeline's own encode_prompt, and their length
    predict            how the transformer is fed (packing, position ids, guidance, timestep scale) and its output
                       turned back into the latent layout
    config_mismatches  which config values of the parts must agree (channels, widths)
    latents            LatentSpace: the VAE, the token geometry (patch, frames) and the model's latent scale
    conditioning       Conditioning: what the transformer sees beside text (a source image, a clip's first frame)
    experts            Experts: two transformers splitting the timesteps at a boundary, one trained per run
    sampling           Sampling: the pipeline call that renders samples (guidance, scheduler, side multiple)
    sound              SoundStream: a second latent stream of a clip's sound, noised and learned beside the video

Adding an image model (HiDream, Chroma, Lumina 2, ...) is a recipe module, one line in flow.RECIPES, a built-in tiny
model and a loss-parity test (docs/family-flow.md, "Adding a model"); a video model is the same with frames in its
LatentSpace (docs/family-flow.md, "Adding a video model", names an example).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component
from dstune.families.folders import read_model_index


def vae_spatial_factor(vae_config) -> int:
    """Pixels per latent along a side: 2 per down block of an AutoencoderKL, 2 per temporal-downsample entry (one per
    down stage) of a video-style VAE."""
    if getattr(vae_config, "temperal_downsample", None) is not None:
        return 2 ** len(vae_config.temperal_downsample)
    return 2 ** (len(vae_config.block_out_channels) - 1)


@dataclass(frozen=True)
class TextSide:
    """Captions -> the transformer's text tensors (what the text cache stores per caption)."""

    tensors: tuple[str, ...]  # what encode returns, per caption
    encode: Callable  # (text-only pipeline, built, captions, **conditioning text inputs) -> {name: Tensor[B, ...]}
    tokens: Callable  # (built) -> tokens per caption in tensors["encoder_hidden_states"]; None: no fixed length
    default_max_sequence_length: int  # the training example's (or pipeline's) max_sequence_length default
    # (folder, recipe, device, dtype) -> (encoders, tokenizers); None: load_text_side (the listed classes, then cast)
    load: Optional[Callable] = None
    cache_refusal: Optional[Callable] = None  # (folder) -> why data.cache.text_embeddings cannot be used; None: it can
    # (folder, recipe) -> the tokenizers (or processor) alone, for a rank that loads no text encoder; None:
    # load_tokenizers (the listed tokenizers)
    load_tokenizers: Optional[Callable] = None


@dataclass(frozen=True)
class LatentSpace:
    """The VAE, the latents' layout and how they are cut into tokens (the token geometry)."""

    vae_class: str = "AutoencoderKL"
    frames: bool = False  # latents carry a frame axis: (B, C, F, H, W) from clips (B, 3, frames, H, W)
    patch: Callable = lambda built: (1, 1)  # (built) -> latent (rows, columns) per token: sides must be multiples
    spatial_factor: Callable = vae_spatial_factor  # (VAE config) -> pixels per latent along a side
    posterior_mode: bool = False  # the training example takes the VAE posterior's mode, not a sample
    # (built, VAE sample) -> the latents noise is added to; None: normalised_latents of the VAE config
    to_model: Optional[Callable] = None


def fixed_patch(side: int) -> Callable:
    """A transformer that packs side x side latents into one token (2x2 in most MMDiTs)."""
    return lambda built: (side, side)


@dataclass(frozen=True)
class Conditioning:
    """What the transformer reads beside the noisy latents and the text, made from the same sample (an edit model's
    source image, a video model's first frame). Hooks left None do nothing."""

    # (folder, model spec, transformer config, device, dtype) -> (parts, mode): extra pipeline parts (a processor, an
    # image encoder: built.parts; nn.Modules among them are frozen companions) and the run's mode (built.mode)
    load: Optional[Callable] = None
    encode: Optional[Callable] = None  # (built, batch, dtype) -> {name: Tensor}: the encoded batch's conditions
    text_inputs: Optional[Callable] = None  # (conditions) -> text.encode's keyword arguments (the text needs them)
    model_inputs: Optional[Callable] = None  # (built, encoded, dtype) -> {name: Tensor} predict finds in conditions
    clean_frames: Callable = lambda built: 0  # (built) -> leading latent frames given clean: outside the loss
    # (built, sample_spec, prompts) -> one source per prompt (validated before rendering), or None
    sample_sources: Optional[Callable] = None
    # (built, text-only pipeline, prompt, source, sample_spec) -> that prompt's pipeline inputs
    sample_inputs: Callable = lambda built, text_pipeline, prompt, source, sample_spec: {
        "prompt": prompt,
        "image": source,
    }


@dataclass(frozen=True)
class Experts:
    """Two transformers that split the timesteps at a boundary (model_index.json's boundary_ratio); a run trains
    one of them, on its side of the boundary only."""

    trained: Callable  # (model spec) -> the pipeline component trained ("transformer", "transformer_2")
    positions: Callable  # (timesteps, model spec, model_index, scheduler config) -> (first table position, count)
    other_loaded: Callable  # (built) -> context manager: the untrained expert in built.other_expert meanwhile


@dataclass(frozen=True)
class Sampling:
    """How samples render with the folder's pipeline class."""

    # (built, sample_spec, prompts) -> the pipeline call's guidance arguments; None: guidance_scale=sample.guidance
    options: Optional[Callable] = None
    # (built, transformer) -> (pipeline class, extra constructor arguments); None: recipe.pipeline_class with parts
    pipeline: Optional[Callable] = None
    scheduler: Optional[Callable] = None  # (built) -> the sampling scheduler; None: a FlowMatchEuler of the folder's
    side_multiple: Optional[Callable] = None  # (built) -> pixels the sides are multiples of; None: 2 x VAE factor
    # (built, pipeline, sample_spec, call arguments) -> the arguments the pipeline's __call__ takes (a pipeline
    # without max_sequence_length or guidance_scale, whose guider is a part); None: as they are
    call: Optional[Callable] = None
    takes_max_sequence_length: bool = True  # the pipeline call has max_sequence_length (not every one has)
    # (built, pipeline, the prompts' cached text tensors, those of "" as many times (each (B, ...) on the device))
    # -> the pipeline call's arguments in place of `prompt` (embeddings, masks, the negative's): samples of a rank
    # without text encoders (dstune.families.denoiser_facts.text_once_per_node); None: the model's samples need its
    # encoders. Declared together with its facts' samples_from_cached_text (VideoFacts, FlowModel).
    cached_text: Optional[Callable] = None
    negative_caption: str = ""  # the negative prompt its samples encode (the pipelines' default ""): cached too


@dataclass(frozen=True)
class SoundStream:
    """A clip's sound as a second latent stream (an audio+video transformer): the dataset reads each clip's sound
    track at `rate`, `encode` makes its latents (cached beside the clip's posterior), and the loss noises their tokens
    at the clip's sigma with noise of their own (purpose `audio_noise`) and adds their mean squared error, against
    noise - x0, to the video's, per sample. Clips without sound train the video alone (`predict` of the recipe)."""

    rate: Callable  # (built) -> the sample rate (Hz) the encoder takes: the dataset resamples the sound to it
    encode: Callable  # (built, sound (B, 2, samples) float32 at rate) -> latents (B, ...) float32, no random draw
    to_tokens: Callable  # (built, latents) -> the transformer's tokens (B, T, D), where noise is added
    # (built, forward, noisy video latents, timesteps (B,), conditions, noisy sound tokens, dtype) ->
    # (video prediction in the latent layout, sound prediction (B, T, D))
    predict: Callable
    parts: tuple[str, ...] = ()  # the pipeline parts encode uses (built.parts): they key the cached latents
    # (built, the pipeline's output for one prompt) -> (its sound (channels, samples) float array, Hz, frames per
    # second): samples saved with their sound; None: samples are frames only
    rendered: Optional[Callable] = None


@dataclass(frozen=True)
class FlowRecipe:
    kind: str  # the name validate and the docs use (a short lower-case model name)
    transformer_class: str  # diffusers class in transformer/config.json: how a folder is recognised
    pipeline_class: str  # encode_prompt, sampling, save_lora_weights / load_lora_weights
    components: dict  # model_index component -> expected class name (None: a tokenizer, checked loosely)
    text: TextSide
    predict: Callable  # (built, forward, noisy latents, timesteps (B,), conditions: dict, dtype) -> latent layout
    config_mismatches: Callable  # (folder) -> ["what disagrees", ...]
    latents: LatentSpace = field(default_factory=LatentSpace)
    conditioning: Optional[Conditioning] = None
    experts: Optional[Experts] = None
    sampling: Sampling = field(default_factory=Sampling)
    # (scheduler, model.shift) -> (timesteps, sigmas) u indexes; None: the folder scheduler's tables (flow_core)
    train_tables: Optional[Callable] = None
    scheduler_class: Optional[str] = "FlowMatchEulerDiscreteScheduler"  # None: the class model_index.json lists
    # (model spec) -> whether the loss compares the x0 the velocity implies (EDM-style) rather than the velocity
    preconditioned: Callable = lambda model: model.precondition_outputs
    # (transformer, sequence_parallel_size) -> the context-parallel plan that splits it, after preparing it (its
    # diffusers class has no _cp_plan); None: the class's own plan
    sequence_split: Optional[Callable] = None
    # (built, model-space latents, seed, step, indices) -> sigma per sample (B,), drawn continuously as the model's
    # example draws it; None: u indexes the tables (timesteps are then sigma x 1000)
    draw_sigmas: Optional[Callable] = None
    lora_class: Optional[str] = None  # whose save_lora_weights writes the LoRA file; None: pipeline_class
    sound: Optional[SoundStream] = None  # a clip's sound, trained beside the video; None: video (or images) only

    @property
    def text_tensors(self) -> tuple[str, ...]:
        return self.text.tensors

    @property
    def default_max_sequence_length(self) -> int:
        return self.text.default_max_sequence_length


def read_config(folder: Path, name: str, file: str = "config.json") -> dict:
    path = folder / name / file
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FamilyError(f"{path}: cannot read it ({err})") from None


def embeds_and_mask(built, pipeline, prompt: dict, negative: dict) -> dict:
    """A Sampling.cached_text for the pipelines that take `prompt_embeds` with `prompt_embeds_mask` (and the
    negative's): the cached encoder_hidden_states and encoder_attention_mask, less the trailing tokens that are
    padding in every row (the cache pads to max_sequence_length, the pipeline's own encoding to the longest prompt
    of the call: a model whose masked keys still weigh a little then renders the same image)."""

    def trimmed(tensors: dict) -> tuple:
        mask = tensors["encoder_attention_mask"]
        used = mask.bool().any(dim=0).nonzero()
        keep = int(used.max()) + 1 if len(used) else mask.shape[1]
        return tensors["encoder_hidden_states"][:, :keep], mask[:, :keep]

    (embeds, mask), (negative_embeds, negative_mask) = trimmed(prompt), trimmed(negative)
    return {
        "prompt_embeds": embeds,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": negative_embeds,
        "negative_prompt_embeds_mask": negative_mask,
    }


def per_caption_embeds(built, pipeline, prompt: dict, negative: dict) -> dict:
    """A Sampling.cached_text for the pipelines that take a list of each caption's own tokens (no padding, no
    mask): the cached encoder_hidden_states cut by encoder_attention_mask, for the prompts and the negative."""

    def listed(tensors: dict) -> list:
        return [e[m.bool()] for e, m in zip(tensors["encoder_hidden_states"], tensors["encoder_attention_mask"])]

    return {"prompt_embeds": listed(prompt), "negative_prompt_embeds": listed(negative)}


def load_text_side(folder: Path, recipe: FlowRecipe, device, dtype) -> tuple[dict, dict]:
    """The recipe's text encoders (frozen, eval, in `dtype` on `device`) and tokenizers, by their listed classes. A
    tokenizer listed as a processor (e.g. a PixtralProcessor) is loaded as one, as the pipeline loads it,
    since its encode_prompt calls the processor's apply_chat_template."""
    import transformers

    encoders = {}
    for name, expected in recipe.components.items():
        if name.startswith("text_encoder") and expected is not None:
            module = load_component(folder, name, getattr(transformers, expected).from_pretrained).to(device, dtype)
            encoders[name] = module.eval().requires_grad_(False)
    return encoders, load_tokenizers(folder, recipe)


def load_tokenizers(folder: Path, recipe: FlowRecipe) -> dict:
    """The recipe's tokenizers (a processor where the folder lists one): all a rank that loads no text encoder
    keeps of the text side (dstune.families.denoiser_facts.text_once_per_node)."""
    import transformers

    index, tokenizers = read_model_index(folder), {}
    for name, expected in recipe.components.items():
        if name.startswith("tokenizer") and expected is None:
            listed = str((index.get(name) or [None, ""])[-1])
            loader = transformers.AutoProcessor if listed.endswith("Processor") else transformers.AutoTokenizer
            tokenizers[name] = load_component(folder, name, loader.from_pretrained)
    return tokenizers


def normalised_latents(vae_config, latents: torch.Tensor) -> torch.Tensor:
    """The VAE sample in the transformer's scale: per channel (latents_mean, latents_std) where the VAE states them
    (a video-style VAE's), else (sample - shift_factor) * scaling_factor."""
    means = getattr(vae_config, "latents_mean", None)
    if means is not None:
        shape = (1, len(means)) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(means, dtype=latents.dtype, device=latents.device).view(shape)
        std = torch.tensor(vae_config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
        return (latents - mean) / std
    return (latents - (getattr(vae_config, "shift_factor", None) or 0.0)) * vae_config.scaling_factor


def pick_recipe(folder: Path, index: dict, recipes: list[FlowRecipe]) -> FlowRecipe:
    """Among the recipes of one transformer class: the one of the folder's pipeline class; else the one of its text
    encoder class where that tells them apart (two models on one transformer class with different text encoders);
    else, for a transformer with one recipe, that one (whose component check then lists every part that does not
    fit). Where two recipes share the text encoder class too, another pipeline around that transformer (a newer
    edit pipeline, say) is refused rather than trained as either."""
    pipeline_class = index.get("_class_name")
    for recipe in recipes:
        if recipe.pipeline_class == pipeline_class:
            return recipe
    entry = index.get("text_encoder")
    encoder = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    by_encoder = [recipe for recipe in recipes if recipe.components.get("text_encoder") == encoder]
    if len(by_encoder) == 1:
        return by_encoder[0]
    if len(recipes) == 1:
        return recipes[0]
    raise FamilyError(
        f"{folder / 'model_index.json'}: a {pipeline_class} around a {recipes[0].transformer_class} is "
        "not supported; model.family 'flow' trains that transformer in "
        f"{', '.join(r.pipeline_class for r in recipes)} folders."
    )
