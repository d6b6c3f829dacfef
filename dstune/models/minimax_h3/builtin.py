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
from dstune.memory.activation_cases import Case, attr, mse, randn
from dstune.models.minimax_h3.card import AUDIO_SHIFT, AUDIO_TAG, TEXT_LAYER, TEXT_TAG, VIDEO_SHIFT, VIDEO_TAG
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


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.

HEAD_DIM = 128  # the released config's attention_head_dim
WIDTH_PER_HEAD = 96  # hidden_size per head (5,376 / 56): its heads are 4/3 of the width
AUDIO_SHARE = 24  # video rows per sound row in the measurement (124 frames at 512 px: 9,472 to 414)


def _minimax_h3(heads, ffn_mult):
    """MiniMax-H3's proportions at `heads` 128-wide heads: the width 96 per head, the SwiGLU's inner width 8/3 of
    it (14,336 / 5,376), the time embedding half of it; the text input narrowed like the width (5,120 of 5,376);
    two blocks and the released two refiner blocks."""
    from diffusers import MiniMaxH3Transformer3DModel

    width = heads * WIDTH_PER_HEAD
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=heads,
        attention_head_dim=HEAD_DIM,
        hidden_size=width,
        num_layers=2,
        num_refiner_layers=2,
        ffn_dim=width * 8 // 3,
        text_dim=width * 5120 // 5376,
        time_embed_hidden_dim=width,
        time_embed_dim=width // 2,
    )
    return model, width, 0, 0


def media_rows(tokens: int) -> tuple[int, int]:
    """(the grid side of 2 latent frames, sound latents a channel) of a measurement of `tokens` media rows: 2 x
    side^2 video rows and 2 x the sound's latents (stereo), one sound row to AUDIO_SHARE video rows."""
    for side in range(1, tokens):
        sound = max(1, side * side // AUDIO_SHARE)
        if 2 * side * side + 2 * sound == tokens:
            return side, sound
    raise ValueError(f"{tokens} media rows are no 2 x side^2 video rows and their sound")


def _minimax_h3_run(model, tokens, context, dtype):
    """`tokens` media rows (2 latent frames of side^2 patches and their stereo sound: media_rows) and `context`
    caption rows, packed [text | sound | video] as the pipeline's layout step builds them, the video and the sound
    at their own timesteps, as text-to-video+audio trains."""
    import torch

    with quiet_hf_libraries():
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (
            MiniMaxH3PrepareLayoutStep,
            MiniMaxH3SetTimestepsStep,
        )

    side, sound = media_rows(tokens)
    config = model.config
    tags = torch.full((context,), TEXT_TAG, dtype=torch.long)
    positions, token_tags, video, audio, text_rows, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, 2, 2 * side, 2 * side, sound, tuple(config.patch_size), 2, AUDIO_TAG, VIDEO_TAG
    )
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, 0, 0, context, 0.5, 0.75, 0.5, 1.0
    )
    inputs = dict(
        hidden_states=randn(1, len(video), config.in_channels * 4, dtype=dtype),
        audio_hidden_states=randn(1, len(audio), config.audio_in_channels, dtype=dtype),
        encoder_hidden_states=randn(1, context, config.text_dim, dtype=dtype),
        timestep=timestep,
        timestep_indices=timestep_indices,
        token_tags=token_tags,
        position_ids=positions,
        video_indices=video,
        audio_indices=audio,
        text_indices=text_rows,
        return_dict=False,
    )

    def loss():
        video_out, audio_out = model(**inputs)
        return mse(video_out) + mse(audio_out)

    return loss


ACTIVATION_CASES = (
    Case(
        "minimax-h3",
        "MiniMax-H3 (one packed sequence of caption, sound and video rows through full self-attention blocks)",
        _minimax_h3,
        _minimax_h3_run,
        sizes=((132, 8), (300, 8), (132, 24), (300, 24)),
        check_size=(208, 12),
        block_lists=attr("transformer_blocks", refiner_blocks="token_refiner.refiner_blocks"),
        lora_widths=(1, 2),  # its rotary tables, head-wide, are a good part of a narrow LoRA block
    ),
)
