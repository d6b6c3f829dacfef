"""Qwen-Image 2.1's card (torch-free): QwenImage21Pipeline folders (QwenImage21Transformer2DModel, a Qwen3-VL text
encoder with its processor, the 16x RGBA AutoencoderKLQwenImage21), trained as diffusers'
examples/dreambooth/train_dreambooth_lora_qwenimage21.py trains it; a Turbo folder (model_index.json's
sample_sigmas) trains the same and samples on its own sigmas."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dstune.card import ModelPreset, image, lora
from dstune.families.flow_card import FlowCard
from dstune.families.folders import read_component_config
from dstune.memory.activations import ModelShape
from dstune.memory.working import TextWork, VaeWork

NEGATIVE = " "  # the negative prompt of true classifier-free guidance, as the model card samples
SIDE_PX = 32  # 16x VAE, 2x2 latents per image slot


def one_stream_ratio(config: dict) -> ModelShape:
    """One stream of blocks over the caption and the image tokens, its MLP mlp_ratio x the width."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return ModelShape(width, {"transformer_blocks": config["num_layers"]}, ffn=config.get("mlp_ratio", 3) * width)


@dataclass(frozen=True, kw_only=True)
class QwenImage21Card(FlowCard):
    def config_mismatches(self, folder: Path) -> list[str]:
        transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
        text = read_component_config(folder, "text_encoder")
        width = (text.get("text_config") or {}).get("hidden_size", text.get("hidden_size"))
        checks = [
            ("in_channels", vae.get("z_dim", 64)),
            ("out_channels", vae.get("z_dim", 64)),
            ("context_in_dim", width),
            ("patch_size", 1),
        ]
        return [
            f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs; 2.1 reads "
            "latents unpatched)"
            for key, want in checks
            if transformer.get(key) != want
        ]

    def negative_caption(self) -> str:
        return NEGATIVE

    def side_px(self) -> int:
        return SIDE_PX


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLQwenImage21": VaeWork(encode=22.5, decode=67.146, measured_on="hub/Qwen/Qwen-Image-2.1/vae"),
    "Qwen3VLForConditionalGeneration": TextWork(
        hidden=8.0,
        ffn=6.0,
        token=36.7,
        square=0.969,
        pass_square=0.054,
        measured_on="builtin/tiny-qwen-image-21-v1/text_encoder",
    ),
}


QWEN_IMAGE_21_CARD = QwenImage21Card(
    working=WORKING_MEMORY,
    text_hidden_states={"text_encoder": (-1,)},  # QwenImage21Pipeline reads the last
    key="qwen_image_21",
    name="Qwen-Image 2.1",
    family="flow",
    unit="qwen_image_21",
    model_class="dstune.models.qwen_image_21.model:QwenImage21",
    docs="docs/family-flow.md",
    names=r"qwen-image[\s-]?2\.1|qwen_?image_?21\w*|qwen21",
    summary="Qwen-Image 2.1 and its Turbo (QwenImage21Transformer2DModel; Qwen3-VL)",
    folder_classes={"QwenImage21Pipeline": 1.0},
    transformer_class="QwenImage21Transformer2DModel",
    pipeline_class="QwenImage21Pipeline",
    components={"text_encoder": "Qwen3VLForConditionalGeneration", "processor": None},
    vae_class="AutoencoderKLQwenImage21",
    text_tensors=("encoder_hidden_states", "encoder_attention_mask"),
    default_text_tokens=512,  # the example sets no limit; a caption's tokens after the dropped system prompt
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states", "prompt_embeds_mask": "encoder_attention_mask"},
    cached_text_rows="trimmed",
    activations="qwen-image-21",
    activation_shape=one_stream_ratio,
    text_width_key="context_in_dim",
    spec_notes={
        "model.max_sequence_length": "512 (Qwen-Image 2.1: its example sets no limit; a longer caption is refused, "
        "naming it)"
    },
    activation_cases="dstune.models.qwen_image_21.builtin:ACTIVATION_CASES",
    builtins={"tiny-qwen-image-21": "dstune.models.qwen_image_21.builtin:TINY_QWEN_IMAGE_21"},
    presets=(
        ModelPreset(
            "qwen-image-21",
            "Qwen-Image 2.1 (7 B single-stream transformer; Qwen3-VL text encoder; RGBA VAE)",
            "flow",
            "Qwen/Qwen-Image-2.1",
            "tiny-qwen-image-21",
            image(
                1024,
                1.0,
                40,
                **lora(rank=16),
                **{"model.gradient_checkpointing": True, "model.timestep_sampling": "uniform"},
            ),
        ),
    ),
)
