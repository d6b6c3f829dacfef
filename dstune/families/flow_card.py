"""The card of a flow-matching image model (`model.family flow`, FlowCard): its pipeline folder (PipelineCard) and what
validate, the memory plan and start-up know of it without torch, as methods a model overrides where it differs.

Image tokens are 2x2 latent patches (16 px at the real models' 8x VAEs; the sequence split reads the VAE config for
its token counts); text tokens join them. `card_of_folder` tells a folder's model among the family's cards: by its
transformer class, then (models that share one) its pipeline class or its text encoder's class.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Sequence

from dstune.families.base import FamilyError
from dstune.families.denoiser_facts import (
    PipelineFolder,
    count_denoiser,
    image_latent_bytes,
    pipeline_folder,
    side_issues,
    transformer_text_bytes,
)
from dstune.spec.reference_sizes import own_area_bound
from dstune.families.facts import Attention, no_plan_refusal
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.pipeline_card import PipelineCard, SpecIssues
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes
from dstune.memory.counts import SizesUnknown, count_component, vae_factor
from dstune.memory.working import Geometry
from dstune.model_folders import builtin_name_problem, locate

TOKEN_PATCH = 2  # latent rows (and columns) one image token packs: 2x2 for every flow image model here


class ShapeFunction(Protocol):
    def __call__(self, config: dict) -> ModelShape:  # the transformer config -> the shape its constants take
        ...


def two_streams(config: dict) -> ModelShape:
    """Joint (two-stream) and single-stream blocks of heads x head_dim."""
    return ModelShape(
        config["num_attention_heads"] * config["attention_head_dim"],
        {
            "transformer_blocks": config.get("num_layers", 0),
            "single_transformer_blocks": config.get("num_single_layers", 0),
        },
    )


def joint_blocks(config: dict) -> ModelShape:
    """Joint (two-stream) blocks only."""
    return ModelShape(
        config["num_attention_heads"] * config["attention_head_dim"],
        {"transformer_blocks": config.get("num_layers", 0)},
    )


@dataclass(frozen=True, kw_only=True)
class FlowCard(PipelineCard):
    """A flow-matching image transformer's card (see the module docstring)."""

    activations: str  # its key in the measured activation constants (dstune/model_configs/activation_constants.json)
    activation_shape: ShapeFunction  # the width and blocks the constants are evaluated at
    text_width_key: str  # the transformer config's key for the text embeddings' width

    # ------------------------------------------------------------------------------------- the folder

    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        """The components (the VAE and the scheduler too), then the configs' agreement."""
        index = read_model_index(folder)
        problems = component_problems(folder, index, self.components)
        problems += [f"missing subfolder {name}/" for name in ("vae", "scheduler") if not (folder / name).is_dir()]
        return problems or self.config_mismatches(folder)

    # ------------------------------------------------------------------------------------- memory

    def text_tokens(self, spec, folder: PipelineFolder) -> int:
        """Text tokens per sample: max_sequence_length (the model's default where unset)."""
        return spec.model.max_sequence_length or self.default_text_tokens

    def encoder_tokens(self, spec, folder: PipelineFolder) -> dict[str, int]:
        """Every text encoder at the caption's tokens (text_tokens; CLIP's at its 77 positions)."""
        tokens = self.text_tokens(spec, folder)
        return {part: tokens for part in ("text_encoder", "text_encoder_2", "text_encoder_3")}

    def geometry(self, spec, folder: PipelineFolder, clips) -> Geometry:
        """Stills at data.resolution's square (an edit model's source is an entry of its own); samples render every
        prompt in one call, an edit model's one prompt a call (flow_sampling)."""
        side = spec.data.resolution
        per_call = 1 if self.pictures(spec, folder) > 1 else max(len(spec.sample.prompts), 1)
        return Geometry((1, side, side), 0.0, (1, side, side), 0.0, per_call)

    def pictures(self, spec, folder: PipelineFolder) -> int:
        """The pictures in one sample's sequence (an edit model's target and source: 2)."""
        return 1

    def picture_areas(self, spec, folder: PipelineFolder) -> float:
        """The pictures of one sample's sequence in target areas: pictures(), each reference at its own size
        (data.reference_size own) counted at the most pixels its rule gives (dstune.spec.reference_sizes.own_area_bound)."""
        pictures = self.pictures(spec, folder)
        if pictures == 1 or spec.data.reference_size != "own":
            return pictures
        side = spec.data.resolution
        return 1 + (pictures - 1) * own_area_bound(side) / side**2

    def pad_tokens(self, tokens: float) -> float:
        """What the transformer pads a sequence of `tokens` tokens to."""
        return tokens

    def trained(self, spec, folder: PipelineFolder) -> tuple:
        """(the trained component, {frozen part loaded only while samples render: parameters}, no expert). With
        sample.pretrained (or a training adapter: the clean base) a second transformer joins the samples."""
        sampling_only = {
            part: count_component(str(folder.path / part / "config.json"))[0] for part in self.sampling_parts
        }
        if spec.sample.prompts and (spec.sample.pretrained or getattr(spec.model, "training_adapter", None)):
            sampling = pipeline_folder(spec.sample.pretrained) if spec.sample.pretrained else folder
            sampling_only["transformer (samples)"] = count_component(
                str(sampling.path / "transformer" / "config.json")
            )[0]
        return "transformer", sampling_only, None

    def activation_bytes(self, spec, folder: PipelineFolder, config: dict, clips) -> tuple[float, float]:
        """The measured constants over its image tokens (2x2 latent patches, 16 px; every picture's) and its text
        tokens."""
        image_tokens = self.pad_tokens(self.picture_areas(spec, folder) * (spec.data.resolution / 16) ** 2)
        sample = measured_sample_bytes(
            self.activations,
            self.activation_shape(config),
            image_tokens,
            self.pad_tokens(self.text_tokens(spec, folder)),
            spec.train.precision,
        )
        return in_plan_units(sample, spec.train.precision)

    def text_width(self, config: dict) -> int:
        """The width of one cached text token: the transformer config's text width."""
        return config.get(self.text_width_key)

    def cache_bytes(self, spec, folder: PipelineFolder, companions: dict, num_samples: int, clips) -> int:
        per_sample = image_latent_bytes(spec, folder, companions, self.picture_areas(spec, folder))
        if folder.has("transformer"):
            width = self.text_width(folder.config("transformer"))
            per_sample += transformer_text_bytes(spec, folder, self.text_tokens(spec, folder), width)
        return per_sample * num_samples

    def uses_image_encoder(self, spec, folder: PipelineFolder) -> bool:
        return False

    def count(self, spec, num_samples: int, clips: Sequence = ()):
        """The transformer, its companions, one sample's activations and the cache size (ModelCounts)."""
        return count_denoiser(spec, num_samples, clips, self)

    # ------------------------------------------------------------------------------------- validate

    def pairs(self, spec) -> Optional[str]:
        """The pipeline class when the model trains on (source, target) pairs (validate then checks the data gives
        them), else None."""
        return None

    def side_px(self) -> int:
        """Image sides must be multiples of it, said by validate (0: the VAE's factor x the latent rows a token
        packs)."""
        return 0

    def spec_issues(self, spec) -> SpecIssues:
        """What start-up would refuse of this spec, found offline: the model keys, the image sides, a distilled
        folder's sampling steps, the sample folder and the LoRA format."""
        issues = self.settings_issues(spec.model) or self._side_issues(spec) or self._steps_issues(spec)
        issues = issues or self.source_image_issues(spec) or self.reference_count_issues(spec)
        return issues + _sample_folder_issues(spec) + self._lora_format_issues(spec) + self.text_offload_issues(spec)

    def _side_issues(self, spec) -> SpecIssues:
        """Image sides the model cannot take: side_px, or the VAE config's spatial factor x the latent rows a token
        packs (an 8x VAE and 2x2 patches: multiples of 16 px)."""
        side = self.side_px()
        if not side:
            try:
                side = vae_factor(pipeline_folder(spec.model.pretrained).config("vae")) * TOKEN_PATCH
            except (SizesUnknown, OSError, ValueError):  # unknown here: startup checks the first batch itself
                return []
        return side_issues(spec, side, f"{self.name} takes image sides in multiples of {side} px")

    def _steps_issues(self, spec) -> SpecIssues:
        """A distilled (Turbo) folder's own sampling sigmas fix sample.steps."""
        try:
            index = pipeline_folder(spec.model.pretrained).index
        except (SizesUnknown, OSError, ValueError):  # unknown here: startup checks the folder itself
            return []
        grid = index.get("sample_sigmas")
        if grid and spec.sample.prompts and spec.sample.steps != len(grid):
            return [
                (
                    "sample.steps",
                    f"{self.pipeline_class} samples this folder on its own {len(grid)} sigmas "
                    f"(model_index.json sample_sigmas, a Turbo folder): set sample.steps: {len(grid)}",
                )
            ]
        return []

    def most_references(self) -> int:
        """The reference images one sample may carry (data.control_dir's folders, a prompt's
        sample.control_images): one here."""
        return 1

    def reference_count_issues(self, spec) -> SpecIssues:
        """data.control_dir's folders and each prompt's sample.control_images against the references a sample of
        this model takes (a reference it cannot take would be left out of training silently)."""
        folders, most = len(spec.data.control_dirs), self.most_references()
        if folders > most:
            return [
                (
                    "data.control_dir",
                    f"{self.pipeline_class} takes {most} reference image(s) per sample; data.control_dir lists "
                    f"{folders} folders. Give at most {most} (docs/data.md names the models that take several)",
                )
            ]
        wanted = max(folders, 1)
        for number, one in enumerate(spec.sample.control_images):
            given = 1 if isinstance(one, str) else len(one)
            if given != wanted or (most == 1 and not isinstance(one, str)):
                return [
                    (
                        f"sample.control_images.{number}",
                        f"{given} image(s) for prompt {number + 1}, but {self.pipeline_class} trains here with "
                        f"{wanted} reference(s) per sample: give "
                        + (
                            "one path per prompt"
                            if wanted == 1
                            else f"a list of {wanted} paths per prompt, in data.control_dir's order"
                        ),
                    )
                ]
        return []

    def source_image_issues(self, spec) -> SpecIssues:
        """data.control_dir and sample.control_images against what the model trains and renders from: a
        text-to-image model takes neither (its training would silently leave the sources out)."""
        issues = []
        if spec.data.control_dir is not None:
            issues.append(
                (
                    "data.control_dir",
                    f"{self.pipeline_class} trains from the caption alone: source (control) images are for the edit "
                    "models (docs/family-flow.md lists them); remove data.control_dir",
                )
            )
        if spec.sample.control_images:
            issues.append(
                (
                    "sample.control_images",
                    f"{self.pipeline_class} renders from the prompt alone: source images are for edit models; remove "
                    "them",
                )
            )
        return issues

    def _lora_format_issues(self, spec) -> SpecIssues:
        """A LoRA file format whose tool is not known to map this model's keys."""
        chosen = spec.output.lora_format
        if chosen is None or chosen in self.lora_formats:
            return []
        return [
            (
                "output.lora_format",
                f"{chosen!r} writes diffusers' key names, which {chosen}'s {self.name} loader is not known to map; "
                f"{self.name} LoRAs are written as {', '.join(self.lora_formats)} ({self.lora_loader}): remove "
                "output.lora_format or set it to diffusers",
            )
        ]

    def attention(self, spec) -> Optional[Attention]:
        """The transformer's heads, its image tokens' geometry (the VAE config's spatial factor x the 2x2 latent
        patch a token packs) and the text tokens its context-parallel plan splits with the image's (a plan that
        splits both streams pads the text to max_sequence_length); a refusal for a transformer class without a
        context-parallel plan."""
        try:
            folder = pipeline_folder(spec.model.pretrained)
            config = folder.config("transformer")
            px_per_token = vae_factor(folder.config("vae")) * TOKEN_PATCH
        except (SizesUnknown, OSError, ValueError):
            return None
        origin = f"the transformer config of {folder.origin}"
        no_plan = no_plan_refusal(self.transformer_class)
        if no_plan:  # whatever its config says of heads, nothing can split it
            return Attention(0, 0, origin, no_plan)
        heads = config.get("num_attention_heads")
        if not isinstance(heads, int):
            return None
        return Attention(
            heads,
            config.get("attention_head_dim", 0),
            origin,
            text_tokens=self.text_tokens(spec, folder),
            px_per_token=px_per_token,
            pictures=self.picture_areas(spec, folder),
        )


# ----------------------------------------------------------------------------------------- which model


def card_of_folder(cards: Sequence[FlowCard], folder: Path) -> FlowCard:
    """The card of the model a flow pipeline folder holds; FamilyError naming what is unsupported or missing."""
    index = read_model_index(folder)
    supported = ", ".join(f"{card.transformer_class} ({card.pipeline_class})" for card in cards)
    if not (folder / "transformer").is_dir():
        hint = " (a UNet pipeline: use model.family sd)" if "unet" in index else ""
        raise FamilyError(f"{folder} has no transformer/ subfolder{hint}; model.family 'flow' trains {supported}.")
    transformer_class = read_component_config(folder, "transformer").get("_class_name")
    candidates = [card for card in cards if card.transformer_class == transformer_class]
    if not candidates:
        raise FamilyError(
            f"{folder / 'transformer'}: {transformer_class} is not supported by model.family 'flow'; "
            f"supported transformers: {supported}."
        )
    return pick_by_pipeline(folder, index, candidates)


def pick_by_pipeline(folder: Path, index: dict, cards: Sequence[PipelineCard]) -> PipelineCard:
    """Among the cards of one transformer class: the one of the folder's pipeline class; else the one of its text
    encoder class where that tells them apart; else, for a transformer with one model, that one (whose folder
    check then lists every part that does not fit). Where two models share the text encoder class too, another
    pipeline around that transformer (a newer edit pipeline, say) is refused rather than trained as either."""
    pipeline_class = index.get("_class_name")
    for card in cards:
        if pipeline_class in card.folder_classes:
            return card
    entry = index.get("text_encoder")
    encoder = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    by_encoder = [card for card in cards if card.components.get("text_encoder") == encoder]
    if len(by_encoder) == 1:
        return by_encoder[0]
    if len(cards) == 1:
        return cards[0]
    raise FamilyError(
        f"{folder / 'model_index.json'}: a {pipeline_class} around a {cards[0].transformer_class} is not supported; "
        f"model.family 'flow' trains that transformer in {', '.join(c.pipeline_class for c in cards)} folders."
    )


def card_of_configs(cards: Sequence[FlowCard], folder: PipelineFolder) -> FlowCard:
    """The card of a folder known by its configs only (validate: a hub id not downloaded, a built-in's stored
    configs); SizesUnknown naming the known transformers when none fits."""
    transformer = (folder.index.get("transformer") or [None, None])[1]
    candidates = [card for card in cards if card.transformer_class == transformer]
    if not candidates:
        known = ", ".join(dict.fromkeys(card.transformer_class for card in cards))
        raise SizesUnknown(
            f"{folder.origin}: its transformer {transformer} is none of the flow models dstune trains ({known})"
        )
    pipeline = folder.index.get("_class_name")
    return next((card for card in candidates if pipeline in card.folder_classes), candidates[0])


def card_of_reference(cards: Sequence[FlowCard], pretrained: str) -> FlowCard:
    """The card of the model `pretrained` (a folder, hub id or built-in) holds, from its configs; SizesUnknown when
    they are not here or name none of the family's models."""
    return card_of_configs(cards, pipeline_folder(pretrained))


def unknown_model(cards: Sequence[FlowCard], spec, raising: bool) -> SpecIssues:
    """Of a flow folder whose model is not known here validate says nothing (start-up checks the folder itself);
    the plan cannot count it: SizesUnknown with the reason."""
    if raising:
        card_of_reference(cards, spec.model.pretrained)  # raises SizesUnknown saying why
    return []


# ----------------------------------------------------------------------------------------- sample.pretrained

_CONFIG_BOOKKEEPING = ("_name_or_path", "_diffusers_version", "_class_name")


def sampling_folder_problems(trained_index: dict, trained: dict, other_index: dict, other: dict) -> list[str]:
    """Why a folder (model_index.json, transformer config) cannot render the LoRA trained on another: another
    pipeline or transformer class, or other shapes (any transformer config value but bookkeeping). Torch-free:
    validate asks it of sample.pretrained, startup again of the folders it loads."""
    problems = []
    if trained_index.get("_class_name") != other_index.get("_class_name"):
        problems.append(
            f"it is a {other_index.get('_class_name')} folder; the trained model is a {trained_index.get('_class_name')}"
        )
    if trained.get("_class_name") != other.get("_class_name"):
        problems.append(
            f"its transformer is a {other.get('_class_name')}; the trained one a {trained.get('_class_name')}"
        )
        return problems
    differ = sorted(
        key
        for key in set(trained) | set(other)
        if key not in _CONFIG_BOOKKEEPING and trained.get(key) != other.get(key)
    )
    if differ:
        problems.append(
            "its transformer has other shapes: "
            + ", ".join(f"{key} {other.get(key)} (trained: {trained.get(key)})" for key in differ[:4])
        )
    return problems


def _sample_folder_issues(spec) -> SpecIssues:
    """sample.pretrained against model.pretrained, from their configs (found here: checked again at startup)."""
    if not spec.sample.pretrained:
        return []
    where = locate(spec.sample.pretrained)
    if where.kind == "unknown-builtin":
        return [("sample.pretrained", builtin_name_problem(spec.sample.pretrained))]
    if where.kind == "missing":
        return [
            (
                "sample.pretrained",
                f"{where.path} does not exist: give a pipeline folder of the trained model (its distilled checkpoint), "
                "a hub id in the local cache, or builtin:NAME",
            )
        ]
    try:
        trained, other = pipeline_folder(spec.model.pretrained), pipeline_folder(spec.sample.pretrained)
        problems = sampling_folder_problems(
            trained.index, trained.config("transformer"), other.index, other.config("transformer")
        )
    except (SizesUnknown, OSError, ValueError):
        return []
    if not problems:
        return []
    return [
        (
            "sample.pretrained",
            f"{spec.sample.pretrained} cannot render the LoRA trained on {spec.model.pretrained}: "
            + "; ".join(problems),
        )
    ]


def edit_source_issues(spec, pipeline_class: str) -> SpecIssues:
    """What an edit model (trained on source/target pairs) needs of the samples: a source image per prompt."""
    issues = []
    if spec.sample.prompts and not spec.sample.control_images:
        issues.append(
            (
                "sample.prompts",
                f"{pipeline_class} renders from a source image: give sample.control_images, one source image per "
                "prompt, or set sample.prompts: []",
            )
        )
    return issues + control_images_missing(spec)


def control_images_missing(spec) -> SpecIssues:
    """sample.control_images that do not exist (an edit model's sources, an image-to-video model's first frames)."""
    missing = [path for path in spec.sample.control_image_paths if not os.path.isfile(os.path.expanduser(path))]
    if not missing:
        return []
    return [("sample.control_images", f"{len(missing)} source image(s) do not exist: {', '.join(missing)}")]
