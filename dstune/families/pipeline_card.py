"""What the cards of the models trained in a diffusers pipeline folder share (`PipelineCard`): the folder's parts and
classes, the text the transformer reads and how its samples take it cached, and the offline checks that validate and
start-up both run. The flow-matching cores' card types extend it: FlowCard (images, dstune.families.flow_card) and
VideoCard (clips, dstune.families.video_card); a model whose facts differ overrides a method in its own card type.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional

from dstune.card import ModelCard
from dstune.families.denoiser_facts import text_once_per_node
from dstune.families.folders import component_problems, read_model_index
from dstune.memory.working import Geometry, TextWork, VaeWork

SpecIssues = list[tuple[str, str]]  # (dotted key, message): what the spec asks that the model cannot do

# The subfolders that decide a caption's embeddings in an image pipeline (their fingerprint keys the text cache; a
# folder a model lacks adds nothing): up to three text encoders with their tokenizers, and a processor.
IMAGE_TEXT_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
IMAGE_TEXT_FOLDERS += ("processor",)


@dataclass(frozen=True, kw_only=True)
class PipelineCard(ModelCard):
    """A model trained in a diffusers pipeline folder: its trained component beside frozen companions."""

    transformer_class: str  # the trained component's class (transformer/config.json _class_name): tells the model
    pipeline_class: str  # its pipeline: encode_prompt, samples, the LoRA file's writer
    # model_index.json component -> the class it must list (None: any, a tokenizer or processor checked loosely)
    components: dict[str, Optional[str]]
    text_tensors: tuple[str, ...]  # what the text side gives per caption, and the text cache stores
    vae_class: str = "AutoencoderKL"
    text_cache_folders: tuple[str, ...] = IMAGE_TEXT_FOLDERS  # the subfolders that decide a caption's embeddings
    default_text_tokens: int = 512  # max_sequence_length when the spec leaves it out (its training example's)
    posterior_mode: bool = False  # its reference trainer takes the VAE posterior's mode, not a draw from it
    draws_sigma: bool = False  # its reference trainer draws sigma itself: no scheduler table (so no model.shift)
    # How its pipeline takes a prompt's cached text tensors in place of the prompt: what samples render from on a
    # rank that loaded no text encoder (dstune.text_once). The pipeline call's arguments -> the cached tensors ({}:
    # its samples encode their prompts, every rank keeps its encoders); with cached_text_negative the negative
    # prompt's tensors go in `negative_<argument>` too; the rows are given as cached, cut to the tokens some row uses
    # ("trimmed": the cache pads to max_sequence_length, the pipeline's own encoding to the call's longest prompt),
    # or each caption's own tokens as a list ("per_caption", a pipeline that takes unpadded embeddings).
    cached_text_arguments: dict[str, str] = field(default_factory=dict)
    cached_text_negative: bool = True
    cached_text_rows: Literal["as_cached", "trimmed", "per_caption"] = "as_cached"
    lora_formats: tuple[str, ...] = ("diffusers", "comfyui")  # output.lora_format values its LoRA loaders read
    lora_loader: str = ""  # what loads its LoRA files, named where a format is refused
    sampling_parts: tuple[str, ...] = ()  # frozen components loaded only while samples render
    # The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit, by
    # class name), as bench/working_memory.py measured them; tests/unit/test_working_memory.py checks them at another
    # size. The memory plan counts the cache's encode, the samples' decode and the text encoders' passes with them.
    working: dict[str, VaeWork | TextWork] = field(default_factory=dict)
    # text part -> the hidden states its pipeline reads of it (dstune.families.lean_text keeps only those; a part
    # not here keeps every one it is asked for)
    text_hidden_states: dict[str, tuple[int, ...]] = field(default_factory=dict)
    guidance_batch: int = 1  # 2 where its pipeline runs guidance's two halves in one batch (one sampling forward)
    builds_partitioned: ClassVar[bool] = True  # the denoiser loads partitioned under ZeRO-3 (zero.Init)
    text_once: ClassVar[bool] = True  # start-up can load its text encoders on one rank per node (text_once_per_node)

    # -------------------------------------------------------------------------------------- the folder

    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        """Why `folder` cannot be trained as this model with these model keys (empty: it can): the components,
        then, when they are all there, the configs' agreement (`config_mismatches`). Start-up runs it before loading
        anything."""
        problems = component_problems(folder, read_model_index(folder), self.components)
        return problems or self.config_mismatches(folder)

    def config_mismatches(self, folder: Path) -> list[str]:
        """Which config values of the folder's parts disagree (channels, text widths)."""
        return []

    def settings_issues(self, model_spec) -> SpecIssues:
        """The model keys this model cannot take, whatever the folder: validate and start-up both refuse them."""
        if self.draws_sigma and model_spec.shift is not None:
            return [
                (
                    "model.shift",
                    f"{self.pipeline_class}'s training example draws sigma itself, with no scheduler table to "
                    "shift: remove model.shift and move the draw with model.logit_mean / model.logit_std",
                )
            ]
        return []

    # -------------------------------------------------------------------------------------- working memory

    def hidden_states_read(self, folder) -> dict[str, tuple[int, ...]]:
        """{text part: the hidden states its pipeline reads} of this folder (`folder`: its PipelineFolder)."""
        return dict(self.text_hidden_states)

    def encoder_tokens(self, spec, folder) -> dict[str, int]:
        """{text part: a caption's tokens there}: max_sequence_length (the model's default where unset), cut to an
        encoder's positions where it has fewer (CLIP's 77) by the memory plan."""
        tokens = getattr(spec.model, "max_sequence_length", None) or self.default_text_tokens
        return {part: tokens for part in ("text_encoder", "text_encoder_2", "text_encoder_3")}

    def geometry(self, spec, folder, clips) -> Geometry:
        """What the encoders work on: stills at data.resolution's square; samples render every prompt in one call."""
        side = spec.data.resolution
        return Geometry((1, side, side), 0.0, (1, side, side), 0.0, max(len(spec.sample.prompts), 1))

    # -------------------------------------------------------------------------------------- the caches

    @property
    def samples_from_cached_text(self) -> bool:
        """Its samples render from the prompts' cached text, so with the text cache the text encoders load on one
        rank per node (dstune.families.denoiser_facts.text_once_per_node)."""
        return bool(self.cached_text_arguments)

    def text_offload_issues(self, spec) -> list[tuple[str, str]]:
        """model.text_encoder_offload runs the text encoders layer by layer for the text cache only: where they
        also run in training, for held-out evaluation or for samples (they load on every rank, and are kept), it is
        refused, with what stops it (dstune.families.denoiser_facts.text_once_per_node's reason)."""
        if getattr(spec.model, "text_encoder_offload", "none") == "none":
            return []
        why = text_once_per_node(spec, self.samples_from_cached_text) if self.text_once else "its encoders stay"
        if why is None:
            return []
        return [
            (
                "model.text_encoder_offload",
                f"text_encoder_offload {spec.model.text_encoder_offload!r} keeps the text encoders in host memory "
                f"while they build the text cache, and is for that only; here they run beyond it ({why}). Turn on "
                "data.cache.text_embeddings with the encoders loaded once per node (docs/caching.md), or remove "
                "text_encoder_offload",
            )
        ]

    def negative_caption(self) -> str:
        """The negative prompt its samples encode: cached beside the sample prompts ("" for every pipeline that
        encodes none when given none)."""
        return ""

    def text_cache_refusal(self, folder: Path) -> Optional[str]:
        """Why data.cache.text_embeddings cannot be used with this model (None: it can)."""
        return None

    def text_cache_settings(self, model_spec) -> str:
        """Part of every text entry's key: the same encoders give other tensors at another max_sequence_length."""
        return f"max_sequence_length={model_spec.max_sequence_length}"

    def latent_cache_key(self, model_spec, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """What this run stores beside each sample's VAE posterior in the latent cache: (settings text, subfolders
        whose fingerprint keys the entries, tensor names); ("", (), ()) for the posterior alone."""
        return "", (), ()
