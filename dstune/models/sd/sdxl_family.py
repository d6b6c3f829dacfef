"""The `sdxl` family: Stable Diffusion XL (UNet2DConditionModel with text_time conditioning, two CLIP text
encoders, AutoencoderKL).

    build(model: SdxlModelSpec, folders, device, dtype_for_frozen) -> SdxlBuilt
    encode_batch(built, batch, dtype) -> {"latent_mean", "latent_std", "encoder_hidden_states", "text_embeds",
                                          "time_ids", "indices"}
    loss(built, trainable_forward, encoded, seed, step) -> scalar tensor (mean over the micro batch)
    sample(built, unet_module, prompts, sample_spec, resolution) -> list[PIL.Image]
    export(built, unet_state_dict, out_dir, pretrained_folder=None) -> Path
    cache hooks: TEXT_CACHE_FOLDERS, TEXT_CACHE_TENSORS, cache_text_tensors (see dstune.families.base)

The conditioning is diffusers' examples/text_to_image/train_text_to_image_sdxl.py: each caption goes through both
tokenizers/encoders, the penultimate hidden states are concatenated on the feature axis (encoder_hidden_states),
text_encoder_2's projected pooled output is `text_embeds`, and `time_ids` is (original height, original width,
crop top, crop left, target height, target width) per sample, from the crop the data layer really made (batch keys
`original_size` and `crop_top_left`, see dstune.data.images.crop_fields). The loss, its per-sample randomness,
Min-SNR and offset noise are the sd family's (dstune.models.sd.sd_family.loss) with the extra UNet inputs added.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from dstune.models.sd import sd_family as sd
from dstune.families.base import Family, FamilyError, SingleFileLayout, TextCache
from dstune.families.diffusion import load_component
from dstune.families.folders import read_component_config, read_model_index
from dstune.families.precision import at_least_float32
from dstune.families.samples import save_grid
from dstune.models.sd.sd_family import export
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import SampleSpec
from dstune.models.sd.spec import SdxlModelSpec

__all__ = [
    "SdxlBuilt",
    "build",
    "encode_batch",
    "loss",
    "sample",
    "export",
    "FAMILY",
    "save_lora_weights",
    "encode_captions",
    "time_ids",
    "check_sdxl_folder",
    "cache_text_tensors",
    "TEXT_CACHE_FOLDERS",
    "TEXT_CACHE_TENSORS",
]

_COMPONENTS = {
    "unet": ({"UNet2DConditionModel"}, "config.json"),
    "vae": ({"AutoencoderKL"}, "config.json"),
    "text_encoder": ({"CLIPTextModel"}, "config.json"),
    "text_encoder_2": ({"CLIPTextModelWithProjection"}, "config.json"),
    "tokenizer": ({"CLIPTokenizer", "CLIPTokenizerFast"}, "tokenizer_config.json"),
    "tokenizer_2": ({"CLIPTokenizer", "CLIPTokenizerFast"}, "tokenizer_config.json"),
    "scheduler": (None, "scheduler_config.json"),
}
_TIME_IDS = 6  # original (h, w), crop top-left (top, left), target (h, w)

# The cache hooks (contract in dstune.families.base): what decides a caption's embedding, and what is stored.
TEXT_CACHE_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
TEXT_CACHE_TENSORS = ("encoder_hidden_states", "text_embeds")


@dataclass
class SdxlBuilt:
    """The loaded model: `trainable` is the UNet (the only part DeepSpeed wraps); the VAE, both text encoders and
    tokenizers and the noise scheduler are frozen companions on `device`."""

    folder: Path
    device: torch.device
    trainable: torch.nn.Module  # UNet2DConditionModel, addition_embed_type "text_time"
    vae: torch.nn.Module
    text_encoder: torch.nn.Module  # CLIPTextModel
    text_encoder_2: torch.nn.Module  # CLIPTextModelWithProjection
    tokenizer: object
    tokenizer_2: object
    noise_scheduler: object
    prediction_type: str  # "epsilon" | "v_prediction"
    min_snr_gamma: Optional[float]
    noise_offset: float
    unet_config: dict

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"vae": self.vae, "text_encoder": self.text_encoder, "text_encoder_2": self.text_encoder_2}


# ---------------------------------------------------------------------------------------------------- build


def check_sdxl_folder(folder: Path) -> None:
    """Raise one FamilyError listing everything that keeps `folder` from being an SDXL base pipeline."""
    index = read_model_index(folder)
    kind = index.get("_class_name")
    if kind not in (None, "StableDiffusionXLPipeline"):
        hint = " (use model.family: sd)" if kind == "StableDiffusionPipeline" else ""
        raise FamilyError(
            f"{folder} holds a {kind}; model.family 'sdxl' is for StableDiffusionXLPipeline folders{hint}."
        )
    refiner = " (an SDXL refiner, which has no text_encoder, is not supported)"
    problems = sd.unet_component_problems(folder, index, _COMPONENTS, {"text_encoder": refiner})
    if not problems:
        problems = _config_mismatches(folder)
    if problems:
        raise FamilyError(
            f"{folder} cannot be used as an `sdxl` (Stable Diffusion XL) model:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def _config_mismatches(folder: Path) -> list[str]:
    def config(name: str) -> dict:
        return read_component_config(folder, name)

    unet, vae, te1, te2 = config("unet"), config("vae"), config("text_encoder"), config("text_encoder_2")
    problems = []
    if unet.get("addition_embed_type") != "text_time":
        problems.append(
            f"the UNet has addition_embed_type {unet.get('addition_embed_type')!r}, not 'text_time' "
            "(an SD 1.x/2.x UNet? use model.family: sd)"
        )
    if unet.get("in_channels") != vae.get("latent_channels", 4):
        problems.append(
            f"unet in_channels {unet.get('in_channels')} != vae latent_channels "
            f"{vae.get('latent_channels', 4)} (inpainting UNets are not supported)"
        )
    hidden = (te1.get("hidden_size") or 0) + (te2.get("hidden_size") or 0)
    if unet.get("cross_attention_dim") != hidden:
        problems.append(
            f"unet cross_attention_dim {unet.get('cross_attention_dim')} != text_encoder hidden_size + "
            f"text_encoder_2 hidden_size ({hidden})"
        )
    pooled_and_times = _TIME_IDS * (unet.get("addition_time_embed_dim") or 0) + (te2.get("projection_dim") or 0)
    if (
        unet.get("addition_embed_type") == "text_time"
        and unet.get("projection_class_embeddings_input_dim") != pooled_and_times
    ):
        problems.append(
            f"unet projection_class_embeddings_input_dim {unet.get('projection_class_embeddings_input_dim')}"
            f" != 6 x addition_time_embed_dim + text_encoder_2 projection_dim ({pooled_and_times}): "
            "a refiner-style UNet (aesthetic score) is not supported"
        )
    return problems


def build(
    model: SdxlModelSpec,
    folders: dict,
    device,
    dtype_for_frozen: torch.dtype = torch.float32,
    zero3_config: Optional[dict] = None,
) -> SdxlBuilt:
    """Load `model.pretrained` as sd.build does (fp32 UNet in host memory, partitioned with `zero3_config`; frozen
    parts in `dtype_for_frozen`)."""
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    folder = folders["pretrained"]
    check_sdxl_folder(folder)
    parts = sd.unet_pipeline_parts(model, folder, device, dtype_for_frozen, zero3_config)
    text_encoder_2 = load_component(folder, "text_encoder_2", CLIPTextModelWithProjection.from_pretrained)
    return SdxlBuilt(
        **parts,
        text_encoder_2=text_encoder_2.to(parts["device"], dtype_for_frozen).eval().requires_grad_(False),
        tokenizer_2=load_component(folder, "tokenizer_2", CLIPTokenizer.from_pretrained),
    )


# --------------------------------------------------------------------------------------------- conditioning


def encode_captions(built: SdxlBuilt, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(encoder_hidden_states (N, T, h1 + h2), text_embeds (N, p2)) in the text encoders' dtype: both encoders'
    penultimate hidden states side by side, and text_encoder_2's projected pooled output (the reference script's
    encode_prompt)."""
    hidden_states, pooled = [], None
    for tokenizer, encoder in ((built.tokenizer, built.text_encoder), (built.tokenizer_2, built.text_encoder_2)):
        max_length = min(tokenizer.model_max_length, encoder.config.max_position_embeddings)
        token_ids = tokenizer(
            captions, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
        ).input_ids.to(built.device)
        with torch.no_grad():
            output = encoder(token_ids, output_hidden_states=True)
        hidden_states.append(output.hidden_states[-2])
        pooled = output[0]  # the last encoder is CLIPTextModelWithProjection: [0] is text_embeds
    return torch.cat(hidden_states, dim=-1), pooled.reshape(len(captions), -1)


def cache_text_tensors(built: SdxlBuilt, captions: list[str]) -> dict[str, torch.Tensor]:
    hidden, pooled = encode_captions(built, captions)
    return {"encoder_hidden_states": hidden, "text_embeds": pooled}


def time_ids(
    original_size: torch.Tensor,
    crop_top_left: torch.Tensor,
    target_size: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(B, 6): original (h, w) + crop top-left (top, left) + target (h, w), the reference script's add_time_ids."""
    original_size, crop_top_left = torch.as_tensor(original_size), torch.as_tensor(crop_top_left)
    target = torch.tensor(target_size, dtype=original_size.dtype).expand(len(original_size), 2)
    return torch.cat([original_size, crop_top_left, target], dim=1).to(dtype)


def _geometry(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    missing = [name for name in ("original_size", "crop_top_left") if name not in batch]
    if missing:
        raise KeyError(
            f"the sdxl family needs each sample's {' and '.join(missing)} (dstune.data.images.crop_fields)"
            f"; this batch has only {sorted(batch)}"
        )
    return torch.as_tensor(batch["original_size"]).long(), torch.as_tensor(batch["crop_top_left"]).long()


def encode_batch(built: SdxlBuilt, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The frozen encoders' view of a batch: sd's latent posterior, both encoders' text conditioning (used as
    stored when the batch comes from the cache) and the time ids. No random draws."""
    indices = torch.as_tensor(batch["indices"] if "indices" in batch else batch["index"], dtype=torch.long)
    if "latent_mean" in batch:
        mean, std = batch["latent_mean"].to(built.device).float(), batch["latent_std"].to(built.device).float()
    else:
        with torch.no_grad():
            posterior = built.vae.encode(batch["pixel_values"].to(built.device, built.vae.dtype)).latent_dist
        mean, std = at_least_float32(posterior.mean), at_least_float32(posterior.std)
    if "encoder_hidden_states" in batch:
        hidden, pooled = batch["encoder_hidden_states"].to(built.device), batch["text_embeds"].to(built.device)
    else:
        captions = batch["caption"] if "caption" in batch else batch["captions"]
        hidden, pooled = encode_captions(built, list(captions))
    if "pixel_values" in batch:
        target = tuple(batch["pixel_values"].shape[-2:])
    else:  # cached latents: the pixels they came from were latent size x the VAE's downsampling factor
        factor = 2 ** (len(built.vae.config.block_out_channels) - 1)
        target = tuple(side * factor for side in mean.shape[-2:])
    original_size, crop_top_left = _geometry(batch)
    return {
        "latent_mean": mean,
        "latent_std": std,
        "encoder_hidden_states": hidden.to(dtype),
        "text_embeds": pooled.to(dtype),
        "time_ids": time_ids(original_size, crop_top_left, target).to(built.device, dtype),
        "indices": indices,
    }


def loss(built: SdxlBuilt, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """sd's diffusion loss (same per-sample draws, target, Min-SNR), the UNet also given text_embeds and time_ids."""
    param_dtype = next(built.trainable.parameters()).dtype
    added = {"text_embeds": encoded["text_embeds"].to(param_dtype), "time_ids": encoded["time_ids"].to(param_dtype)}

    def forward_with_added_conditions(*args, **kwargs):
        return trainable_forward(*args, added_cond_kwargs=added, **kwargs)

    return sd.loss(built, forward_with_added_conditions, encoded, seed, step)


# ------------------------------------------------------------------------------------------------- sampling


def sample(
    built: SdxlBuilt, unet_module: torch.nn.Module, prompts: list[str], sample_spec: SampleSpec, resolution: int
) -> list:
    """Render one image per prompt with a StableDiffusionXLPipeline around `unet_module` (no weight copy) and a DDIM
    scheduler; the pipeline's time ids say original = target = the rendered size, crop (0, 0). Prompt i always
    starts from the noise of (sample_spec.seed, i). The UNet's train/eval mode is restored afterwards."""
    from diffusers import DDIMScheduler

    if not prompts:
        return []
    with quiet_hf_libraries():
        from diffusers import StableDiffusionXLPipeline

        scheduler = DDIMScheduler.from_config(built.noise_scheduler.config, set_alpha_to_one=False)
    pipeline = StableDiffusionXLPipeline(
        vae=built.vae,
        text_encoder=built.text_encoder,
        text_encoder_2=built.text_encoder_2,
        tokenizer=built.tokenizer,
        tokenizer_2=built.tokenizer_2,
        unet=unet_module,
        scheduler=scheduler,
        add_watermarker=False,
    )
    return sd.render(pipeline, unet_module, prompts, sample_spec, resolution)


# export is sd.export: it writes the trained UNet and copies every other component listed in model_index.json
# (here text_encoder_2 and tokenizer_2 too), then records the trained prediction type in the scheduler config.


def save_lora_weights(built: SdxlBuilt, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
    """The UNet's LoRA as StableDiffusionXLPipeline writes it (model.train: lora; dstune.families.lora builds the layers)."""
    with quiet_hf_libraries():
        from diffusers import StableDiffusionXLPipeline

        StableDiffusionXLPipeline.save_lora_weights(
            folder, unet_lora_layers=lora_layers, unet_lora_adapter_metadata=adapter_metadata, safe_serialization=True
        )


# The original SDXL checkpoint layout (what from_single_file reads): UNet under model.diffusion_model., VAE under
# first_stage_model., the two text encoders under conditioner.embedders.0. (CLIP ViT-L) and .1. (OpenCLIP ViT-bigG).
SINGLE_FILE = SingleFileLayout(
    "unet",
    ("model.diffusion_model.",),
    {
        "vae": ("first_stage_model.",),
        "text_encoder": ("conditioner.embedders.0.",),
        "text_encoder_2": ("conditioner.embedders.1.",),
    },
)

FAMILY = Family(
    name="sdxl",
    modality="image",
    pretrained_fields=("pretrained",),
    build=build,
    encode_batch=encode_batch,
    loss=loss,
    sample=sample,
    save_samples=save_grid,
    export=export,
    save_lora_weights=save_lora_weights,
    text_cache=TextCache(TEXT_CACHE_FOLDERS, TEXT_CACHE_TENSORS, cache_text_tensors),
    single_file=SINGLE_FILE,
    builds_partitioned=True,
)
