"""What one model of the flow family is: a recipe that the flow core (dstune.families.flow) follows.

The core does what every flow-matching transformer shares: load the folder, draw u, index the timestep and sigma
tables, x_t = (1 - sigma) x0 + sigma noise, the loss against noise - x0, sampling with the folder's own pipeline,
export and LoRA files. A recipe says what differs between models:

    components         the pipeline folder's parts and their classes (model_index.json); tokenizers loosely
    encode_captions    the text side, through the pipeline's own encode_prompt: {tensor name: (B, ...)}
    predict            how the transformer is fed (packing, position ids, guidance, timestep scale) and its output
                       turned back into the latent layout (B, C, H, W)
    text_tokens        how many tokens per caption the text tensors hold (the guard behind the text cache's key)
    config_mismatches  which config values of the parts must agree (channels, widths)

Adding a model (HiDream, Chroma, Lumina 2, ...) is a recipe module, one line in flow.RECIPES, a built-in tiny model
and a loss-parity test against the model's training example (docs/family-flow.md, "Adding a model").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component, read_model_index


@dataclass(frozen=True)
class FlowRecipe:
    kind: str  # the name validate and the docs use ("sd3", "flux", ...)
    transformer_class: str  # diffusers class in transformer/config.json: how a folder is recognised
    pipeline_class: str  # encode_prompt, sampling, save_lora_weights / load_lora_weights
    components: dict  # model_index component -> expected class name (None: a tokenizer, checked loosely)
    default_max_sequence_length: int  # the training example's --max_sequence_length default
    text_tensors: tuple[str, ...]  # what encode_captions returns, per caption (the text cache stores these)
    encode_captions: Callable  # (text-only pipeline, built, captions) -> {name: Tensor[len(captions), ...]}
    predict: Callable  # (built, forward, noisy (B,C,H,W), timesteps (B,), conditions: dict, dtype) -> (B,C,H,W)
    text_tokens: Callable  # (built) -> tokens per caption in text_tensors["encoder_hidden_states"]
    config_mismatches: Callable  # (folder) -> ["what disagrees", ...]
    vae_class: str = "AutoencoderKL"
    packed_sides: int = 1  # latent sides must be multiples of this (2: 2x2 patches packed into tokens)
    posterior_mode: bool = False  # the training example takes the VAE posterior's mode, not a sample
    # (built, VAE sample (B, C, H, W)) -> the latents noise is added to; None: normalised_latents of the VAE config
    model_latents: Optional[Callable] = None
    # (built, sample_spec, prompts) -> the pipeline call's guidance arguments; None: guidance_scale=sample_spec.guidance
    sample_options: Optional[Callable] = None
    # the model is conditioned on a source (control) image: batches carry `control_values` (pixels, which the text
    # side needs) and cached `control_latent_mean` or the pixels to encode; encode_captions also gets controls=,
    # predict finds the normalised control latents as conditions["control_latents"]
    control: bool = False
    # (folder) -> {pipeline component: object} for parts that are neither encoders nor tokenizers (a processor)
    load_extras: Optional[Callable] = None
    # (folder) -> why data.cache.text_embeddings cannot be used with this model; None: it can
    text_cache_refusal: Optional[Callable] = None


def read_config(folder: Path, name: str, file: str = "config.json") -> dict:
    path = folder / name / file
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FamilyError(f"{path}: cannot read it ({err})") from None


def load_text_side(folder: Path, recipe: FlowRecipe, device, dtype) -> tuple[dict, dict]:
    """The recipe's text encoders (frozen, eval, in `dtype` on `device`) and tokenizers, by their listed classes. A
    tokenizer listed as a processor (FLUX.2 [dev]'s PixtralProcessor) is loaded as one, as the pipeline loads it,
    since its encode_prompt calls the processor's apply_chat_template."""
    import transformers

    index = read_model_index(folder)
    encoders, tokenizers = {}, {}
    for name, expected in recipe.components.items():
        if not name.startswith(("text_encoder", "tokenizer")):
            continue
        if expected is None:
            listed = str((index.get(name) or [None, ""])[-1])
            loader = transformers.AutoProcessor if listed.endswith("Processor") else transformers.AutoTokenizer
            tokenizers[name] = load_component(folder, name, loader.from_pretrained)
        else:
            cls = getattr(transformers, expected)
            module = load_component(folder, name, cls.from_pretrained).to(device, dtype)
            encoders[name] = module.eval().requires_grad_(False)
    return encoders, tokenizers


def normalised_latents(vae_config, latents: torch.Tensor) -> torch.Tensor:
    """The VAE sample in the transformer's scale: per channel (latents_mean, latents_std) where the VAE states them
    (Qwen-Image's), else (sample - shift_factor) * scaling_factor (SD3, Flux)."""
    means = getattr(vae_config, "latents_mean", None)
    if means is not None:
        shape = (1, len(means)) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(means, dtype=latents.dtype, device=latents.device).view(shape)
        std = torch.tensor(vae_config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
        return (latents - mean) / std
    return (latents - (getattr(vae_config, "shift_factor", None) or 0.0)) * vae_config.scaling_factor


def vae_spatial_factor(vae_config) -> int:
    """Pixels per latent along a side: 2 per down block of an AutoencoderKL, 2 per temporal-downsample entry (one per
    down stage) of a video-style VAE (Qwen-Image's)."""
    if getattr(vae_config, "temperal_downsample", None) is not None:
        return 2 ** len(vae_config.temperal_downsample)
    return 2 ** (len(vae_config.block_out_channels) - 1)


def pick_recipe(folder: Path, index: dict, recipes: list[FlowRecipe]) -> FlowRecipe:
    """Among the recipes of one transformer class: the one of the folder's pipeline class; else the one of its text
    encoder class where that tells them apart (FLUX.2 [klein]: Qwen3, [dev]: Mistral3); else, for a transformer with
    one recipe, that one (whose component check then lists every part that does not fit). Qwen-Image and
    Qwen-Image-Edit share their text encoder class too, so another pipeline around that transformer (the 2509 edit
    models' QwenImageEditPlusPipeline) is refused rather than trained as either."""
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
    raise FamilyError(f"{folder / 'model_index.json'}: a {pipeline_class} around a {recipes[0].transformer_class} is "
                      "not supported; model.family 'flow' trains that transformer in "
                      f"{', '.join(r.pipeline_class for r in recipes)} folders.")
