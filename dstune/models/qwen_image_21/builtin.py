"""Built-in tiny Qwen-Image 2.1: `builtin:tiny-qwen-image-21`, a real QwenImage21Pipeline folder with tiny components.

QwenImage21Transformer2DModel (2 single-stream blocks, 32 wide, unpatched latents, causal_condition as the real
one), a random AutoencoderKLQwenImage21 with the real VAE's 16x spatial factor (4 down stages, 8 wide, RGBA in and
out, 16 latent channels with per-channel latents_mean / latents_std), a Qwen3VLForConditionalGeneration of 2 text
layers 16 wide with a one-block vision tower the text-to-image pipeline never calls, and the dynamic-shifting
scheduler of dstune.builtin.parts. Built offline from fixed configs and a fixed seed.

The folder's `processor` is the byte-level tokenizer of dstune.builtin.parts with a Qwen3-VL style chat
template, not a Qwen3VLProcessor: transformers cannot build that processor without torchvision, which the tested
environment cannot import. dstune loads it wrapped in dstune.models.qwen_image_21.model.TextProcessor, which does what
the text-to-image pipeline asks of a processor; QwenImage21Pipeline.from_pretrained on this folder needs
`processor=TextProcessor(tokenizer)` passed in, as the training example passes its own processor.

The tokenizer's model_max_length is 128 (one token per byte), so the text side defaults to 128 tokens per caption
here; real folders default to 512.
"""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, save_pipeline
from dstune.builtin.parts import QWEN3_VL_CHAT_TEMPLATE, tiny_qwen3_vl_config
from dstune.builtin.parts import QWEN_SCHEDULER, tiny_qwen_tokenizer
from dstune.models.qwen_image_21.model import TextProcessor
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, TRANSFORMER_SIZES, attr, mse, randn, square_side

_SEED = 60
TEXT_WIDTH = 16
TEXT_TOKENS = 128
LATENT_CHANNELS = 16
# in_channels == out_channels == the VAE's z_dim (unpatched); context_in_dim == the text width;
# sum(axes_dims_rope) == attention_head_dim
TINY_QWEN21_TRANSFORMER = dict(
    patch_size=1,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    context_in_dim=TEXT_WIDTH,
    mlp_ratio=3,
    axes_dims_rope=(4, 6, 6),
)
# 2 ** len(temperal_downsample) == 16, the real VAE's factor (QwenImage21Pipeline fixes vae_scale_factor = 16)
TINY_QWEN21_VAE = dict(
    base_dim=8,
    decoder_base_dim=8,
    z_dim=LATENT_CHANNELS,
    dim_mult=[1, 1, 1, 1, 1],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True, True],
    latents_mean=[0.1 * (c % 5) - 0.2 for c in range(LATENT_CHANNELS)],
    latents_std=[0.8 + 0.05 * (c % 7) for c in range(LATENT_CHANNELS)],
    in_channels=4,
    out_channels=4,
)


def tiny_qwen3_vl_generation(tokenizer):
    """Qwen3VLForConditionalGeneration: 2 text layers 16 wide and a one-block vision tower."""
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer, TEXT_WIDTH, 2))


def build_tiny_qwen_image_21(out: Path, needs: dict) -> dict:
    """builtin:tiny-qwen-image-21: a QwenImage21Pipeline folder."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    with quiet_hf_libraries():
        from diffusers import QwenImage21Pipeline
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    tokenizer.model_max_length = TEXT_TOKENS
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_qwen3_vl_generation(tokenizer)
        vae = AutoencoderKLQwenImage21(**TINY_QWEN21_VAE)
        transformer = QwenImage21Transformer2DModel(**TINY_QWEN21_TRANSFORMER)
    pipeline = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        processor=TextProcessor(tokenizer),
        transformer=transformer,
    )
    pipeline.register_modules(processor=tokenizer)  # the folder stores the tokenizer itself (see the docstring)
    return save_pipeline(pipeline, out, transformer)


TINY_QWEN_IMAGE_21 = BuiltinModel(
    name="tiny-qwen-image-21",
    folder_name="tiny-qwen-image-21-v1",
    family="flow",
    description="Qwen-Image 2.1 pipeline: 2-block QwenImage21 transformer, Qwen3-VL (2 text layers 16 wide), random "
    "16-channel RGBA VAE with the real 16x factor",
    build=build_tiny_qwen_image_21,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


def _qwen_image_21(heads, ffn_mult):
    from diffusers import QwenImage21Transformer2DModel

    width = heads * 128
    return (
        QwenImage21Transformer2DModel(
            in_channels=64,
            out_channels=64,
            num_layers=2,
            attention_head_dim=128,
            num_attention_heads=heads,
            context_in_dim=width,
            mlp_ratio=3 * ffn_mult,
            axes_dims_rope=(16, 56, 56),
        ),
        width,
        3 * ffn_mult * width,
        0,
    )


def _qwen_image_21_run(model, tokens, context, dtype):
    """One sample's joint sequence: `context` caption tokens, then the image's latents unpatched (one img_mask slot
    per 2x2 of them), as the recipe feeds it (the real model's text width equals its width)."""
    import torch

    side = square_side(tokens)
    img_mask = torch.cat([torch.zeros(1, context, dtype=torch.bool), torch.ones(1, tokens // 4, dtype=torch.bool)], 1)
    hidden = randn(1, tokens, 64, dtype=dtype)
    text = randn(1, context, model.config.context_in_dim, dtype=dtype)
    return lambda: mse(
        model(
            hidden_states=hidden,
            encoder_hidden_states=text,
            timestep=torch.tensor([0.5], dtype=dtype),
            img_shapes=[[(1, side, side)]],
            img_mask=img_mask,
            return_dict=False,
        )[0]
    )


ACTIVATION_CASES = (
    Case(
        "qwen-image-21",
        "Qwen-Image 2.1 (one block-causal stream over the caption and the unpatched image, head dim 128)",
        _qwen_image_21,
        _qwen_image_21_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(16, 12),
        block_lists=attr("transformer_blocks"),
        ffn=True,
    ),
)
