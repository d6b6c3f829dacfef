"""Z-Image's card (torch-free): ZImagePipeline folders (ZImageTransformer2DModel, a Qwen3 text encoder, an
AutoencoderKL), trained as diffusers' examples/dreambooth/train_dreambooth_lora_z_image.py trains it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dstune.card import ModelPreset, image
from dstune.families.flow_card import FlowCard
from dstune.families.folders import read_component_config
from dstune.memory.activations import ModelShape
from dstune.memory.working import TextWork, VaeWork


def single_stream(config: dict) -> ModelShape:
    """One stream of n_layers, with refiners over the image tokens and over the caption before it."""
    refiners = config.get("n_refiner_layers", 0)
    return ModelShape(
        config["dim"], {"layers": config["n_layers"], "noise_refiner": refiners, "context_refiner": refiners}
    )


@dataclass(frozen=True, kw_only=True)
class ZImageCard(FlowCard):
    def config_mismatches(self, folder: Path) -> list[str]:
        transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
        text = read_component_config(folder, "text_encoder")
        checks = [("in_channels", vae.get("latent_channels", 16)), ("cap_feat_dim", text.get("hidden_size"))]
        return [
            f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
            for key, want in checks
            if transformer.get(key) != want
        ]

    def pad_tokens(self, tokens: float) -> float:
        """It pads the image tokens and the caption's each to a multiple of 32."""
        return math.ceil(tokens / 32) * 32


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKL": VaeWork(encode=10.0, decode=12.0, measured_on="hub/Tongyi-MAI/Z-Image/vae"),
    "Qwen3Model": TextWork(
        hidden=8.0,
        ffn=6.0,
        token=41.9,
        square=0.719,
        pass_square=0.484,
        measured_on="builtin/tiny-z-image-v1/text_encoder",
    ),
}


Z_IMAGE_CARD = ZImageCard(
    working=WORKING_MEMORY,
    guidance_batch=2,  # ZImagePipeline: guidance's two halves in one batch
    text_hidden_states={"text_encoder": (-2,)},  # ZImagePipeline reads the second-to-last
    key="z_image",
    name="Z-Image",
    family="flow",
    unit="zimage",
    model_class="dstune.models.zimage.model:ZImage",
    docs="docs/family-flow.md",
    names=r"z-image|zimage|z_image\w*",
    summary="Z-Image (ZImageTransformer2DModel; Qwen3)",
    folder_classes={"ZImagePipeline": 5.0},
    transformer_class="ZImageTransformer2DModel",
    pipeline_class="ZImagePipeline",
    components={"text_encoder": "Qwen3Model", "tokenizer": None},
    text_tensors=("encoder_hidden_states", "encoder_attention_mask"),
    posterior_mode=True,
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states"},
    cached_text_rows="per_caption",
    activations="z-image",
    activation_shape=single_stream,
    text_width_key="cap_feat_dim",
    spec_notes={"model.max_sequence_length": "512 (Z-Image)"},
    activation_cases="dstune.models.zimage.builtin:ACTIVATION_CASES",
    builtins={"tiny-z-image": "dstune.models.zimage.builtin:TINY_Z_IMAGE"},
    presets=(
        ModelPreset(
            "z-image",
            "Z-Image (6 B single-stream transformer; Qwen3 text encoder)",
            "flow",
            "Tongyi-MAI/Z-Image",
            "tiny-z-image",
            image(
                1024,
                4.0,
                28,
                **{
                    "train.optimizer.lr": 1.0e-5,
                    "model.gradient_checkpointing": True,
                    "model.max_sequence_length": 512,
                },
            ),
        ),
    ),
)
