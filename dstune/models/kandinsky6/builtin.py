"""Built-in tiny Kandinsky 6: `builtin:tiny-kandinsky6`, a real Kandinsky6TI2VAPipeline folder with tiny components.

Kandinsky6Transformer3DModel (two 32-wide fused video/audio blocks, one text block per modality, patch 1x2x2,
visual_cond with the 2 x 4 + 1 input channels and the reference-frame token type, the released checkpoints' flags:
text_token_padding, ca_rope, cross_gates, fix_modulation), AutoencoderKLHunyuanVideo (3 levels at width 8, 4 latent
channels, the real 8x spatial / 4x temporal compression), a Qwen2.5-VL (one 32-wide text layer, a one-block vision
tower the pipeline never calls for text) over the byte-level Qwen2 tokenizer of dstune.builtin.parts, a 16-wide
CLIP text model over the byte-level CLIP tokenizer, MMAudioVAE at the real 44.1 kHz and hop 512 (one latent step per
1,024 samples: 43 a second) with 16 mel bins and 8 latent channels, and an MMAudioVocoder whose upsampling (8 x 4 x 4
x 4) matches that hop; the FlowMatchEulerDiscreteScheduler at shift 5.0. Everything is random, not trained: renders
are noise-like clips and sounds, which is what the tests need (they render, they carry sound, they change with
training).

The byte-level tokenizer has no merges, so the pipeline's prompt template takes ~700 tokens where Qwen's takes 129;
the pipeline crops the first 129 either way, so the tiny model's embeddings keep the rest of the template before the
caption. Training, sampling and the reference loss all go through the pipeline's own _get_prompt_embeds.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from dstune.builtin.common import (
    BUILD_THREADS,
    BuiltinModel,
    deterministic_cpu,
    save_pipeline,
    tiny_clip_config,
    tiny_clip_tokenizer,
)
from dstune.builtin.parts import tiny_qwen_tokenizer
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, attr, mse, randn, square_side
from dstune.spec.section import VIDEO_FAMILY
from dstune.models.kandinsky6.card import LORA_TARGETS

_SEED = 61
TEXT_WIDTH = 32  # Qwen2.5-VL's hidden size = the transformer's in_text_dim
POOLED_WIDTH = 16  # CLIP's hidden size (its pooler output) = in_text_dim2
LATENT_CHANNELS = 4  # the video VAE's; the transformer's in_visual_dim
AUDIO_CHANNELS = 8  # MMAudioVAE's latent channels; the transformer's in_audio_dim
TINY_K6_TRANSFORMER = dict(
    in_visual_dim=LATENT_CHANNELS,
    out_visual_dim=LATENT_CHANNELS,
    in_text_dim=TEXT_WIDTH,
    in_text_dim2=POOLED_WIDTH,
    time_dim=16,
    patch_size=(1, 2, 2),
    model_dim=32,
    ff_dim=64,
    num_text_blocks=1,
    num_visual_blocks=2,
    axes_dims=(4, 6, 6),  # head 16: 2 heads
    visual_cond=True,
    in_audio_dim=AUDIO_CHANNELS,
    out_audio_dim=AUDIO_CHANNELS,
    text_token_padding=True,
    ca_rope=True,
    cross_gates=True,
    fix_modulation=True,
    visual_token_type_num_embeddings=2,
)
# three levels (the class's own block types, build_tiny_kandinsky6), each halving the sides, the last two also the
# frames: the real 8x / 4x
TINY_K6_VAE = dict(
    block_out_channels=(8, 8, 8),
    latent_channels=LATENT_CHANNELS,
    layers_per_block=1,
    norm_num_groups=2,
    mid_block_add_attention=False,
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
)
TINY_K6_AUDIO_VAE = dict(
    mel_bins=16,
    latent_channels=AUDIO_CHANNELS,
    hidden_channels=16,
    channel_multipliers=(1, 2),
    layers_per_block=1,
    sample_rate=44_100,
    n_fft=1024,
    hop_length=512,
)
TINY_K6_VOCODER = dict(
    num_mels=16,
    upsample_initial_channel=32,
    upsample_rates=(8, 4, 4, 4),  # 512: the audio VAE's hop_length
    upsample_kernel_sizes=(16, 8, 8, 8),
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1, 3),),
)
K6_SHIFT = 5.0  # the scheduler's shift of the tiny folder


def tiny_qwen25_vl(tokenizer):
    """Qwen2_5_VLForConditionalGeneration with one 32-wide text layer and a one-block vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    end_of_text, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
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
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_WIDTH),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=end_of_text,
        eos_token_id=im_end,
        pad_token_id=end_of_text,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def vae_levels(vae_class, levels: int) -> dict:
    """The first `levels` of the VAE class's default down and up block types."""
    defaults = inspect.signature(vae_class).parameters
    return {name: defaults[name].default[:levels] for name in ("down_block_types", "up_block_types")}


def build_tiny_kandinsky6(out: Path, needs: dict) -> dict:
    """builtin:tiny-kandinsky6: a Kandinsky6TI2VAPipeline folder with its audio VAE and vocoder."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextModel

    with quiet_hf_libraries():
        from diffusers import (
            AutoencoderKLHunyuanVideo,
            Kandinsky6TI2VAPipeline,
            Kandinsky6Transformer3DModel,
            MMAudioVAE,
            MMAudioVocoder,
        )
    tokenizer = tiny_qwen_tokenizer()
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_qwen25_vl(tokenizer)
        text_encoder_2 = CLIPTextModel(tiny_clip_config(POOLED_WIDTH))
        vae = AutoencoderKLHunyuanVideo(**TINY_K6_VAE, **vae_levels(AutoencoderKLHunyuanVideo, 3))
        audio_vae = MMAudioVAE(**TINY_K6_AUDIO_VAE)
        vocoder = MMAudioVocoder(**TINY_K6_VOCODER)
        transformer = Kandinsky6Transformer3DModel(**TINY_K6_TRANSFORMER)
    pipeline = Kandinsky6TI2VAPipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_clip_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=K6_SHIFT),
        audio_vae=audio_vae,
        vocoder=vocoder,
    )
    return save_pipeline(pipeline, out, transformer)


TINY_KANDINSKY6 = BuiltinModel(
    name="tiny-kandinsky6",
    folder_name="tiny-kandinsky6-v1",
    family=VIDEO_FAMILY,
    description="Kandinsky 6 text/image-to-video+audio pipeline: 2-block 32-wide Kandinsky6 transformer, a 4-channel "
    "AutoencoderKLHunyuanVideo, Qwen2.5-VL (one 32-wide layer), CLIP (16 wide), MMAudio VAE and vocoder at 44.1 kHz",
    build=build_tiny_kandinsky6,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.

HEAD_DIM = 128  # sum(axes_dims) of the released configs: (32, 48, 48)
AUDIO_SHARE = 128  # video tokens per audio token in the measurement (121 frames at 512 px: 31,744 to 217)


def _kandinsky6(heads, ffn_mult):
    """Kandinsky 6 Pro's proportions (its audio stream half the video's width, the audio feed-forward 3.5x that,
    the released flags): the time, text and pooled widths narrowed like the width (4096 real: 1024, 3584, 768), two
    fused blocks and one text block per modality."""
    from diffusers import Kandinsky6Transformer3DModel

    width = heads * HEAD_DIM
    return (
        Kandinsky6Transformer3DModel(
            in_visual_dim=16,
            out_visual_dim=16,
            in_text_dim=width * 3584 // 4096,
            in_text_dim2=width * 768 // 4096,
            time_dim=width // 4,
            model_dim=width,
            ff_dim=4 * width,
            num_text_blocks=1,
            num_visual_blocks=2,
            axes_dims=(32, 48, 48),
            in_audio_dim=40,
            out_audio_dim=40,
            model_dim_a=width // 2,
            time_dim_a=width // 4,
            ff_dim_a=width * 7 // 4,
            axes_dims_a=(32, 48, 48),
            audio_freqs_scaling=0.144,
            text_token_padding=True,
            ca_rope=True,
            cross_gates=True,
            fix_modulation=True,
            visual_token_type_num_embeddings=2,
        ),
        width,
        0,
        0,
    )


def _kandinsky6_run(model, tokens, context, dtype):
    """`tokens` video tokens (2 latent frames x side^2, 2x2 patches) with a sound of tokens / AUDIO_SHARE latent
    steps (at least 1) and `context` caption tokens, at one timestep, as text-to-video+audio trains."""
    import torch

    side = square_side(tokens // 2) * 2
    config = model.config
    visual = randn(1, 2, side, side, 2 * config.in_visual_dim + 1, dtype=dtype)
    audio = randn(1, max(1, tokens // AUDIO_SHARE), config.in_audio_dim, dtype=dtype)
    text = randn(1, context, config.in_text_dim, dtype=dtype)
    pooled = randn(1, config.in_text_dim2, dtype=dtype)

    def loss():
        video_out, audio_out = model(
            hidden_states=visual,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=torch.tensor([500.0]),
            audio_hidden_states=audio,
            return_dict=False,
        )
        return mse(video_out) + mse(audio_out)

    return loss


ACTIVATION_CASES = (
    Case(
        "kandinsky6",
        "Kandinsky 6 (fused video/audio blocks over the clip and its sound, a text branch per modality)",
        _kandinsky6,
        _kandinsky6_run,
        sizes=((128, 8), (288, 8), (128, 24), (288, 24)),
        check_size=(200, 12),
        block_lists=attr("visual_transformer_blocks", "video_text_transformer_blocks", "audio_text_transformer_blocks"),
        check_heads=4,  # an even head count: the audio stream is half as wide, in whole 128-wide heads
        lora_targets=LORA_TARGETS,  # its attention projections (the diffusers default names none of its layers)
        lora_widths=(1, 3),  # its rotary tables, head-wide, are a good part of a narrow LoRA block (2 and 6 heads: the
        # unit test checks at 4)
    ),
)
