"""Built-in tiny Z-Image: `builtin:tiny-z-image`, a real ZImagePipeline folder with tiny components.

ZImageTransformer2DModel (one 32-wide layer and one refiner layer each for noise and caption), the trained
16-channel VAE of dstune.builtin.parts (trained on shapes, so renders are images), a Qwen3 text encoder (two 32-wide
layers: the pipeline reads the second-to-last hidden states) and the byte-level Qwen2 tokenizer of
dstune.builtin.parts with a Qwen3-style chat template, built offline from fixed configs and a fixed
seed.
"""

from __future__ import annotations

import math

from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, save_pipeline
from dstune.builtin.parts import FLOW_VAE_PART, trained_flow_vae
from dstune.builtin.parts import QWEN3_CHAT_TEMPLATE, tiny_qwen_tokenizer
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, attr, mse, randn, square_side

_SEED = 30
TEXT_WIDTH = 32  # the text encoder's hidden size = the transformer's cap_feat_dim
# head width dim / n_heads = 16 = sum(axes_dims); axes_lens bound the positions (caption tokens, latent rows/cols)
TINY_ZIMAGE_TRANSFORMER = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=32,
    n_layers=1,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    cap_feat_dim=TEXT_WIDTH,
    axes_dims=[4, 6, 6],
    axes_lens=[1024, 64, 64],
)
ZIMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# a user turn, then the assistant's opening: what Qwen3's template gives with add_generation_prompt


def tiny_qwen3_encoder(tokenizer):
    from transformers import Qwen3Config, Qwen3Model

    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_WIDTH,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=1024,
            bos_token_id=end_of_text,
            eos_token_id=end_of_text,
            pad_token_id=end_of_text,
        )
    )


def build_tiny_z_image(out: Path, needs: dict) -> dict:
    """builtin:tiny-z-image: a ZImagePipeline folder."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    with quiet_hf_libraries():
        from diffusers import ZImagePipeline
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    vae, facts = trained_flow_vae()
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_qwen3_encoder(tokenizer)
        transformer = ZImageTransformer2DModel(**TINY_ZIMAGE_TRANSFORMER)
    pipeline = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return save_pipeline(pipeline, out, transformer, facts)


TINY_Z_IMAGE = BuiltinModel(
    name="tiny-z-image",
    folder_name="tiny-z-image-v1",
    family="flow",
    description="Z-Image pipeline: one-layer Z-Image transformer, Qwen3 text encoder (two 32-wide layers), the "
    "trained 16-channel VAE of tiny-flow",
    build=build_tiny_z_image,
    trained_parts=(FLOW_VAE_PART.name,),
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


def _zimage(heads, ffn_mult):
    from diffusers import ZImageTransformer2DModel

    width = heads * 128
    return (
        ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=width,
            n_layers=2,
            n_refiner_layers=2,
            n_heads=heads,
            n_kv_heads=heads,
            qk_norm=True,
            cap_feat_dim=width * 2560 // 3840,
            axes_dims=[32, 48, 48],
            axes_lens=[1024, 512, 512],
        ),
        width,
        0,
        0,
    )


def _zimage_run(model, tokens, context, dtype):
    import torch

    side = 2 * square_side(tokens)
    latents = [randn(16, 1, side, side, dtype=dtype)]
    text = [randn(context, model.config.cap_feat_dim, dtype=dtype)]
    return lambda: mse(torch.stack(model(latents, torch.tensor([0.5], dtype=dtype), text, return_dict=False)[0]))


ACTIVATION_CASES = (
    Case(
        "z-image",
        "Z-Image (single stream, refiners)",
        _zimage,
        _zimage_run,
        sizes=((16, 32), (64, 32), (16, 64)),
        check_size=(36, 40),
        pad=lambda n: math.ceil(n / 32) * 32,
        block_lists=attr("layers", "noise_refiner", "context_refiner"),
    ),
)
