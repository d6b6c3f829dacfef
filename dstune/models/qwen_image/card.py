"""The cards of Qwen-Image and Qwen-Image-Edit (torch-free): QwenImagePipeline and QwenImageEditPipeline folders
around QwenImageTransformer2DModel, with a Qwen2.5-VL text encoder and AutoencoderKLQwenImage. Qwen-Image trains as
diffusers' examples/dreambooth/train_dreambooth_lora_qwen_image.py; Qwen-Image-Edit on (source, target) pairs with
those loss lines (diffusers has no edit training example; docs/family-flow.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from dstune.card import ModelPreset, image, lora
from dstune.families.facts import Attention
from dstune.families.flow_card import FlowCard, edit_source_issues, joint_blocks
from dstune.families.folders import read_component_config
from dstune.families.pipeline_card import SpecIssues
from dstune.memory.working import TextWork, VaeWork

TEXT_TENSORS = ("encoder_hidden_states", "encoder_attention_mask")
NEGATIVE = " "  # the negative prompt of true classifier-free guidance, as the model card samples
EDIT_PIPELINE = "QwenImageEditPipeline"
EDIT_PLUS_PIPELINE = "QwenImageEditPlusPipeline"  # Qwen-Image-Edit-2509 / 2511: several references per sample
# QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE: each reference joins the text resized to this area (its own
# aspect ratio, sides multiples of 32), whatever its size
CONDITION_PX = 384
PLUS_MOST_REFERENCES = 3  # the 2509 model card: multi-image editing with 1 to 3 input images
PICTURE_LABEL_TOKENS = 8  # "Picture k: " and the vision start / end tokens around each reference in the text
VISION_PATCH_PX = 28  # the edit's source image joins the text as Qwen2.5-VL vision tokens of 28 px
# the pipelines' prompt templates, cropped after the text encoder (prompt_template_encode_start_idx): the encoder
# runs over them too
TEMPLATE_TOKENS, EDIT_TEMPLATE_TOKENS = 34, 64


def qwen_config_mismatches(folder: Path) -> list[str]:
    """The transformer's channels and text width against the VAE's and the text encoder's."""
    transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
    text = read_component_config(folder, "text_encoder")
    width = (text.get("text_config") or {}).get("hidden_size", text.get("hidden_size"))
    checks = [
        ("in_channels", 4 * vae.get("z_dim", 16)),
        ("out_channels", vae.get("z_dim", 16)),
        ("joint_attention_dim", width),
    ]
    return [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
        for key, want in checks
        if transformer.get(key) != want
    ]


@dataclass(frozen=True, kw_only=True)
class QwenImageCard(FlowCard):
    def config_mismatches(self, folder: Path) -> list[str]:
        return qwen_config_mismatches(folder)

    def encoder_tokens(self, spec, folder) -> dict[str, int]:
        return {"text_encoder": self.text_tokens(spec, folder) + TEMPLATE_TOKENS}

    def negative_caption(self) -> str:
        return NEGATIVE


@dataclass(frozen=True, kw_only=True)
class QwenImageEditCard(FlowCard):
    """An edit model: trained on (source, target) pairs, the source image's vision tokens in its text."""

    def config_mismatches(self, folder: Path) -> list[str]:
        return qwen_config_mismatches(folder)

    def negative_caption(self) -> str:
        return NEGATIVE

    def text_tokens(self, spec, folder) -> int:
        return super().text_tokens(spec, folder) + int((spec.data.resolution / VISION_PATCH_PX) ** 2)

    def encoder_tokens(self, spec, folder) -> dict[str, int]:
        return {"text_encoder": self.text_tokens(spec, folder) + EDIT_TEMPLATE_TOKENS}

    def pictures(self, spec, folder) -> int:
        return 2

    def pairs(self, spec) -> Optional[str]:
        return EDIT_PIPELINE

    def text_cache_refusal(self, folder: Path) -> Optional[str]:
        return (
            "data.cache.text_embeddings: Qwen-Image-Edit encodes each instruction together with its source image "
            "(the image's vision tokens are part of the text sequence), so an embedding belongs to a (caption, "
            "image) pair, not to a caption, and its length changes with the image. Set "
            "data.cache.text_embeddings: false; data.cache.latents still caches the target and source latents."
        )

    def source_image_issues(self, spec) -> SpecIssues:
        """It cannot cache its text (an embedding belongs to a caption and its source image) and samples from
        source images (sample.control_images): said by validate, before any GPU time."""
        issues = []
        if spec.data.cache.text_embeddings:
            issues.append(
                (
                    "data.cache.text_embeddings",
                    f"{self.pipeline_class} encodes each instruction together with its source image(s), so its text "
                    "cannot be cached per caption: set it to false (data.cache.latents still caches the target and source "
                    "latents)",
                )
            )
        return issues + edit_source_issues(spec, self.pipeline_class)

    def attention(self, spec) -> Optional[Attention]:
        """Its sequence holds the target's and the source's tokens; its text (the instruction with the source's
        vision tokens) has no fixed length: the split pads it with masked tokens, so it sets no rule."""
        found = super().attention(spec)
        if found is None or found.refusal:
            return found
        return replace(found, text_tokens=0)


@dataclass(frozen=True, kw_only=True)
class QwenImageEditPlusCard(QwenImageEditCard):
    """Qwen-Image-Edit-2509 / 2511: trained on a target and several references (data.control_dir a list), each
    reference's latent tokens after the target's and its vision tokens (at CONDITION_PX) in the text."""

    def references(self, spec) -> int:
        return len(spec.data.control_dirs) or 1

    def most_references(self) -> int:
        return PLUS_MOST_REFERENCES

    def text_tokens(self, spec, folder) -> int:
        per_reference = int((CONDITION_PX / VISION_PATCH_PX) ** 2) + PICTURE_LABEL_TOKENS
        return FlowCard.text_tokens(self, spec, folder) + self.references(spec) * per_reference

    def pictures(self, spec, folder) -> int:
        return 1 + self.references(spec)

    def pairs(self, spec) -> Optional[str]:
        return EDIT_PLUS_PIPELINE

    def reference_size(self, index: dict) -> Optional[str]:
        """Each reference at its own size: QwenImageEditPlusPipeline resizes every input image to a fixed area at
        its own aspect ratio (calculate_dimensions), and DiffSynth-Studio trains 2509 / 2511 so
        (edit_image_auto_resize)."""
        return "own" if super().reference_size(index) else None


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLQwenImage": VaeWork(
        encode=20.5, encode_fixed=536.0, decode=36.292, decode_fixed=536.0, measured_on="hub/Qwen/Qwen-Image/vae"
    ),
    "Qwen2_5_VLForConditionalGeneration": TextWork(
        hidden=6.0,
        ffn=6.0,
        token=68.7,
        square=0.969,
        pass_square=0.054,
        measured_on="builtin/tiny-qwen-image-v1/text_encoder",
    ),
}


COMMON = dict(
    working=WORKING_MEMORY,
    text_hidden_states={"text_encoder": (-1,)},  # the last, of Qwen-Image's and the edit's Qwen2.5-VL
    family="flow",
    unit="qwen_image",
    docs="docs/family-flow.md",
    names=r"qwen-image(?![\s-]?2)|qwen_image(?!_?21)",
    transformer_class="QwenImageTransformer2DModel",
    vae_class="AutoencoderKLQwenImage",
    text_tensors=TEXT_TENSORS,
    activations="qwen-image",
    activation_shape=joint_blocks,
    text_width_key="joint_attention_dim",
    spec_notes={"model.max_sequence_length": "512 (Qwen-Image, Qwen-Image-Edit)"},
    activation_cases="dstune.models.qwen_image.builtin:ACTIVATION_CASES",
)

QWEN_IMAGE_CARD = QwenImageCard(
    key="qwen_image",
    name="Qwen-Image",
    model_class="dstune.models.qwen_image.model:QwenImage",
    summary="Qwen-Image (QwenImageTransformer2DModel; Qwen2.5-VL)",
    folder_classes={"QwenImagePipeline": 4.0},
    pipeline_class="QwenImagePipeline",
    components={"text_encoder": "Qwen2_5_VLForConditionalGeneration", "tokenizer": None},
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states", "prompt_embeds_mask": "encoder_attention_mask"},
    cached_text_rows="trimmed",
    builtins={"tiny-qwen-image": "dstune.models.qwen_image.builtin:TINY_QWEN_IMAGE"},
    presets=(
        ModelPreset(
            "qwen-image",
            "Qwen-Image (20 B MMDiT; Qwen2.5-VL text encoder)",
            "flow",
            "Qwen/Qwen-Image",
            "tiny-qwen-image",
            image(1328, 4.0, 30, **lora(), **{"model.max_sequence_length": 512, "model.gradient_checkpointing": True}),
        ),
    ),
    **COMMON,
)

QWEN_IMAGE_EDIT_CARD = QwenImageEditCard(
    key="qwen_image_edit",
    name="Qwen-Image-Edit",
    model_class="dstune.models.qwen_image.model:QwenImageEdit",
    summary="Qwen-Image-Edit (QwenImageTransformer2DModel; Qwen2.5-VL with the source image; trains on source/target "
    "pairs, see data.control_dir)",
    folder_classes={EDIT_PIPELINE: 4.0},
    pipeline_class=EDIT_PIPELINE,
    components={"text_encoder": "Qwen2_5_VLForConditionalGeneration", "tokenizer": None, "processor": None},
    builtins={"tiny-qwen-image-edit": "dstune.models.qwen_image.builtin_edit:TINY_QWEN_IMAGE_EDIT"},
    presets=(
        ModelPreset(
            "qwen-image-edit",
            "Qwen-Image-Edit (Qwen-Image trained to edit a source image)",
            "flow",
            "Qwen/Qwen-Image-Edit",
            "tiny-qwen-image-edit",
            image(
                1024,
                4.0,
                30,
                **lora(),
                **{
                    "data.path": "/data/edits/target",
                    "data.control_dir": "../source",
                    "sample.prompts": [],
                    "model.gradient_checkpointing": True,
                },
            ),
        ),
    ),
    **COMMON,
)

QWEN_IMAGE_EDIT_PLUS_CARD = QwenImageEditPlusCard(
    key="qwen_image_edit_plus",
    name="Qwen-Image-Edit-2509/2511",
    model_class="dstune.models.qwen_image.model:QwenImageEditPlus",
    summary="Qwen-Image-Edit-2509 / 2511 (QwenImageTransformer2DModel; Qwen2.5-VL with the references; trains on a "
    "target and up to 3 references per sample, see data.control_dir)",
    folder_classes={EDIT_PLUS_PIPELINE: 4.0},
    pipeline_class=EDIT_PLUS_PIPELINE,
    components={"text_encoder": "Qwen2_5_VLForConditionalGeneration", "tokenizer": None, "processor": None},
    builtins={"tiny-qwen-image-edit-plus": "dstune.models.qwen_image.builtin_edit:TINY_QWEN_IMAGE_EDIT_PLUS"},
    presets=(
        ModelPreset(
            "qwen-image-edit-2509",
            "Qwen-Image-Edit-2509 (Qwen-Image trained to edit from 1 to 3 reference images)",
            "flow",
            "Qwen/Qwen-Image-Edit-2509",
            "tiny-qwen-image-edit-plus",
            image(
                1024,
                4.0,
                30,
                **lora(),
                **{
                    "data.path": "/data/edits/target",
                    "data.control_dir": ["../person", "../scene"],
                    "sample.prompts": [],
                    "model.gradient_checkpointing": True,
                },
            ),
        ),
    ),
    **COMMON,
)
