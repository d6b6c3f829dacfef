"""The cards of SD3-class and Flux-class models (torch-free): StableDiffusion3Pipeline folders (SD3Transformer2DModel;
two CLIPs and T5), FluxPipeline folders (FluxTransformer2DModel; CLIP and T5) and FluxKontextPipeline folders (the
same transformer trained on source/target pairs), trained as diffusers' examples/dreambooth/train_dreambooth_sd3.py,
train_dreambooth_flux.py and train_dreambooth_lora_flux_kontext.py train them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dstune.card import ModelPreset, image, lora
from dstune.families.flow_card import FlowCard, edit_source_issues, joint_blocks, two_streams
from dstune.families.pipeline_card import SpecIssues
from dstune.families.folders import read_component_config
from dstune.memory.working import TextWork, VaeWork
from dstune.models.sd3_flux.original_names import flux_original_names

CLIP_TOKENS = 77  # SD3's CLIP part of the prompt embeds is always the CLIP tokenizers' 77 tokens
TEXT_TENSORS = ("encoder_hidden_states", "pooled_projections")
CACHED_TEXT = {"prompt_embeds": "encoder_hidden_states", "pooled_prompt_embeds": "pooled_projections"}
KONTEXT_GUIDANCE = (
    3.5  # FluxKontextPipeline's default guidance embedding value (also the Kontext script's training value)
)


def _mismatches(folder: Path, checks: list[tuple[str, object]]) -> list[str]:
    transformer = read_component_config(folder, "transformer")
    return [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs)"
        for key, want in checks
        if transformer.get(key) != want
    ]


@dataclass(frozen=True, kw_only=True)
class Sd3Card(FlowCard):
    def config_mismatches(self, folder: Path) -> list[str]:
        vae, t5 = read_component_config(folder, "vae"), read_component_config(folder, "text_encoder_3")
        clips = [read_component_config(folder, name) for name in ("text_encoder", "text_encoder_2")]
        return _mismatches(
            folder,
            [
                ("in_channels", vae.get("latent_channels", 4)),
                ("joint_attention_dim", t5.get("d_model")),
                ("pooled_projection_dim", sum(c.get("projection_dim", 0) for c in clips)),
            ],
        )

    def text_tokens(self, spec, folder) -> int:
        """CLIP's 77 tokens before T5's max_sequence_length."""
        return CLIP_TOKENS + super().text_tokens(spec, folder)


@dataclass(frozen=True, kw_only=True)
class FluxCard(FlowCard):
    def original_transformer_names(self, shapes: dict, config: dict):
        return flux_original_names(shapes, config)

    def config_mismatches(self, folder: Path) -> list[str]:
        vae, t5 = read_component_config(folder, "vae"), read_component_config(folder, "text_encoder_2")
        clip = read_component_config(folder, "text_encoder")
        return _mismatches(
            folder,
            [
                ("in_channels", 4 * vae.get("latent_channels", 4)),
                ("joint_attention_dim", t5.get("d_model")),
                ("pooled_projection_dim", clip.get("hidden_size")),
            ],
        )


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKL": VaeWork(encode=10.0, decode=12.0, measured_on="hub/black-forest-labs/FLUX.1-dev/vae"),
    "CLIPTextModel": TextWork(hidden=8.0, ffn=6.0, square=1.0, measured_on="builtin/tiny-flux-v1/text_encoder"),
    "CLIPTextModelWithProjection": TextWork(
        hidden=8.0, ffn=6.0, square=1.0, measured_on="builtin/tiny-flow-v1/text_encoder"
    ),
    "T5EncoderModel": TextWork(
        hidden=7.169,
        ffn=3.809,
        pass_scores=2.502,
        padding_mask=False,
        measured_on="builtin/tiny-flux-v1/text_encoder_2",
    ),
}


SD3_CARD = Sd3Card(
    working=WORKING_MEMORY,
    guidance_batch=2,  # StableDiffusion3Pipeline: guidance's two halves in one batch
    key="sd3",
    name="SD3",
    family="flow",
    unit="sd3_flux",
    model_class="dstune.models.sd3_flux.model:SD3",
    docs="docs/family-flow.md",
    names=r"sd3",
    summary="SD3-class (SD3Transformer2DModel; CLIP x2 + T5)",
    folder_classes={"StableDiffusion3Pipeline": 7.0},
    transformer_class="SD3Transformer2DModel",
    pipeline_class="StableDiffusion3Pipeline",
    components={
        "text_encoder": "CLIPTextModelWithProjection",
        "text_encoder_2": "CLIPTextModelWithProjection",
        "text_encoder_3": "T5EncoderModel",
        "tokenizer": None,
        "tokenizer_2": None,
        "tokenizer_3": None,
    },
    text_tensors=TEXT_TENSORS,
    default_text_tokens=77,
    cached_text_arguments=CACHED_TEXT,
    activations="sd3",
    activation_shape=joint_blocks,
    text_width_key="joint_attention_dim",
    spec_notes={"model.max_sequence_length": "77 (SD3-class)"},
    activation_cases="dstune.models.sd3_flux.builtin:SD3_ACTIVATION_CASES",
    builtins={"tiny-flow": "dstune.models.sd3_flux.builtin:TINY_FLOW"},
    checkpoint_layouts={
        "model.diffusion_model.joint_blocks.": "an SD3 checkpoint (model.family flow, from its diffusers folder)"
    },
    presets=(
        ModelPreset(
            "sd3",
            "Stable Diffusion 3 Medium (SD3 MMDiT; CLIP x2 + T5)",
            "flow",
            "stabilityai/stable-diffusion-3-medium-diffusers",
            "tiny-flow",
            image(1024, 7.0, 28, **lora(), **{"model.precondition_outputs": True, "model.max_sequence_length": 77}),
        ),
    ),
)

FLUX_CARD = FluxCard(
    working=WORKING_MEMORY,
    key="flux",
    name="Flux.1",
    family="flow",
    unit="sd3_flux",
    model_class="dstune.models.sd3_flux.model:Flux",
    docs="docs/family-flow.md",
    names=r"flux(?![.\s-]?2)|flux\.1",
    summary="Flux-class (FluxTransformer2DModel; CLIP + T5)",
    folder_classes={"FluxPipeline": 3.5},
    transformer_class="FluxTransformer2DModel",
    pipeline_class="FluxPipeline",
    components={
        "text_encoder": "CLIPTextModel",
        "text_encoder_2": "T5EncoderModel",
        "tokenizer": None,
        "tokenizer_2": None,
    },
    text_tensors=TEXT_TENSORS,
    cached_text_arguments=CACHED_TEXT,
    cached_text_negative=False,  # its guidance is the distilled embedding: no negative
    activations="flux1",
    activation_shape=two_streams,
    text_width_key="joint_attention_dim",
    spec_notes={"model.max_sequence_length": "512 (Flux-class)"},
    activation_cases="dstune.models.sd3_flux.builtin:FLUX_ACTIVATION_CASES",
    builtins={"tiny-flux": "dstune.models.sd3_flux.builtin:TINY_FLUX"},
    checkpoint_layouts={
        "double_blocks.": "a Flux checkpoint (model.family flow, from its diffusers folder)",
        "model.diffusion_model.double_blocks.": "a Flux checkpoint (model.family flow, from its diffusers folder)",
    },
    presets=(
        ModelPreset(
            "flux",
            "FLUX.1 [dev] (Flux transformer with a guidance embedding; CLIP + T5)",
            "flow",
            "black-forest-labs/FLUX.1-dev",
            "tiny-flux",
            image(1024, 3.5, 28, **lora(), **{"model.guidance": 1.0, "model.max_sequence_length": 512}),
        ),
    ),
)


@dataclass(frozen=True, kw_only=True)
class FluxKontextCard(FluxCard):
    """An edit model on Flux.1's transformer: trained on (source, target) pairs, the source's latent tokens after the
    target's in one sequence (the text is Flux's own, so it caches per caption)."""

    def pictures(self, spec, folder) -> int:
        return 2

    def pairs(self, spec) -> Optional[str]:
        return self.pipeline_class

    def source_image_issues(self, spec) -> SpecIssues:
        return edit_source_issues(spec, self.pipeline_class)


FLUX_KONTEXT_CARD = FluxKontextCard(
    working=WORKING_MEMORY,  # FLUX.1's VAE and text encoders
    key="flux_kontext",
    name="FLUX.1 Kontext",
    family="flow",
    unit="sd3_flux",
    model_class="dstune.models.sd3_flux.model:FluxKontext",
    docs="docs/family-flow.md",
    names=r"flux[.\s-]?1?[\s-]?kontext|kontext",
    summary="FLUX.1 Kontext (FluxTransformer2DModel; CLIP + T5; trains on source/target pairs, see data.control_dir)",
    folder_classes={"FluxKontextPipeline": KONTEXT_GUIDANCE},
    transformer_class="FluxTransformer2DModel",
    pipeline_class="FluxKontextPipeline",
    components=FLUX_CARD.components,
    text_tensors=TEXT_TENSORS,
    cached_text_arguments=CACHED_TEXT,
    cached_text_negative=False,  # as Flux.1: the guidance is the distilled embedding
    posterior_mode=True,  # the Kontext script's --vae_encode_mode default: the target's and the source's mode
    activations="flux1",
    activation_shape=two_streams,
    text_width_key="joint_attention_dim",
    spec_notes={"model.max_sequence_length": "512 (Flux-class)"},
    activation_cases="dstune.models.sd3_flux.builtin:FLUX_ACTIVATION_CASES",
    builtins={"tiny-flux-kontext": "dstune.models.sd3_flux.builtin:TINY_FLUX_KONTEXT"},
    presets=(
        ModelPreset(
            "flux-kontext",
            "FLUX.1 Kontext [dev] (Flux.1 trained to edit a source image; CLIP + T5)",
            "flow",
            "black-forest-labs/FLUX.1-Kontext-dev",
            "tiny-flux-kontext",
            image(
                1024,
                KONTEXT_GUIDANCE,
                28,
                **lora(),
                **{
                    "model.max_sequence_length": 512,
                    "model.gradient_checkpointing": True,  # source + target tokens: 40 GB a GPU, 115 without
                    "data.path": "/data/edits/target",
                    "data.control_dir": "../source",
                    "sample.prompts": [],
                },
            ),
        ),
    ),
)
