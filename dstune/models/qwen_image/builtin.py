"""Built-in tiny Qwen-Image: `builtin:tiny-qwen-image`, a real QwenImagePipeline folder with tiny components.

QwenImageTransformer2DModel (2 layers, 32 wide), AutoencoderKLQwenImage (16 latent channels, spatial factor 2,
per-channel latents_mean / latents_std as the real VAE states them), a Qwen2.5-VL text encoder (one 32-wide
layer, a one-block vision tower the pipeline never calls for text-to-image) and a byte-level Qwen2 tokenizer with
Qwen's chat tokens, all built offline from fixed configs and a fixed seed. The VAE is random, not trained: renders
are noise-like images, which is all the tests need (they check that images render and change with training).

The byte-level tokenizer has no merges, so the pipeline's prompt template takes ~140 tokens where Qwen's real
tokenizer takes 34; QwenImagePipeline drops the first 34 either way, so the tiny model's embeddings keep the rest of
the template. Training, sampling and the reference loss all go through the pipeline's own encode_prompt, so they
agree on that.
"""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, save_pipeline
from dstune.builtin.parts import QWEN_SCHEDULER, TINY_QWEN_VAE, tiny_qwen_tokenizer
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, TRANSFORMER_SIZES, attr, mse, randn, square_side

_SEED = 20
TEXT_WIDTH = 32  # the text encoder's hidden size = the transformer's joint_attention_dim
# in_channels == 4 x the VAE's z_dim (2x2 packing); sum(axes_dims_rope) == attention_head_dim
TINY_QWEN_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=TEXT_WIDTH,
    axes_dims_rope=(4, 6, 6),
)


def tiny_qwen_vl_encoder(tokenizer):
    """Qwen2_5_VLForConditionalGeneration with one 32-wide text layer and a one-block vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab_size = len(tokenizer)
    end_of_text, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            bos_token_id=end_of_text,
            eos_token_id=im_end,
            pad_token_id=end_of_text,
            hidden_size=TEXT_WIDTH,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=TEXT_WIDTH,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[0],
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=end_of_text,
        eos_token_id=im_end,
        pad_token_id=end_of_text,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def build_tiny_qwen_image(out: Path, needs: dict) -> dict:
    """builtin:tiny-qwen-image: a QwenImagePipeline folder."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    with quiet_hf_libraries():
        from diffusers import QwenImagePipeline
    tokenizer = tiny_qwen_tokenizer()
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_qwen_vl_encoder(tokenizer)
        vae = AutoencoderKLQwenImage(**TINY_QWEN_VAE)
        transformer = QwenImageTransformer2DModel(**TINY_QWEN_TRANSFORMER)
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return save_pipeline(pipeline, out, transformer)


TINY_QWEN_IMAGE = BuiltinModel(
    name="tiny-qwen-image",
    folder_name="tiny-qwen-image-v1",
    family="flow",
    description="Qwen-Image pipeline: 2-layer QwenImage transformer, Qwen2.5-VL text encoder (one 32-wide layer), "
    "random 16-channel Qwen-Image VAE",
    build=build_tiny_qwen_image,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


def _qwen(heads, ffn_mult):
    from diffusers import QwenImageTransformer2DModel

    width = heads * 128
    return (
        QwenImageTransformer2DModel(
            attention_head_dim=128,
            num_attention_heads=heads,
            num_layers=2,
            patch_size=2,
            in_channels=64,
            out_channels=16,
            joint_attention_dim=width * 3584 // 3072,
            axes_dims_rope=(16, 56, 56),
        ),
        width,
        0,
        0,
    )


def _qwen_run(model, tokens, context, dtype):
    import torch

    side = square_side(tokens)
    packed = randn(1, tokens, 64, dtype=dtype)
    text = randn(1, context, model.config.joint_attention_dim, dtype=dtype)
    mask = torch.ones(1, context, dtype=torch.long)
    return lambda: mse(
        model(
            hidden_states=packed,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            timestep=torch.tensor([0.5], dtype=dtype),
            img_shapes=[(1, side, side)],
            return_dict=False,
        )[0]
    )


ACTIVATION_CASES = (
    Case(
        "qwen-image",
        "Qwen-Image and Qwen-Image-Edit (one transformer class)",
        _qwen,
        _qwen_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("transformer_blocks"),
    ),
)
