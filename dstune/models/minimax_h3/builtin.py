"""builtin:tiny-minimax-h3: a MiniMax-H3 modular pipeline folder (modular_model_index.json, no model_index.json) that
diffusers' own MiniMaxH3ModularPipeline.save_pretrained writes around its real classes at tiny sizes: the packed
transformer (one 32-wide block, one refiner block), the video VAE of 17-frame chunks (16x spatial, 4 latent
channels), the stereo audio VAE (800 samples a latent), both schedulers (shift 12 and 3), and a Qwen3-VL text encoder
of 51 16-wide decoder layers (the pipeline reads hidden state 50, the card's text_layer) with a byte-level Qwen
tokenizer that knows the vision pad tokens. The folder's processor entry stays unset (transformers builds a
Qwen3VLProcessor only with torchvision): dstune encodes the prompts itself (dstune.models.minimax_h3.model)."""

from __future__ import annotations

import json
from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu
from dstune.builtin.parts import tiny_qwen3_vl_config, tiny_qwen_tokenizer
from dstune.families.folders import MODULAR_INDEX
from dstune.families.modular import exported_modular_index
from dstune.hf import quiet_hf_libraries
from dstune.models.minimax_h3.card import AUDIO_SHIFT, TEXT_LAYER, VIDEO_SHIFT
from dstune.spec.section import VIDEO_FAMILY

FOLDER_NAME = "tiny-minimax-h3-v1"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TINY_TRANSFORMER = dict(
    num_attention_heads=2,
    attention_head_dim=32,
    hidden_size=32,
    num_layers=1,
    num_refiner_layers=1,
    ffn_dim=64,
    in_channels=4,
    audio_in_channels=4,
    text_dim=16,
    freq_dim=16,
    time_embed_hidden_dim=16,
    time_embed_dim=16,
    rope_freq_dim=4,
)
TINY_VAE = dict(
    block_out_channels=(8,) * 6,
    layers_per_block=1,
    norm_num_groups=4,
    latent_channels=4,
    decoder_num_layers=1,
    latents_mean=[0.1, -0.1, 0.05, 0.0],
    latents_std=[0.9, 1.1, 1.0, 0.8],
)
TINY_AUDIO_VAE = dict(
    encoder_dim=8,
    latent_dim=8,
    latent_channels=4,
    num_attention_heads=2,
    decoder_dim=128,
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1,),),
    latents_mean=[0.0, 0.1, -0.1, 0.05],
    latents_std=[1.0, 0.9, 1.1, 1.2],
)


def tiny_h3_tokenizer():
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tokenizer


def minimax_h3_parts() -> dict:
    """The tiny folder's components (seeded by the caller)."""
    with quiet_hf_libraries():
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler
        from diffusers import MiniMaxH3Transformer3DModel
        from transformers import Qwen3VLForConditionalGeneration

    tokenizer = tiny_h3_tokenizer()
    return dict(
        transformer=MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER),
        vae=AutoencoderKLMiniMaxH3(**TINY_VAE),
        audio_vae=AutoencoderKLMiniMaxH3Audio(**TINY_AUDIO_VAE),
        text_encoder=Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer, 16, TEXT_LAYER + 1)),
        tokenizer=tokenizer,
        scheduler=MiniMaxH3Scheduler(shift=VIDEO_SHIFT),
        audio_scheduler=MiniMaxH3Scheduler(shift=AUDIO_SHIFT),
    )


def build_tiny_minimax_h3(out: Path, needs: dict) -> dict:
    """builtin:tiny-minimax-h3: the modular folder MiniMaxH3Blocks' pipeline writes of minimax_h3_parts."""
    with quiet_hf_libraries():
        from diffusers.modular_pipelines import MiniMaxH3Blocks

    with deterministic_cpu(0, BUILD_THREADS):
        parts = minimax_h3_parts()
    with quiet_hf_libraries():
        pipeline = MiniMaxH3Blocks().init_pipeline()
        pipeline.update_components(**parts)
        pipeline.save_pretrained(str(out), overwrite_modular_index=True, safe_serialization=True)
    # the index names where each component loads from: the folder's final place (the build writes beside it)
    final = out.parent / FOLDER_NAME if out.name.startswith(f".{FOLDER_NAME}.") else out
    written = {path.name for path in out.iterdir() if path.is_dir()}
    index = exported_modular_index(out, final.resolve(), written)
    (out / MODULAR_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {"transformer_parameters": sum(p.numel() for p in parts["transformer"].parameters())}


TINY_MINIMAX_H3 = BuiltinModel(
    name="tiny-minimax-h3",
    folder_name=FOLDER_NAME,
    family=VIDEO_FAMILY,
    description="MiniMax-H3 modular pipeline (video + stereo audio): a 1-block 32-wide packed transformer, a 4-channel "
    "video VAE of 17-frame chunks (16x spatial), a 4-channel stereo audio VAE, and a 51-layer 16-wide Qwen3-VL text "
    "encoder (hidden state 50 read)",
    build=build_tiny_minimax_h3,
)
