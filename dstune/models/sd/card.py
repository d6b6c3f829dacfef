"""The cards of the UNet models (torch-free): Stable Diffusion 1.x / 2.x (`model.family sd`: StableDiffusionPipeline,
one CLIP text encoder) and SDXL (`model.family sdxl`: StableDiffusionXLPipeline, two CLIP text encoders, pooled text
and size/crop time ids), each the whole of its family. What validate, the memory plan and start-up know of them: the
folder's components and configs, the text cache, their single-file checkpoint layouts, and the UNet's activations."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from dstune import registry
from dstune.card import ModelPreset, image
from dstune.families.denoiser_facts import count_denoiser, embedding_width_bytes, image_latent_bytes
from dstune.families.folders import read_component_config, read_model_index
from dstune.families.pipeline_card import PipelineCard
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes, measured_unet, unet_sample_bytes

CLIP_TOKENS = 77  # every CLIP text encoder's context
CLIP_TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast")
# Pipelines people mistake for an SD 1.x/2.x one that no UNet card names: two transformers dstune does not train
UNTRAINED_LOOKALIKES = {"PixArtSigmaPipeline": "PixArt", "PixArtAlphaPipeline": "PixArt", "SanaPipeline": "Sana"}


@dataclass(frozen=True)
class SingleFile:
    """A UNet pipeline's single-checkpoint-file layout (dstune.card.SingleFileLayout)."""

    denoiser: str
    denoiser_prefixes: tuple[str, ...]
    companions: dict


def unet_component_problems(folder: Path, index: dict, components: dict, missing_hints: dict) -> list[str]:
    """What keeps the components of a UNet pipeline folder from loading: `components` maps each name to (accepted
    class names, or None for any; the file that must exist in its subfolder); `missing_hints` adds a reason to a
    component that model_index.json lacks."""
    problems = []
    for name, (classes, required_file) in components.items():
        entry = index.get(name)
        listed = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if listed is None:
            problems.append(f"model_index.json has no `{name}` component{missing_hints.get(name, '')}")
        elif classes is not None and listed not in classes:
            problems.append(f"`{name}` is a {listed}; expected {' or '.join(sorted(classes))}")
        if not (folder / name).is_dir():
            problems.append(f"missing subfolder {name}/")
        elif not (folder / name / required_file).is_file():
            problems.append(f"missing {name}/{required_file}")
    return problems


@dataclass(frozen=True, kw_only=True)
class UnetCard(PipelineCard):
    """A UNet pipeline's card; SD 1.x/2.x's as it is, SDXL's (SdxlCard) checks its configs its own way."""

    # component -> (accepted classes, or None for any; the file its subfolder must hold)
    unet_components: dict[str, tuple[Optional[tuple[str, ...]], str]]
    missing_hints: dict[str, str] = field(default_factory=dict)  # why a component may be missing (a refiner's)
    single_file: SingleFile  # the original single-checkpoint-file layout (what from_single_file reads)
    # its CLIP encoders are small: every rank keeps its own (no text_once_per_node)
    text_once: ClassVar[bool] = False

    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        index = read_model_index(folder)
        kind = index.get("_class_name")
        if kind is not None and kind not in self.folder_classes:
            return [f"it holds a {kind} ({self.lookalike(kind)}); model.family {self.family} trains {self.summary}"]
        problems = unet_component_problems(folder, index, self.unet_components, self.missing_hints)
        return problems or self.config_mismatches(folder)

    def lookalike(self, pipeline: str) -> str:
        """What a pipeline class another model trains (or no dstune model) is."""
        owner = next((card for card in registry.cards() if pipeline in card.folder_classes), None)
        if owner is not None:
            return f"{owner.name}: use model.family: {owner.family}"
        return UNTRAINED_LOOKALIKES.get(pipeline, "not a model dstune trains")

    def config_mismatches(self, folder: Path) -> list[str]:
        unet, vae = read_component_config(folder, "unet"), read_component_config(folder, "vae")
        text = read_component_config(folder, "text_encoder")
        problems = []
        if unet.get("addition_embed_type") is not None:
            problems.append(f"the UNet has addition_embed_type {unet['addition_embed_type']!r} (an SDXL-style UNet)")
        problems += latent_channel_problems(unet, vae)
        if unet.get("cross_attention_dim") != text.get("hidden_size"):
            problems.append(
                f"unet cross_attention_dim {unet.get('cross_attention_dim')} != text_encoder hidden_size "
                f"{text.get('hidden_size')}"
            )
        return problems

    def text_cache_settings(self, model_spec) -> str:
        return ""  # CLIP's context is fixed: the encoders alone decide a caption's tensors

    def single_file_layout(self) -> Optional[SingleFile]:
        return self.single_file

    # ------------------------------------------------------------------------------------------- memory

    def count(self, spec, num_samples: int, clips=()):
        return count_denoiser(spec, num_samples, clips, self)

    def trained(self, spec, folder) -> tuple:
        return "unet", {}, None  # the UNet; no part loaded for samples only; no experts

    def uses_image_encoder(self, spec, folder) -> bool:
        return False

    def activation_bytes(self, spec, folder, config: dict, clips) -> tuple[float, float]:
        """The measured constants of the UNet structure the config has (SD 1.x/2.x, SDXL; any width), over the
        latent pixels (resolution / 8 squared) and the 77 CLIP tokens; a UNet of another structure (the built-in
        tiny ones): the generic formula (dstune.memory.activations.unet_sample_bytes)."""
        key = measured_unet(config)
        if key is None:
            return unet_sample_bytes(config, spec.data.resolution)
        pixels = (spec.data.resolution / 8) ** 2
        shape = ModelShape(width=config["block_out_channels"][0])
        return in_plan_units(
            measured_sample_bytes(key, shape, pixels, CLIP_TOKENS, spec.train.precision), spec.train.precision
        )

    def cache_bytes(self, spec, folder, companions: dict, num_samples: int, clips) -> int:
        """Per image its posterior and each CLIP's 77 hidden states, times the images."""
        per_sample = image_latent_bytes(spec, folder, companions)
        if spec.data.cache.text_embeddings:
            for part in companions:
                if part.startswith("text_encoder"):
                    width = folder.config(part).get("hidden_size", 0)
                    per_sample += CLIP_TOKENS * width * embedding_width_bytes(spec)
        return per_sample * num_samples


def latent_channel_problems(unet: dict, vae: dict) -> list[str]:
    if unet.get("in_channels") != vae.get("latent_channels", 4):
        return [
            f"unet in_channels {unet.get('in_channels')} != vae latent_channels "
            f"{vae.get('latent_channels', 4)} (inpainting UNets are not supported)"
        ]
    return []


@dataclass(frozen=True, kw_only=True)
class SdxlCard(UnetCard):
    time_ids: int  # the time ids per sample: original (h, w), crop top-left (top, left), target (h, w)

    def config_mismatches(self, folder: Path) -> list[str]:
        def config(name: str) -> dict:
            return read_component_config(folder, name)

        unet, vae, te1, te2 = config("unet"), config("vae"), config("text_encoder"), config("text_encoder_2")
        problems = []
        if unet.get("addition_embed_type") != "text_time":
            problems.append(
                f"the UNet has addition_embed_type {unet.get('addition_embed_type')!r}, not 'text_time' "
                "(an SD 1.x/2.x UNet? use model.family: sd)"
            )
        problems += latent_channel_problems(unet, vae)
        hidden = (te1.get("hidden_size") or 0) + (te2.get("hidden_size") or 0)
        if unet.get("cross_attention_dim") != hidden:
            problems.append(
                f"unet cross_attention_dim {unet.get('cross_attention_dim')} != text_encoder hidden_size + "
                f"text_encoder_2 hidden_size ({hidden})"
            )
        pooled_and_times = self.time_ids * (unet.get("addition_time_embed_dim") or 0) + (te2.get("projection_dim") or 0)
        if (
            unet.get("addition_embed_type") == "text_time"
            and unet.get("projection_class_embeddings_input_dim") != pooled_and_times
        ):
            problems.append(
                f"unet projection_class_embeddings_input_dim {unet.get('projection_class_embeddings_input_dim')}"
                f" != {self.time_ids} x addition_time_embed_dim + text_encoder_2 projection_dim ({pooled_and_times}): "
                "a refiner-style UNet (aesthetic score) is not supported"
            )
        return problems


def _components(*text: tuple[str, str]) -> dict:
    parts = {"unet": (("UNet2DConditionModel",), "config.json"), "vae": (("AutoencoderKL",), "config.json")}
    for encoder, encoder_class in text:
        parts[encoder] = ((encoder_class,), "config.json")
    for encoder, _ in text:
        parts[encoder.replace("text_encoder", "tokenizer")] = (CLIP_TOKENIZERS, "tokenizer_config.json")
    return {**parts, "scheduler": (None, "scheduler_config.json")}


SD_CARD = UnetCard(
    key="sd",
    name="Stable Diffusion 1.x / 2.x",
    family="sd",
    unit="sd",
    model_class="dstune.models.sd.model:Sd",
    docs="docs/family-sdxl.md",
    names=r"sd15|sd 1\.x|stable diffusion(?! 3| xl)",
    summary="Stable Diffusion 1.x/2.x (StableDiffusionPipeline: a UNet, one CLIP text encoder)",
    folder_classes={"StableDiffusionPipeline": 7.5},
    transformer_class="UNet2DConditionModel",
    pipeline_class="StableDiffusionPipeline",
    components={},  # unet_components: a class set and a required file per component
    unet_components=_components(("text_encoder", "CLIPTextModel")),
    text_tensors=("encoder_hidden_states",),
    text_cache_folders=("text_encoder", "tokenizer"),
    # the original layout: UNet under model.diffusion_model., VAE under first_stage_model., the CLIP text encoder
    # under cond_stage_model. (SD 2.x: its OpenCLIP naming)
    single_file=SingleFile(
        "unet", ("model.diffusion_model.",), {"vae": ("first_stage_model.",), "text_encoder": ("cond_stage_model.",)}
    ),
    activation_cases="dstune.models.sd.builtin_sd:ACTIVATION_CASES",
    builtins={"tiny-sd": "dstune.models.sd.builtin_sd:TINY_SD"},
    presets=(
        ModelPreset(
            "sd15",
            "Stable Diffusion 1.5 (UNet, CLIP ViT-L text encoder)",
            "sd",
            "stable-diffusion-v1-5/stable-diffusion-v1-5",
            "tiny-sd",
            image(
                512,
                7.5,
                30,
                **{"train.micro_batch_size": 4, "train.optimizer.lr": 1.0e-5, "model.gradient_checkpointing": True},
            ),
        ),
    ),
)

SDXL_CARD = SdxlCard(
    key="sdxl",
    name="Stable Diffusion XL",
    family="sdxl",
    unit="sd",
    model_class="dstune.models.sd.model:Sdxl",
    docs="docs/family-sdxl.md",
    names=r"sdxl|stable diffusion xl",
    summary="Stable Diffusion XL base (StableDiffusionXLPipeline: a UNet with text_time conditioning, two CLIP text "
    "encoders)",
    folder_classes={"StableDiffusionXLPipeline": 5.0},
    transformer_class="UNet2DConditionModel",
    pipeline_class="StableDiffusionXLPipeline",
    components={},
    unet_components=_components(("text_encoder", "CLIPTextModel"), ("text_encoder_2", "CLIPTextModelWithProjection")),
    missing_hints={"text_encoder": " (an SDXL refiner, which has no text_encoder, is not supported)"},
    text_tensors=("encoder_hidden_states", "text_embeds"),
    text_cache_folders=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    time_ids=6,
    # the original layout: UNet under model.diffusion_model., VAE under first_stage_model., the two text encoders
    # under conditioner.embedders.0. (CLIP ViT-L) and .1. (OpenCLIP ViT-bigG)
    single_file=SingleFile(
        "unet",
        ("model.diffusion_model.",),
        {
            "vae": ("first_stage_model.",),
            "text_encoder": ("conditioner.embedders.0.",),
            "text_encoder_2": ("conditioner.embedders.1.",),
        },
    ),
    checkpoint_layouts={
        "conditioner.embedders.": "an SDXL checkpoint (model.family sdxl)",
        "model.diffusion_model.label_emb.": "an SDXL checkpoint (model.family sdxl)",
    },
    # its UNet's measured cases are the unit's, listed once with SD's (builtin_sd.ACTIVATION_CASES)
    builtins={"tiny-sdxl": "dstune.models.sd.builtin_sdxl:TINY_SDXL"},
    presets=(
        ModelPreset(
            "sdxl",
            "Stable Diffusion XL base 1.0 (UNet, two CLIP text encoders)",
            "sdxl",
            "stabilityai/stable-diffusion-xl-base-1.0",
            "tiny-sdxl",
            image(1024, 5.0, 30, **{"train.optimizer.lr": 1.0e-5, "model.gradient_checkpointing": True}),
        ),
    ),
)
