"""Ideogram 4's card (torch-free): Ideogram4Pipeline folders (Ideogram4Transformer2DModel and a frozen unconditional
twin for its asymmetric guidance, a Qwen3-VL text encoder, AutoencoderKLFlux2), trained as diffusers'
examples/dreambooth/train_dreambooth_lora_ideogram4.py trains it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dstune.card import DEFAULT_LORA_TARGET_MODULES, ModelPreset, image, lora
from dstune.families.flow_card import FlowCard
from dstune.families.folders import read_component_config
from dstune.memory.activations import ModelShape
from dstune.memory.working import TextWork, VaeWork

# the pipeline's QWEN3_VL_ACTIVATION_LAYERS: the text layers whose hidden states it concatenates per token
TAPPED_LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 35)


def one_stream(config: dict) -> ModelShape:
    """One stream of blocks over the padded text and the image tokens, its MLP width its own key."""
    return ModelShape(
        config["num_attention_heads"] * config["attention_head_dim"],
        {"layers": config["num_layers"]},
        ffn=config["intermediate_size"],
    )


@dataclass(frozen=True, kw_only=True)
class Ideogram4Card(FlowCard):
    def config_mismatches(self, folder: Path) -> list[str]:
        transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
        text = read_component_config(folder, "text_encoder")
        text = text.get("text_config", text)
        checks = [
            ("in_channels", 4 * vae.get("latent_channels", 32)),
            ("llm_features_dim", len(TAPPED_LAYERS) * text.get("hidden_size", 0)),
        ]
        problems = [
            f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
            for key, want in checks
            if transformer.get(key) != want
        ]
        if text.get("num_hidden_layers", 0) <= max(TAPPED_LAYERS):
            problems.append(
                f"text_encoder has {text.get('num_hidden_layers')} layers; the pipeline reads the hidden states of "
                f"layers {', '.join(map(str, TAPPED_LAYERS))}"
            )
        unconditional = read_component_config(folder, "unconditional_transformer")
        for key in ("in_channels", "llm_features_dim"):
            if unconditional.get(key) != transformer.get(key):
                problems.append(
                    f"unconditional_transformer {key} {unconditional.get(key)} != the transformer's {transformer.get(key)}"
                )
        return problems


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLFlux2": VaeWork(encode=10.0, decode=12.031, measured_on="hub/ideogram-ai/ideogram-v4/vae"),
    "Qwen3VLModel": TextWork(
        hidden=8.0,
        ffn=6.0,
        token=36.7,
        square=0.969,
        pass_square=0.054,
        measured_on="builtin/tiny-ideogram4-v1/text_encoder",
    ),
}


IDEOGRAM4_CARD = Ideogram4Card(
    working=WORKING_MEMORY,  # its pipeline runs the text encoder's layers itself, keeping those it reads
    key="ideogram4",
    name="Ideogram 4",
    family="flow",
    unit="ideogram4",
    model_class="dstune.models.ideogram4.model:Ideogram4",
    docs="docs/family-flow.md",
    names=r"ideogram\w*",
    summary="Ideogram 4 (Ideogram4Transformer2DModel; Qwen3-VL)",
    folder_classes={"Ideogram4Pipeline": 7.0},
    transformer_class="Ideogram4Transformer2DModel",
    pipeline_class="Ideogram4Pipeline",
    components={
        "text_encoder": "Qwen3VLModel",
        "tokenizer": None,
        "unconditional_transformer": "Ideogram4Transformer2DModel",
    },
    vae_class="AutoencoderKLFlux2",
    text_tensors=("encoder_hidden_states", "encoder_attention_mask"),
    default_text_tokens=2048,
    posterior_mode=True,
    draws_sigma=True,
    sampling_parts=("unconditional_transformer",),
    activations="ideogram4",
    activation_shape=one_stream,
    text_width_key="llm_features_dim",
    spec_notes={"model.max_sequence_length": "2048 (Ideogram 4)"},
    activation_cases="dstune.models.ideogram4.builtin:ACTIVATION_CASES",
    builtins={"tiny-ideogram4": "dstune.models.ideogram4.builtin:TINY_IDEOGRAM4"},
    presets=(
        ModelPreset(
            "ideogram4",
            "Ideogram 4 (9 B transformer; Qwen3-VL text encoder; frozen unconditional transformer)",
            "flow",
            "ideogram-ai/ideogram-v4",
            "tiny-ideogram4",
            image(
                1024,
                7.0,
                48,
                **lora(targets=(*DEFAULT_LORA_TARGET_MODULES, "w1", "w2", "w3")),
                **{"model.gradient_checkpointing": True},
            ),
        ),
    ),
)
