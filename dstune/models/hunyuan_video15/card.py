"""HunyuanVideo 1.5's card (torch-free): HunyuanVideo15Pipeline (text-to-video) and HunyuanVideo15ImageToVideoPipeline
(image-to-video, with a SigLIP image encoder) folders around HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15,
Qwen2.5-VL and the ByT5 glyph encoder, trained as the official train.py trains it (docs/family-hunyuan-video15.md):
tokens per clip, activations and cache bytes, and the offline checks validate and start-up share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dstune.card import ModelPreset, lora, video
from dstune.families.denoiser_facts import transformer_text_bytes
from dstune.families.facts import Attention
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.pipeline_card import SpecIssues
from dstune.families.video_card import VideoCard
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes
from dstune.spec.video_models import expert_problems
from dstune.memory.working import TextWork, VaeWork

I2V_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
I2V_COMPONENTS = {"image_encoder": "SiglipVisionModel", "feature_extractor": None}
IMAGE_EMBEDS = "image_embeds"  # SigLIP's last hidden state of the first frame (B, tokens, image_embed_dim)
TEXT_TENSORS = (
    "encoder_hidden_states",
    "encoder_attention_mask",
    "encoder_hidden_states_2",
    "encoder_attention_mask_2",
)
GLYPH_TOKENS = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length
TEMPLATE_TOKENS = 108  # the pipeline's chat template before the caption, cropped after the text encoder
VISION_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: SigLIP's 27 x 27 patches
TRAIN_SHIFT = 3.0  # the official train.py's --train_timestep_shift default
# Measured on HunyuanVideo15Transformer3DModel itself (the "hunyuan-video15" activation case in its builtin module): per
# dual-stream block linear bytes per width unit over clip + context tokens, plus the (clip + context)^2 attention
# mask that diffusers' processor builds and SDPA keeps for backward (2 bytes per element in bf16, 4 in fp32); the
# token refiner's 2 blocks (every released config has 2; diffusers does not checkpoint them) are in "outside".
ACTIVATION_CONSTANTS = "hunyuan-video15"


def is_image_to_video(index: dict) -> bool:
    """Whether a folder's model_index.json is HunyuanVideo 1.5's image-to-video pipeline (its runs are
    image-to-video)."""
    return index.get("_class_name") == I2V_PIPELINE


def clip_tokens(transformer: dict, width: int, height: int, frames: int, spatial: int) -> float:
    patch, patch_t = transformer.get("patch_size", 1), transformer.get("patch_size_t", 1)
    return (1 + (frames - 1) // 4) / patch_t * (height / (spatial * patch)) * (width / (spatial * patch))


@dataclass(frozen=True, kw_only=True)
class HunyuanVideo15Card(VideoCard):
    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        """The experts (none), the components (an image-to-video folder's image encoder too), the configs'
        agreement, and model.image_to_video against the folder's pipeline."""
        index = read_model_index(folder)
        problems = expert_problems(index, model_spec.expert, model_spec.timestep_range)
        components = {**self.components, **(I2V_COMPONENTS if is_image_to_video(index) else {})}
        problems += component_problems(folder, index, components)
        if not problems:
            problems += self.config_mismatches(folder)
        mode = self._mode_problem(index, model_spec.image_to_video)
        return problems + ([mode] if mode else [])

    def _mode_problem(self, index: dict, image_to_video: Optional[bool]) -> Optional[str]:
        pipeline = index.get("_class_name")
        if image_to_video and pipeline != I2V_PIPELINE:
            return (
                f"model.image_to_video is true, but {pipeline} is text-to-video: use a {I2V_PIPELINE} folder "
                "(480p_i2v, 720p_i2v) or remove the key"
            )
        if image_to_video is False and pipeline == I2V_PIPELINE:
            return (
                f"model.image_to_video is false, but {pipeline}'s transformer is the image-to-video one: use a "
                f"{self.pipeline_class} folder for text-to-video, or remove the key"
            )
        return None

    def config_mismatches(self, folder: Path) -> list[str]:
        transformer, vae = read_component_config(folder, "transformer"), read_component_config(folder, "vae")
        text, glyph = read_component_config(folder, "text_encoder"), read_component_config(folder, "text_encoder_2")
        channels = vae.get("latent_channels")
        problems = []
        if channels is not None and transformer.get("in_channels") != 2 * channels + 1:
            problems.append(
                f"transformer in_channels {transformer.get('in_channels')} != 2 x the VAE's latent_channels "
                f"{channels} + 1 (noisy latents, condition latents, mask)"
            )
        if channels is not None and transformer.get("out_channels") != channels:
            problems.append(
                f"transformer out_channels {transformer.get('out_channels')} != the VAE's latent_channels {channels}"
            )
        if transformer.get("text_embed_dim") != text.get("hidden_size"):
            problems.append(
                f"transformer text_embed_dim {transformer.get('text_embed_dim')} != the text encoder's hidden_size "
                f"{text.get('hidden_size')}"
            )
        if transformer.get("text_embed_2_dim") != glyph.get("d_model"):
            problems.append(
                f"transformer text_embed_2_dim {transformer.get('text_embed_2_dim')} != the glyph encoder's d_model "
                f"{glyph.get('d_model')}"
            )
        return problems

    def latent_cache_key(self, model_spec, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """Image-to-video: the first frame's SigLIP embedding beside the posterior."""
        if not is_image_to_video(read_model_index(Path(folder))):
            return "", (), ()
        return "image_to_video/hunyuan_video15", ("image_encoder", "feature_extractor"), (IMAGE_EMBEDS,)

    # ---------------------------------------------------------------------------------------- memory

    def token_factors(self, folder):
        """(VAE spatial factor, transformer patch (t, h, w), VAE temporal factor (4), where they came from)."""
        vae, transformer = folder.config("vae"), folder.config("transformer")
        patch = transformer.get("patch_size", 1)
        return (
            vae.get("spatial_compression_ratio", 16),
            (transformer.get("patch_size_t", 1), patch, patch),
            4,
            f"the VAE and transformer configs of {folder.origin}",
        )

    def split_attention(self, folder) -> Optional[Attention]:
        """The heads a sequence-parallel split divides (its plan is dstune's: dstune.models.hunyuan_video15.split).
        The context sets no rule on N: the split pads it with masked tokens to a multiple of N."""
        config = folder.config("transformer")
        if not isinstance(config.get("num_attention_heads"), int):
            return None
        return Attention(
            config["num_attention_heads"],
            config.get("attention_head_dim", 0),
            f"the transformer config of {folder.origin}",
        )

    def encoder_tokens(self, spec, folder) -> dict[str, int]:
        """A caption's tokens in each text encoder: Qwen2.5-VL's with the pipeline's template (cropped after it),
        the glyph encoder's 256."""
        text = (spec.model.max_sequence_length or self.default_text_tokens) + TEMPLATE_TOKENS
        return {"text_encoder": text, "text_encoder_2": GLYPH_TOKENS}

    def context_tokens(self, spec) -> int:
        """The context every block attends to jointly with the clip: caption, glyph and image tokens."""
        return (spec.model.max_sequence_length or self.default_text_tokens) + GLYPH_TOKENS + VISION_TOKENS

    def clip_activation_bytes(self, spec, folder, frames: int, width: int, height: int):
        """The measured constants at the transformer's width and dual-stream block count."""
        config = folder.config("transformer")
        spatial = folder.config("vae").get("spatial_compression_ratio", 16)
        shape = ModelShape(
            config["num_attention_heads"] * config["attention_head_dim"], {"transformer_blocks": config["num_layers"]}
        )
        sample = measured_sample_bytes(
            ACTIVATION_CONSTANTS,
            shape,
            clip_tokens(config, width, height, frames, spatial),
            self.context_tokens(spec),
            spec.train.precision,
        )
        return in_plan_units(sample, spec.train.precision)

    def text_bytes(self, spec, folder) -> int:
        """Qwen2.5-VL's caption states and ByT5's glyph states."""
        config = folder.config("transformer") if folder.has("transformer") else {}
        tokens_and_width = [
            (spec.model.max_sequence_length or self.default_text_tokens, config.get("text_embed_dim", 0)),
            (GLYPH_TOKENS, config.get("text_embed_2_dim", 0)),
        ]
        return sum(transformer_text_bytes(spec, folder, tokens, width) for tokens, width in tokens_and_width)

    def image_to_video(self, spec, folder) -> bool:
        return is_image_to_video(folder.index) and spec.model.image_to_video is not False

    def condition_cache_bytes(self, spec, folder, companions: dict, channels: int, factor: int, buckets, num_samples):
        """The latent cache's image-to-video extra: each clip's first-frame SigLIP hidden states (float32)."""
        if not (spec.data.cache.latents and is_image_to_video(folder.index)):
            return 0
        encoder = folder.config("image_encoder")
        tokens = (encoder.get("image_size", 384) // encoder.get("patch_size", 14)) ** 2
        return tokens * encoder.get("hidden_size", 0) * 4 * num_samples

    def model_spec_issues(self, spec, folder) -> SpecIssues:
        """model.image_to_video against the folder's pipeline, and first frames for image-to-video samples (one
        per prompt) or none for text-to-video."""
        pipeline, issues = folder.index.get("_class_name"), []
        i2v = is_image_to_video(folder.index)
        if spec.model.image_to_video and not i2v:
            issues.append(
                (
                    "model.image_to_video",
                    f"{spec.model.pretrained}: {pipeline} is text-to-video; use a {I2V_PIPELINE} folder or remove the key",
                )
            )
        if spec.model.image_to_video is False and i2v:
            issues.append(
                (
                    "model.image_to_video",
                    f"{spec.model.pretrained}: {pipeline}'s transformer is the image-to-video one; use a "
                    f"{self.pipeline_class} folder for text-to-video, or remove the key",
                )
            )
        if i2v:
            if len(spec.sample.control_images) != len(spec.sample.prompts):
                issues.append(
                    (
                        "sample.control_images",
                        f"{pipeline} renders each sample from a first frame: give one image per sample.prompts entry, "
                        "or set sample.prompts: []",
                    )
                )
        elif spec.sample.control_images:
            issues.append(
                (
                    "sample.control_images",
                    f"{spec.model.pretrained} renders from the prompt alone (text-to-video): remove sample.control_images",
                )
            )
        return issues


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLHunyuanVideo15": VaeWork(
        encode=14.125,
        decode=14.125,
        mask=2.0,
        tile_px=256,
        measured_on="hub/hunyuanvideo-community/HunyuanVideo-1.5-720p_t2v/vae",
    ),
    "Qwen2_5_VLTextModel": TextWork(
        hidden=8.0,
        ffn=6.0,
        token=68.7,
        square=0.969,
        pass_square=0.054,
        measured_on="builtin/tiny-hunyuan-video15-v1/text_encoder",
    ),
    "T5EncoderModel": TextWork(
        hidden=1.282,
        ffn=6.672,
        token=150.5,
        scores=1.63,
        pass_scores=2.064,
        measured_on="builtin/tiny-hunyuan-video15-v1/text_encoder_2",
    ),
}


HUNYUAN_VIDEO15_CARD = HunyuanVideo15Card(
    working=WORKING_MEMORY,
    # HunyuanVideo15Pipeline reads Qwen2.5-VL's third hidden state from the end (num_hidden_layers_to_skip 2)
    text_hidden_states={"text_encoder": (-3,)},
    key="hunyuan_video15",
    name="HunyuanVideo 1.5",
    family="video",
    unit="hunyuan_video15",
    model_class="dstune.models.hunyuan_video15.model:HunyuanVideo15",
    docs="docs/family-hunyuan-video15.md",
    names=r"hunyuan\w*|hv15\w*",
    summary="HunyuanVideo 1.5 (HunyuanVideo15Transformer3DModel, Qwen2.5-VL and ByT5): text- and image-to-video",
    folder_classes={"HunyuanVideo15Pipeline": 6.0, I2V_PIPELINE: 6.0},
    transformer_class="HunyuanVideo15Transformer3DModel",
    pipeline_class="HunyuanVideo15Pipeline",
    components={
        "transformer": "HunyuanVideo15Transformer3DModel",
        "vae": "AutoencoderKLHunyuanVideo15",
        "text_encoder": "Qwen2_5_VLTextModel",
        "text_encoder_2": "T5EncoderModel",
        "tokenizer_2": None,
        "tokenizer": None,
        "scheduler": None,
        "guider": "ClassifierFreeGuidance",
    },
    vae_class="AutoencoderKLHunyuanVideo15",
    text_tensors=TEXT_TENSORS,
    text_cache_folders=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),  # Qwen2.5-VL, ByT5's glyphs
    default_text_tokens=1000,  # HunyuanVideo15Pipeline.tokenizer_max_length (after the template's crop)
    cached_text_arguments={
        "prompt_embeds": "encoder_hidden_states",
        "prompt_embeds_mask": "encoder_attention_mask",
        "prompt_embeds_2": "encoder_hidden_states_2",
        "prompt_embeds_mask_2": "encoder_attention_mask_2",
    },
    spec_notes={
        "model.max_sequence_length": "1000 (HunyuanVideo 1.5: Qwen2.5-VL tokens after its template; ByT5's glyph tokens "
        "stay 256)"
    },
    activation_cases="dstune.models.hunyuan_video15.builtin:ACTIVATION_CASES",
    builtins={
        "tiny-hunyuan-video15": "dstune.models.hunyuan_video15.builtin:TINY_HUNYUAN_VIDEO15",
        "tiny-hunyuan-video15-i2v": "dstune.models.hunyuan_video15.builtin:TINY_HUNYUAN_VIDEO15_I2V",
    },
    presets=(
        ModelPreset(
            "hunyuan-video15",
            "HunyuanVideo 1.5 480p text-to-video (8.3 B; Qwen2.5-VL + ByT5)",
            "video",
            "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
            "tiny-hunyuan-video15",
            video(480, 121, 24, 6.0, **lora(), **{"model.timestep_sampling": "logit_normal"}),
        ),
        ModelPreset(
            "hunyuan-video15-i2v",
            "HunyuanVideo 1.5 480p image-to-video (SigLIP first-frame embedding)",
            "video",
            "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v",
            "tiny-hunyuan-video15-i2v",
            video(480, 121, 24, 6.0, **lora(), **{"model.timestep_sampling": "logit_normal", "sample.prompts": []}),
        ),
    ),
)
