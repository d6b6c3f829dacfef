"""Krea 2's card (torch-free): Krea2Pipeline folders (Krea2Transformer2DModel, a Qwen3-VL text encoder,
AutoencoderKLQwenImage), Raw and Turbo alike (they differ in their weights and in model_index.json's is_distilled,
which only the sampling schedule reads), trained as diffusers' examples/dreambooth/train_dreambooth_lora_krea2.py
trains them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dstune.card import ModelPreset, image, lora
from dstune.families.flow_card import FlowCard, joint_blocks
from dstune.families.folders import read_component_config, read_model_index
from dstune.memory.working import TextWork, VaeWork

DEFAULT_TEXT_LAYERS = 12  # Krea2Pipeline's default taps (2, 5, ..., 35) of Qwen3-VL-4B
DEFAULT_SELECT_LAYERS = tuple(range(2, 3 * DEFAULT_TEXT_LAYERS, 3))
DISTILLED_GUIDANCE = 0.0  # a Turbo folder (is_distilled) samples without classifier-free guidance
# the training example's default LoRA layers (its authors' recommendation): attention with its gate, the MLP, the
# image and text input projections, the text fusion's projector, the timestep MLP and modulation, the output
LORA_TARGETS = (
    "img_in",
    "final_layer.linear",
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "to_gate",
    "ff.up",
    "ff.down",
    "text_fusion.projector",
    "txt_in.linear_1",
    "txt_in.linear_2",
    "time_embed.linear_1",
    "time_embed.linear_2",
    "time_mod_proj",
)


@dataclass(frozen=True, kw_only=True)
class Krea2Card(FlowCard):
    def hidden_states_read(self, folder) -> dict[str, tuple[int, ...]]:
        """The Qwen3-VL hidden states Krea2Pipeline stacks: model_index.json's text_encoder_select_layers (its
        default taps where the folder lists none)."""
        layers = folder.index.get("text_encoder_select_layers")
        return {"text_encoder": tuple(layers) if isinstance(layers, list) else DEFAULT_SELECT_LAYERS}

    def config_mismatches(self, folder: Path) -> list[str]:
        """Channels, the text width and the number of tapped layers the transformer expects, against the other
        parts."""
        transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
        text = read_component_config(folder, "text_encoder")
        text = text.get("text_config", text)
        layers = read_model_index(folder).get("text_encoder_select_layers") or [None] * DEFAULT_TEXT_LAYERS
        checks = [
            ("in_channels", 4 * vae.get("z_dim", 16)),
            ("text_hidden_dim", text.get("hidden_size")),
            ("num_text_layers", len(layers)),
        ]
        problems = [
            f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs and "
            "model_index.json's text_encoder_select_layers)"
            for key, want in checks
            if transformer.get(key) != want
        ]
        deepest = max((layer for layer in layers if layer is not None), default=0)
        if deepest > text.get("num_hidden_layers", 0):
            problems.append(
                f"model_index.json taps the text encoder's hidden states {layers}, but it has "
                f"{text.get('num_hidden_layers')} layers"
            )
        return problems

    def text_width(self, config: dict) -> int:
        """A cached text token holds every tapped layer's hidden state."""
        return super().text_width(config) * config.get("num_text_layers", 1)

    def sample_guidance(self, index: dict) -> Optional[tuple[float, str]]:
        if index.get("is_distilled") and index.get("_class_name") in self.folder_classes:
            return DISTILLED_GUIDANCE, f"{index['_class_name']}'s value for a distilled (is_distilled) folder"
        return super().sample_guidance(index)


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLQwenImage": VaeWork(
        encode=20.5, encode_fixed=536.0, decode=36.292, decode_fixed=536.0, measured_on="hub/krea/Krea-2-Raw/vae"
    ),
    "Qwen3VLModel": TextWork(
        hidden=8.0,
        ffn=6.0,
        token=68.7,
        square=0.969,
        pass_square=0.054,
        measured_on="builtin/tiny-krea2-v1/text_encoder",
    ),
}


KREA2_CARD = Krea2Card(
    working=WORKING_MEMORY,
    key="krea2",
    name="Krea 2",
    family="flow",
    unit="krea2",
    model_class="dstune.models.krea2.model:Krea2",
    docs="docs/family-flow.md",
    names=r"krea\w*",
    summary="Krea 2 Raw and Turbo (Krea2Transformer2DModel; Qwen3-VL)",
    folder_classes={"Krea2Pipeline": 4.5},
    transformer_class="Krea2Transformer2DModel",
    pipeline_class="Krea2Pipeline",
    components={"text_encoder": "Qwen3VLModel", "tokenizer": None},
    vae_class="AutoencoderKLQwenImage",
    text_tensors=("encoder_hidden_states", "encoder_attention_mask"),
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states", "prompt_embeds_mask": "encoder_attention_mask"},
    cached_text_rows="trimmed",
    lora_formats=("diffusers",),
    lora_loader="Krea2Pipeline.load_lora_weights",
    activations="krea2",
    activation_shape=joint_blocks,
    text_width_key="text_hidden_dim",
    spec_notes={"model.max_sequence_length": "512 (Krea 2)"},
    activation_cases="dstune.models.krea2.builtin:ACTIVATION_CASES",
    builtins={
        "tiny-krea2": "dstune.models.krea2.builtin:TINY_KREA2",
        "tiny-krea2-turbo": "dstune.models.krea2.builtin:TINY_KREA2_TURBO",
    },
    presets=(
        ModelPreset(
            "krea2",
            "Krea 2 Raw (12 B single-stream transformer; Qwen3-VL text encoder; the base to train)",
            "flow",
            "krea/Krea-2-Raw",
            "tiny-krea2",
            image(
                1024,
                4.5,
                28,
                **{
                    **lora(targets=LORA_TARGETS),
                    "train.optimizer.lr": 3.0e-4,
                    "model.gradient_checkpointing": True,
                    "model.max_sequence_length": 512,
                },
            ),
        ),
        ModelPreset(
            "krea2-turbo",
            "Krea 2 Turbo (Krea 2 distilled to 8 steps without guidance)",
            "flow",
            "krea/Krea-2-Turbo",
            "tiny-krea2-turbo",
            image(
                1024,
                0.0,
                8,
                **lora(targets=LORA_TARGETS),
                **{"model.gradient_checkpointing": True, "model.max_sequence_length": 512},
            ),
        ),
    ),
)
