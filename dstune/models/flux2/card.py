"""The cards of FLUX.2 [klein] and [dev] (torch-free): Flux2KleinPipeline folders (a Qwen3 text encoder) and
Flux2Pipeline folders (a Mistral3 text encoder) around Flux2Transformer2DModel and AutoencoderKLFlux2, trained as
diffusers' examples/dreambooth/train_dreambooth_lora_flux2_klein.py and train_dreambooth_lora_flux2.py train them,
and on (reference, target) pairs (data.control_dir) as train_dreambooth_lora_flux2_img2img.py and
train_dreambooth_lora_flux2_klein_img2img.py do."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dstune.card import DEFAULT_LORA_TARGET_MODULES, ModelPreset, image, lora
from dstune.families.flow_card import FlowCard, edit_source_issues, two_streams
from dstune.families.pipeline_card import SpecIssues
from dstune.families.folders import read_component_config
from dstune.memory.working import TextWork, VaeWork

LORA_TARGETS = (*DEFAULT_LORA_TARGET_MODULES, "to_qkv_mlp_proj")


@dataclass(frozen=True, kw_only=True)
class Flux2Card(FlowCard):
    text_layers: tuple[int, ...]  # the text encoder's hidden states its pipeline stacks side by side

    def hidden_states_read(self, folder) -> dict[str, tuple[int, ...]]:
        return {"text_encoder": self.text_layers}

    def config_mismatches(self, folder: Path) -> list[str]:
        """Channels and widths that must agree, and the text encoder deep enough for the stacked layers."""
        transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
        text = read_component_config(folder, "text_encoder")
        text = text.get("text_config", text)  # Mistral3ForConditionalGeneration nests its language model's config
        checks = [
            ("in_channels", 4 * vae.get("latent_channels", 32)),
            ("joint_attention_dim", len(self.text_layers) * text.get("hidden_size", 0)),
        ]
        problems = [
            f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
            for key, want in checks
            if transformer.get(key) != want
        ]
        if text.get("num_hidden_layers", 0) < max(self.text_layers):
            problems.append(
                f"text_encoder has {text.get('num_hidden_layers')} layers; the pipeline reads the hidden states of "
                f"layers {', '.join(map(str, self.text_layers))}"
            )
        return problems

    # Image-to-image: the same folder trains on (reference, target) pairs when the data gives a reference per
    # target (data.control_dir), as diffusers' train_dreambooth_lora_flux2_img2img.py trains it.

    def pairs(self, spec) -> Optional[str]:
        return self.pipeline_class if spec.data.control_dir is not None else None

    def pictures(self, spec, folder) -> int:
        return 2 if spec.data.control_dir is not None else 1

    def source_image_issues(self, spec) -> SpecIssues:
        if spec.data.control_dir is None:
            return super().source_image_issues(spec)
        return edit_source_issues(spec, self.pipeline_class)


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLFlux2": VaeWork(encode=10.0, decode=12.031, measured_on="hub/black-forest-labs/FLUX.2-klein-4B/vae"),
    "Qwen3ForCausalLM": TextWork(
        hidden=8.0,
        ffn=6.0,
        token=41.9,
        square=0.719,
        pass_square=0.484,
        measured_on="builtin/tiny-flux2-v1/text_encoder",
    ),
    "Mistral3ForConditionalGeneration": TextWork(
        hidden=8.0,
        ffn=6.0,
        token=41.9,
        square=0.719,
        pass_square=0.484,
        measured_on="builtin/tiny-flux2-dev-v1/text_encoder",
    ),
}


COMMON = dict(
    working=WORKING_MEMORY,
    family="flow",
    unit="flux2",
    model_class="dstune.models.flux2.model:Flux2",
    docs="docs/family-flow.md",
    names=r"flux\.?2|flux2",
    transformer_class="Flux2Transformer2DModel",
    vae_class="AutoencoderKLFlux2",
    text_tensors=("encoder_hidden_states",),
    posterior_mode=True,
    activations="flux2",
    activation_shape=two_streams,
    text_width_key="joint_attention_dim",
    activation_cases="dstune.models.flux2.builtin:ACTIVATION_CASES",
)

FLUX2_KLEIN_CARD = Flux2Card(
    key="flux2_klein",
    name="FLUX.2 [klein]",
    summary="FLUX.2 [klein] (Flux2Transformer2DModel; Qwen3)",
    folder_classes={"Flux2KleinPipeline": 4.0},
    pipeline_class="Flux2KleinPipeline",
    components={"text_encoder": "Qwen3ForCausalLM", "tokenizer": None},
    text_layers=(9, 18, 27),  # Flux2KleinPipeline's text_encoder_out_layers default
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states"},
    spec_notes={"model.max_sequence_length": "512 (FLUX.2 [klein])"},
    builtins={"tiny-flux2": "dstune.models.flux2.builtin:TINY_FLUX2"},
    presets=(
        ModelPreset(
            "flux2-klein",
            "FLUX.2 [klein] 4B (Flux2 transformer; Qwen3 text encoder; distilled)",
            "flow",
            "black-forest-labs/FLUX.2-klein-4B",
            "tiny-flux2",
            image(1024, 1.0, 4, **lora(targets=LORA_TARGETS), **{"model.max_sequence_length": 512}),
        ),
    ),
    **COMMON,
)

# FLUX.2 [dev]: klein's latents, prediction and loss; the text through Flux2Pipeline.encode_prompt at its defaults
# (max_sequence_length 512, layers 10, 20, 30). Its tokenizer is whatever the folder lists (a PixtralProcessor in a
# real folder), so it is checked loosely (None).
FLUX2_DEV_CARD = Flux2Card(
    key="flux2_dev",
    name="FLUX.2 [dev]",
    summary="FLUX.2 [dev] (Flux2Transformer2DModel; Mistral3)",
    folder_classes={"Flux2Pipeline": 4.0},
    pipeline_class="Flux2Pipeline",
    components={"text_encoder": "Mistral3ForConditionalGeneration", "tokenizer": None},
    text_layers=(10, 20, 30),  # Flux2Pipeline's (and train_dreambooth_lora_flux2.py's) default
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states"},
    cached_text_negative=False,  # a distilled guidance
    spec_notes={"model.max_sequence_length": "512 (FLUX.2 [dev])"},
    builtins={"tiny-flux2-dev": "dstune.models.flux2.builtin:TINY_FLUX2_DEV"},
    presets=(
        ModelPreset(
            "flux2-dev",
            "FLUX.2 [dev] (Flux2 transformer with a guidance embedding; Mistral3 text encoder)",
            "flow",
            "black-forest-labs/FLUX.2-dev",
            "tiny-flux2-dev",
            image(
                1024, 4.0, 28, **lora(targets=LORA_TARGETS), **{"model.guidance": 4.0, "model.max_sequence_length": 512}
            ),
        ),
    ),
    **COMMON,
)
