"""Wan 2.1 / 2.2's card (torch-free): WanPipeline and WanImageToVideoPipeline folders (WanTransformer3DModel, one or
two experts, AutoencoderKLWan, UMT5), text-to-video, image-to-video (Wan 2.1 I2V with its CLIP image encoder, Wan 2.2
I2V A14B) and Wan 2.2 TI2V 5B; the folder's layout against model.image_to_video (dstune.models.wan.layouts), tokens
per clip, activations and cache bytes, and the offline checks validate and start-up share.

Tokens of a clip: latent frames (1 + (frames - 1) / 4) x (H / s / ph) x (W / s / pw), with the VAE's spatial factor s
(8, or Wan 2.2's 16: 8x stages, then 2x2 pixel patches) and the transformer's patch (pt, ph, pw) from the configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Optional

from dstune.card import ModelPreset, lora, video
from dstune.families.denoiser_facts import embedding_width_bytes, latent_channels, transformer_text_bytes
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.pipeline_card import SpecIssues
from dstune.families.video_card import VideoCard, clip_volume
from dstune.memory.activations import ModelShape, in_plan_units, measured_sample_bytes
from dstune.memory.counts import vae_factor
from dstune.models.wan import layouts as wan_layouts
from dstune.models.wan.original_names import wan_original_names
from dstune.spec.video_models import expert_problems, experts_in
from dstune.memory.working import TextWork, VaeWork

# Wan 2.1 I2V's cross-attention (diffusers' WanAttnProcessor) takes all but the last 512 context tokens as the image
# embedding's: its text must be exactly this long, or the image tokens are read as text and the image projections
# (add_k_proj, add_v_proj) get no gradient
IMAGE_EMBEDDING_TEXT_TOKENS = 512
CONDITION = "condition_mean"  # the condition's VAE mode, unnormalised, float32 (B, z_dim, f, h, w)
IMAGE_EMBEDS = "image_embeds"  # the image encoder's hidden_states[-2] of the first frame (Wan 2.1 I2V)


@dataclass(frozen=True)
class WanMode:
    """What a Wan run is: the folder's layout (dstune.models.wan.layouts: t2v, i2v, ti2v) and whether the run
    denoises from first frames (model.image_to_video, or the folder's)."""

    layout: str = "t2v"
    image_to_video: bool = False


def folder_mode(folder: Path, image_to_video: Optional[bool]) -> WanMode:
    """The layout of a folder that the card's folder_problems accepted, and whether the run trains image-to-video."""
    index = read_model_index(folder)
    layout, _ = wan_layouts.layout(
        index, read_component_config(folder, "transformer"), read_component_config(folder, "vae")
    )
    return WanMode(layout, wan_layouts.image_to_video(layout, image_to_video)[0])


def clip_tokens(config: dict, resolution, frames: int, vae_factor: int = 8) -> float:
    """A Wan transformer's tokens over one clip of `resolution` (a square side, or a bucket's (width, height)):
    (1 + (frames - 1) / 4) latent frames x (height / 16) x (width / 16) (the VAE's 8x spatial and 4x temporal
    compression, then 1x2x2 patches; Wan 2.2's 16x VAE: / 32), so they grow with frames x height x width."""
    patch = config.get("patch_size", [1, 2, 2])
    width, height = (resolution, resolution) if isinstance(resolution, int) else resolution
    return (1 + (frames - 1) // 4) / patch[0] * (height / (vae_factor * patch[1])) * (width / (vae_factor * patch[2]))


def constants_key(config: dict, index: dict) -> str:
    """Which measured Wan block the transformer has: Wan 2.1 image-to-video's (the image's own key/value
    projections in the cross-attention), TI2V's (a timestep, so a modulation, per token), or text-to-video's (Wan
    2.2 A14B image-to-video too: its condition channels only widen the patch embedding)."""
    if config.get("added_kv_proj_dim"):
        return "wan-i2v"
    return "wan-ti2v" if index.get("expand_timesteps") else "wan-t2v"


def sample_bytes(
    config: dict,
    index: dict,
    resolution,
    frames: int,
    context_tokens: int,
    vae_factor: int = 8,
    precision: str = "bf16",
) -> tuple[float, float]:
    """One clip's activation bytes (dstune.memory.plan's 2-byte units) from the measured constants of the
    transformer's block, at its width, ffn_dim and num_layers; `context_tokens`: the cross-attention context
    (Wan 2.1 I2V: the text and the image embedding's tokens)."""
    shape = ModelShape(
        config["num_attention_heads"] * config["attention_head_dim"],
        {"blocks": config["num_layers"]},
        ffn=config.get("ffn_dim", 0),
    )
    sample = measured_sample_bytes(
        constants_key(config, index),
        shape,
        clip_tokens(config, resolution, frames, vae_factor),
        context_tokens,
        precision,
    )
    return in_plan_units(sample, precision)


# diffusers' names of a transformer block's layers -> the names in Wan's original checkpoints, which ComfyUI's Wan
# loader maps (and musubi-tuner's and diffusion-pipe's Wan LoRAs use): what output.lora_format comfyui writes, as
# `diffusion_model.blocks.N.<name>`. The inverse of diffusers' own reading of such files
# (`_convert_non_diffusers_wan_lora_to_diffusers`).
ORIGINAL_BLOCK_NAMES = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}


@dataclass(frozen=True, kw_only=True)
class WanCard(VideoCard):
    original_lora_names = MappingProxyType(ORIGINAL_BLOCK_NAMES)

    def original_transformer_names(self, shapes: dict, config: dict):
        return wan_original_names(shapes, config, ORIGINAL_BLOCK_NAMES)

    def folder_problems(self, folder: Path, model_spec) -> list[str]:
        """model.expert and model.timestep_range against the folder's experts, the components, then each expert's
        layout (dstune.models.wan.layouts) against the VAE and model.image_to_video, and its text width."""
        index = read_model_index(folder)
        problems = expert_problems(index, model_spec.expert, model_spec.timestep_range)
        if "transformer_2" in experts_in(index) and not (folder / "transformer_2").is_dir():
            problems.append("model_index.json lists transformer_2 but there is no transformer_2/ subfolder")
        problems += component_problems(folder, index, self.components)
        if problems:
            return problems
        vae, text = read_component_config(folder, "vae"), read_component_config(folder, "text_encoder")
        for name in experts_in(index):
            transformer = read_component_config(folder, name)
            kind, found = wan_layouts.layout(index, transformer, vae)
            problems += [f"{name}: {problem}" for problem in found]
            if transformer.get("text_dim") != text.get("d_model"):
                problems.append(
                    f"{name} text_dim {transformer.get('text_dim')} != {text.get('d_model')} (the text encoder's d_model)"
                )
            if kind is not None and not found:
                problem = wan_layouts.image_to_video(kind, model_spec.image_to_video)[1]
                problems += [problem] if problem and problem not in problems else []
        return problems

    def native_size(self, index: dict) -> Optional[tuple[int, str]]:
        """Its pipelines fix their frames at 480x832 in their code: the shorter side."""
        pipeline = index.get("_class_name")
        if pipeline in self.folder_classes:
            return 480, f"{pipeline}'s default frames are 480x832; the shorter side"
        return None

    def latent_cache_key(self, model_spec, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """Image-to-video: the mode (the condition stored with the posterior) and the image encoder's folders, and
        the tensors stored; text-to-video stores the posterior alone."""
        mode = folder_mode(Path(folder), model_spec.image_to_video)
        if not mode.image_to_video:
            return "", (), ()
        if read_component_config(folder, "transformer").get("image_dim") is None:
            return f"image_to_video/{mode.layout}", (), (CONDITION,)
        return f"image_to_video/{mode.layout}", ("image_encoder", "image_processor"), (CONDITION, IMAGE_EMBEDS)

    # ---------------------------------------------------------------------------------------- memory

    def token_factors(self, folder):
        """A spatial halving per downsampling stage, times the VAE's own pixel patches where it has them (Wan 2.2's
        16x VAE: 8x stages, then 2x2); the transformer's patch; 4 frames per latent frame."""
        patch = folder.config("transformer").get("patch_size", [1, 2, 2])
        return vae_factor(folder.config("vae")), tuple(patch), 4, f"the VAE and transformer configs of {folder.origin}"

    def image_to_video(self, spec, folder) -> bool:
        """Whether the spec trains image-to-video on this folder; False for folders whose channels fit no Wan layout
        (startup says why)."""
        kind, _ = wan_layouts.layout(folder.index, folder.config("transformer"), folder.config("vae"))
        return kind is not None and wan_layouts.image_to_video(kind, spec.model.image_to_video)[0]

    def _image_tokens(self, folder) -> int:
        """Wan 2.1 I2V's image embedding in the cross-attention context: the CLIP vision tower's patches and class
        token (257 for ViT-H/14 at 224 px)."""
        config = folder.config("image_encoder")
        return (config.get("image_size", 224) // config.get("patch_size", 14)) ** 2 + 1

    def _text_tokens(self, spec) -> int:
        return spec.model.max_sequence_length or self.default_text_tokens

    def clip_activation_bytes(self, spec, folder, frames: int, width: int, height: int):
        """One clip's activations; the context holds the text and, for Wan 2.1 I2V, the image embedding's tokens."""
        with_encoder = (folder.index.get("image_encoder") or [None])[0] and self.image_to_video(spec, folder)
        context = self._text_tokens(spec) + (self._image_tokens(folder) if with_encoder else 0)
        _, factor = latent_channels(folder)
        config = folder.config("transformer")
        return sample_bytes(config, folder.index, (width, height), frames, context, factor, spec.train.precision)

    def text_bytes(self, spec, folder) -> int:
        width = folder.config("transformer").get("text_dim", 0) if folder.has("transformer") else 0
        return transformer_text_bytes(spec, folder, self._text_tokens(spec), width)

    def condition_cache_bytes(self, spec, folder, companions: dict, channels: int, factor: int, buckets, num_samples):
        """Image-to-video's cached condition: its latent mode in float32 (TI2V: one latent frame), and Wan 2.1 I2V's
        first-frame CLIP hidden states in the frozen parts' dtype, summed over the buckets."""
        if not self.image_to_video(spec, folder):
            return 0
        total = 0
        for frames, clip_width, clip_height, count in buckets:
            frames = 1 if folder.index.get("expand_timesteps") else frames
            total += channels * clip_volume(frames, clip_width // factor, clip_height // factor) * 4 * count
        if "image_encoder" in companions:
            hidden = folder.config("image_encoder").get("hidden_size", 0)
            total += self._image_tokens(folder) * hidden * embedding_width_bytes(spec) * sum(c for *_, c in buckets)
        return total

    def model_spec_issues(self, spec, folder) -> SpecIssues:
        """The folder's layout against model.image_to_video, image-to-video samples' first frames, and the text
        length a transformer that reads an image embedding needs."""
        config = folder.config("transformer")
        problems = wan_layouts.spec_problems(
            folder.index, config, folder.config("vae"), spec.model.image_to_video, spec.sample
        )
        tokens = spec.model.max_sequence_length
        if config.get("added_kv_proj_dim") and tokens not in (None, IMAGE_EMBEDDING_TEXT_TOKENS):
            problems.append(
                (
                    "model.max_sequence_length",
                    f"{tokens}: a Wan 2.1 image-to-video transformer takes all but the last "
                    f"{IMAGE_EMBEDDING_TEXT_TOKENS} context tokens as the image embedding's (diffusers' "
                    f"WanAttnProcessor), so its text must be {IMAGE_EMBEDDING_TEXT_TOKENS} tokens; with {tokens} the "
                    f"image embedding would be read as text. Remove model.max_sequence_length (or set it to "
                    f"{IMAGE_EMBEDDING_TEXT_TOKENS})",
                )
            )
        return problems


# The working memory of its VAE and text encoder classes (dstune.memory.working: bf16 bytes per width unit), as
# bench/working_memory.py measured them on these stored configs; tests/unit/test_working_memory.py checks them at
# another size.
WORKING_MEMORY = {
    "AutoencoderKLWan": VaeWork(
        encode=0.01,
        encode_frame=78.323,
        decode=0.255,
        decode_frame=105.974,
        measured_on="hub/Wan-AI/Wan2.1-T2V-14B-Diffusers/vae",
    ),
    "UMT5EncoderModel": TextWork(
        hidden=7.839,
        ffn=5.152,
        token=103.1,
        scores=2.25,
        pass_scores=1.371,
        measured_on="builtin/tiny-wan-v1/text_encoder",
    ),
}


WAN_CARD = WanCard(
    working=WORKING_MEMORY,
    key="wan",
    name="Wan",
    family="video",
    unit="wan",
    model_class="dstune.models.wan.model:Wan",
    docs="docs/family-wan.md",
    names=r"wan|wan2\.[12]|wan2[12]|wan_\w+",
    summary="Wan 2.1 / 2.2 (WanTransformer3DModel, AutoencoderKLWan, UMT5): text-to-video, image-to-video (Wan 2.1 I2V "
    "with its CLIP image encoder, Wan 2.2 I2V A14B) and Wan 2.2 TI2V 5B",
    folder_classes={"WanPipeline": 5.0, "WanImageToVideoPipeline": 5.0},
    transformer_class="WanTransformer3DModel",
    pipeline_class="WanPipeline",
    components={
        "transformer": "WanTransformer3DModel",
        "vae": "AutoencoderKLWan",
        "text_encoder": "UMT5EncoderModel",
        "tokenizer": None,
        "scheduler": None,
    },
    vae_class="AutoencoderKLWan",
    text_tensors=("encoder_hidden_states",),
    text_cache_folders=("text_encoder", "tokenizer"),  # UMT5
    default_text_tokens=512,  # WanPipeline.__call__'s max_sequence_length
    cached_text_arguments={"prompt_embeds": "encoder_hidden_states"},
    spec_notes={"model.max_sequence_length": "512 (Wan: UMT5 tokens, zero-padded as WanPipeline pads them)"},
    activation_cases="dstune.models.wan.builtin:ACTIVATION_CASES",
    builtins={
        "tiny-wan": "dstune.models.wan.builtin:TINY_WAN",
        "tiny-wan-a14b": "dstune.models.wan.builtin:TINY_WAN_A14B",
        "tiny-wan-i2v": "dstune.models.wan.builtin:TINY_WAN_I2V",
        "tiny-wan22-ti2v": "dstune.models.wan.builtin:TINY_WAN22_TI2V",
    },
    presets=(
        ModelPreset(
            "wan21",
            "Wan 2.1 text-to-video 14B",
            "video",
            "Wan-AI/Wan2.1-T2V-14B-Diffusers",
            "tiny-wan",
            video(480, 81, 16, 5.0, **lora(), **{"model.max_sequence_length": 512}),
        ),
        ModelPreset(
            "wan21-i2v",
            "Wan 2.1 image-to-video 14B 480P",
            "video",
            "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
            "tiny-wan-i2v",
            video(480, 81, 16, 5.0, **lora(), **{"model.image_to_video": True, "sample.prompts": []}),
        ),
        ModelPreset(
            "wan22-a14b",
            "Wan 2.2 text-to-video A14B (two experts; the low-noise one trained here)",
            "video",
            "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            "tiny-wan-a14b",
            video(480, 81, 16, 4.0, **lora(), **{"model.expert": "low_noise"}),
        ),
        ModelPreset(
            "wan22-ti2v",
            "Wan 2.2 TI2V 5B (text-to-video, 16x VAE)",
            "video",
            "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
            "tiny-wan22-ti2v",
            video(704, 121, 24, 5.0, **lora()),
        ),
    ),
)
