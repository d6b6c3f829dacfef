"""What the cards of the UNet models share (`UnetCard`, torch-free): a diffusers pipeline folder whose UNet trains
beside a VAE and CLIP text encoders, each model the whole of its `model.family`. What validate, the memory plan and
start-up know of one: the folder's components and configs, the text cache, its single-file checkpoint layout, and
the UNet's activations (the measured constants of its structure). A model's card type (one level below) adds the
checks of its own configs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from dstune import registry
from dstune.families.denoiser_facts import count_denoiser, embedding_width_bytes, image_latent_bytes
from dstune.families.folders import read_model_index
from dstune.families.pipeline_card import PipelineCard
from dstune.memory.activations import (
    ModelShape,
    figure_kind,
    in_plan_units,
    measured_sample_bytes,
    measured_unet,
    unet_sample_bytes,
)

CLIP_TOKENS = 77  # every CLIP text encoder's context
CLIP_TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast")
# Pipelines people mistake for a UNet one that no card names: two transformers dstune does not train
UNTRAINED_LOOKALIKES = {"PixArtSigmaPipeline": "PixArt", "PixArtAlphaPipeline": "PixArt", "SanaPipeline": "Sana"}
# component -> (accepted classes, or None for any; the file its subfolder must hold)
UnetComponents = dict[str, tuple[Optional[tuple[str, ...]], str]]


@dataclass(frozen=True)
class SingleFile:
    """A UNet pipeline's single-checkpoint-file layout (dstune.card.SingleFileLayout)."""

    denoiser: str
    denoiser_prefixes: tuple[str, ...]
    companions: dict


def unet_components(*text_encoders: tuple[str, str]) -> UnetComponents:
    """A UNet pipeline's components: the UNet, the VAE, each (text encoder, its class) with a CLIP tokenizer, the
    scheduler."""
    parts = {"unet": (("UNet2DConditionModel",), "config.json"), "vae": (("AutoencoderKL",), "config.json")}
    for encoder, encoder_class in text_encoders:
        parts[encoder] = ((encoder_class,), "config.json")
    for encoder, _ in text_encoders:
        parts[encoder.replace("text_encoder", "tokenizer")] = (CLIP_TOKENIZERS, "tokenizer_config.json")
    return {**parts, "scheduler": (None, "scheduler_config.json")}


@dataclass(frozen=True, kw_only=True)
class UnetCard(PipelineCard):
    """A UNet pipeline's card (see the module docstring)."""

    unet_components: UnetComponents
    single_file: SingleFile  # the original single-checkpoint-file layout (what from_single_file reads)
    # its CLIP encoders are small: every rank keeps its own (no text_once_per_node)
    text_once: ClassVar[bool] = False

    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        index = read_model_index(folder)
        kind = index.get("_class_name")
        if kind is not None and kind not in self.folder_classes:
            return [f"it holds a {kind} ({lookalike(kind)}); model.family {self.family} trains {self.summary}"]
        problems = self.component_problems(folder, index)
        return problems or self.config_mismatches(folder)

    def component_problems(self, folder: Path, index: dict) -> list[str]:
        """What keeps the components of the folder from loading: each listed with an accepted class, its subfolder
        holding its required file."""
        problems = []
        for name, (classes, required_file) in self.unet_components.items():
            entry = index.get(name)
            listed = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
            if listed is None:
                problems.append(f"model_index.json has no `{name}` component{self.missing_hint(name)}")
            elif classes is not None and listed not in classes:
                problems.append(f"`{name}` is a {listed}; expected {' or '.join(sorted(classes))}")
            if not (folder / name).is_dir():
                problems.append(f"missing subfolder {name}/")
            elif not (folder / name / required_file).is_file():
                problems.append(f"missing {name}/{required_file}")
        return problems

    def missing_hint(self, component: str) -> str:
        """Why a folder may lack `component` (appended to the problem), or ""."""
        return ""

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
        """The measured constants of the UNet structure the config has (any width), over the latent pixels
        (resolution / 8 squared) and the 77 CLIP tokens; a UNet of another structure (the built-in tiny ones): the
        generic formula (dstune.memory.activations.unet_sample_bytes)."""
        key = measured_unet(config)
        if key is None or figure_kind() == "offload":  # the measured UNets' tables keep no per-block inputs apart
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


def lookalike(pipeline: str) -> str:
    """What a pipeline class another model trains (or no dstune model) is."""
    owner = next((card for card in registry.cards() if pipeline in card.folder_classes), None)
    if owner is not None:
        return f"{owner.name}: use model.family: {owner.family}"
    return UNTRAINED_LOOKALIKES.get(pipeline, "not a model dstune trains")


def latent_channel_problems(unet: dict, vae: dict) -> list[str]:
    if unet.get("in_channels") != vae.get("latent_channels", 4):
        return [
            f"unet in_channels {unet.get('in_channels')} != vae latent_channels "
            f"{vae.get('latent_channels', 4)} (inpainting UNets are not supported)"
        ]
    return []
