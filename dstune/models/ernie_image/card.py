"""ERNIE-Image's card (torch-free): ErnieImagePipeline folders with ErnieImageTransformer2DModel, a Mistral3 text
encoder and AutoencoderKLFlux2; trained as kohya-ss/musubi-tuner's ernie_image_train_network.py trains it (no
diffusers training example exists and Baidu has released no trainer; docs/family-flow.md, ERNIE-Image)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dstune.card import DEFAULT_LORA_TARGET_MODULES, ModelPreset, image, lora
from dstune.families.flow_card import FlowCard
from dstune.families.folders import read_component_config
from dstune.memory.activations import ModelShape
from dstune.memory.working import TextWork, VaeWork

# attention (the default targets) and the GELU-gated MLP of every block
LORA_TARGETS = (*DEFAULT_LORA_TARGET_MODULES, "gate_proj", "up_proj", "linear_fc2")


def shared_modulation_blocks(config: dict) -> ModelShape:
    """One stream of blocks over the image and text tokens (one AdaLN modulation shared by all), its GELU-gated MLP
    width its own key."""
    return ModelShape(config["hidden_size"], {"layers": config["num_layers"]}, ffn=config["ffn_hidden_size"])


@dataclass(frozen=True, kw_only=True)
class ErnieImageCard(FlowCard):
    def config_mismatches(self, folder: Path) -> list[str]:
        """Channels, the text width and the rotary axes the transformer expects, against the other parts."""
        transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
        text = read_component_config(folder, "text_encoder")
        text = text.get("text_config", text)  # Mistral3Model nests its language model's config
        channels = 4 * vae.get("latent_channels", 32)
        checks = [("in_channels", channels), ("out_channels", channels), ("text_in_dim", text.get("hidden_size"))]
        problems = [
            f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
            for key, want in checks
            if transformer.get(key) != want
        ]
        head_dim = transformer.get("hidden_size", 0) // max(1, transformer.get("num_attention_heads", 1))
        axes = transformer.get("rope_axes_dim") or []
        if sum(axes) != head_dim:
            problems.append(f"transformer rope_axes_dim {axes} does not sum to its head dimension {head_dim}")
        return problems


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLFlux2": VaeWork(encode=10.0, decode=12.031, measured_on="hub/baidu/ERNIE-Image/vae"),
    "Mistral3Model": TextWork(
        hidden=8.0,
        ffn=6.0,
        token=41.9,
        square=0.719,
        pass_square=0.484,
        measured_on="builtin/tiny-ernie-image-v1/text_encoder",
    ),
}


ERNIE_IMAGE_CARD = ErnieImageCard(
    working=WORKING_MEMORY,
    guidance_batch=2,  # ErnieImagePipeline: guidance's two halves in one batch
    text_hidden_states={"text_encoder": (-2,)},  # ErnieImagePipeline reads the second-to-last
    key="ernie_image",
    name="ERNIE-Image",
    family="flow",
    unit="ernie_image",
    model_class="dstune.models.ernie_image.model:ErnieImage",
    docs="docs/family-flow.md",
    names=r"ernie[\w-]*",
    summary="ERNIE-Image and ERNIE-Image-Turbo (ErnieImageTransformer2DModel; Mistral3)",
    folder_classes={"ErnieImagePipeline": 4.0},
    transformer_class="ErnieImageTransformer2DModel",
    pipeline_class="ErnieImagePipeline",
    components={"text_encoder": "Mistral3Model", "tokenizer": None},
    vae_class="AutoencoderKLFlux2",
    text_tensors=("encoder_hidden_states", "encoder_attention_mask"),
    default_text_tokens=512,  # dstune's (the pipeline pads to the longest caption instead)
    posterior_mode=True,
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states"},
    cached_text_rows="per_caption",
    lora_formats=("diffusers",),
    lora_loader="ErnieImagePipeline.load_lora_weights",
    activations="ernie-image",
    activation_shape=shared_modulation_blocks,
    text_width_key="text_in_dim",
    spec_notes={"model.max_sequence_length": "512 (ERNIE-Image: dstune's; captions are padded to it)"},
    activation_cases="dstune.models.ernie_image.builtin:ACTIVATION_CASES",
    builtins={"tiny-ernie-image": "dstune.models.ernie_image.builtin:TINY_ERNIE_IMAGE"},
    presets=(
        ModelPreset(
            "ernie-image",
            "ERNIE-Image (8 B single-stream transformer; Mistral3 text encoder; 32-channel AutoencoderKLFlux2)",
            "flow",
            "baidu/ERNIE-Image",
            "tiny-ernie-image",
            image(
                1024,
                4.0,
                50,
                **lora(targets=LORA_TARGETS),
                **{"model.gradient_checkpointing": True, "model.max_sequence_length": 512},
            ),
        ),
    ),
)
