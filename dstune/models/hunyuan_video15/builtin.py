"""Built-in tiny HunyuanVideo 1.5 text-to-video: `builtin:tiny-hunyuan-video15`, a real HunyuanVideo15Pipeline
folder with tiny components.

HunyuanVideo15Transformer3DModel (two 32-wide dual-stream blocks, one token-refiner block, patch 1x1x1; in_channels
17 = 8 noisy + 8 condition latents + 1 mask channel, as the real 65 = 32 + 32 + 1), AutoencoderKLHunyuanVideo15 (the
real causal 3D layout at widths 8-16 with 8 latent channels, 8x spatial and 4x temporal compression, untrained, so
renders are noise-like clips; the real VAE is 16x with 32 channels), a Qwen2.5-VL text model (Qwen2_5_VLTextModel,
the language model of Qwen2.5-VL: two 32-wide layers, since the pipeline reads the third hidden state from the end)
with the byte-level Qwen2 tokenizer of dstune.builtin.parts and a Qwen-style chat template, a one-layer 16-wide
ByT5 glyph encoder (T5EncoderModel) with ByT5's byte tokenizer (built without files), the FlowMatchEulerDiscrete
scheduler with shift 5.0 and the ClassifierFreeGuidance guider at 6.0 of the 480p text-to-video model. A 5-frame
32x32 clip is an (8, 2, 4, 4) latent, 32 transformer tokens.

`builtin:tiny-hunyuan-video15-i2v` is the image-to-video layout (HunyuanVideo15ImageToVideoPipeline): the same parts
with a transformer of task_type "i2v" (seeded apart), a one-layer 16-wide SiglipVisionModel (32 px images in 8 px
patches: 16 image tokens) and its SiglipImageProcessor (32 px).

The byte-level tokenizer has no merges, so the pipeline's system prompt takes ~600 tokens where Qwen's takes 108;
the pipeline crops the first 108 either way, so the tiny model's embeddings keep the rest of the template.
Training, sampling and the reference loss all go through the pipeline's own encode_prompt, so they agree on that.
"""

from __future__ import annotations

from pathlib import Path

from dstune.spec.section import VIDEO_FAMILY
from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, save_pipeline
from dstune.builtin.parts import tiny_qwen_tokenizer
from dstune.builtin.parts import QWEN3_CHAT_TEMPLATE
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, attr, mse, randn, square_side

_SEED = 50
TEXT_WIDTH = 32  # the Qwen2.5-VL text model's hidden size = the transformer's text_embed_dim
GLYPH_WIDTH = 16  # the ByT5 encoder's d_model = text_embed_2_dim
IMAGE_WIDTH = 16  # the (image-to-video) SigLIP vision model's hidden size = image_embed_dim
LATENT_CHANNELS = 8
# sum(rope_axes_dim) == attention_head_dim; in_channels == 2 x latent channels + 1 (condition latents and mask)
TINY_HV15_TRANSFORMER = dict(
    in_channels=2 * LATENT_CHANNELS + 1,
    out_channels=LATENT_CHANNELS,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=1,
    patch_size_t=1,
    text_embed_dim=TEXT_WIDTH,
    text_embed_2_dim=GLYPH_WIDTH,
    image_embed_dim=IMAGE_WIDTH,
    rope_axes_dim=(4, 6, 6),
    target_size=32,
    task_type="t2v",
)
# four stages: three spatial halvings (8x), two of them also temporal (4x), as the real VAE's last ones
TINY_HV15_VAE = dict(
    latent_channels=LATENT_CHANNELS,
    block_out_channels=(8, 8, 16, 16),
    layers_per_block=1,
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
)
HV15_480P_T2V_SHIFT, HV15_GUIDANCE = 5.0, 6.0  # the 480p text-to-video folder's scheduler shift and guider scale


def tiny_qwen25_text_model(tokenizer):
    """Qwen2_5_VLTextModel (the pipeline's text_encoder class) with two 32-wide layers."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    end_of_text, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    return Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_WIDTH,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            bos_token_id=end_of_text,
            eos_token_id=im_end,
            pad_token_id=end_of_text,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        )
    )


def tiny_byt5():
    """(T5EncoderModel one layer 16 wide over ByT5's 384 byte ids, ByT5Tokenizer): the glyph text encoder."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    encoder = T5EncoderModel(
        T5Config(
            vocab_size=384,
            d_model=GLYPH_WIDTH,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=2,
            feed_forward_proj="gated-gelu",
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    return encoder, ByT5Tokenizer()


def text_to_video_parts() -> dict:
    """The components every tiny HunyuanVideo 1.5 folder shares (seeded): transformer, VAE, both text encoders and
    tokenizers, scheduler and guider."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_qwen25_text_model(tokenizer)
        text_encoder_2, tokenizer_2 = tiny_byt5()
        vae = AutoencoderKLHunyuanVideo15(**TINY_HV15_VAE)
        transformer = HunyuanVideo15Transformer3DModel(**TINY_HV15_TRANSFORMER)
    return dict(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=HV15_480P_T2V_SHIFT),
        guider=ClassifierFreeGuidance(guidance_scale=HV15_GUIDANCE),
    )


def build_tiny_hunyuan_video15(out: Path, needs: dict) -> dict:
    """builtin:tiny-hunyuan-video15: a HunyuanVideo15Pipeline folder."""
    with quiet_hf_libraries():
        from diffusers import HunyuanVideo15Pipeline
    parts = text_to_video_parts()
    return save_pipeline(HunyuanVideo15Pipeline(**parts), out, parts["transformer"])


def tiny_siglip() -> tuple:
    """(SiglipVisionModel one layer 16 wide over 32 px images in 8 px patches: 16 tokens, its SiglipImageProcessor
    at 32 px)."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=IMAGE_WIDTH,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    )
    return encoder, SiglipImageProcessor(size={"height": 32, "width": 32})


def build_tiny_hunyuan_video15_i2v(out: Path, needs: dict) -> dict:
    """builtin:tiny-hunyuan-video15-i2v: a HunyuanVideo15ImageToVideoPipeline folder (the text-to-video parts, an
    "i2v" transformer seeded apart, the SigLIP image encoder and its processor)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    with quiet_hf_libraries():
        from diffusers import HunyuanVideo15ImageToVideoPipeline
    parts = text_to_video_parts()
    with deterministic_cpu(_SEED + 1, BUILD_THREADS):
        parts["transformer"] = HunyuanVideo15Transformer3DModel(**{**TINY_HV15_TRANSFORMER, "task_type": "i2v"})
        image_encoder, feature_extractor = tiny_siglip()
    pipeline = HunyuanVideo15ImageToVideoPipeline(
        **parts, image_encoder=image_encoder, feature_extractor=feature_extractor
    )
    return save_pipeline(pipeline, out, parts["transformer"])


TINY_HUNYUAN_VIDEO15 = BuiltinModel(
    name="tiny-hunyuan-video15",
    folder_name="tiny-hunyuan-video15-v1",
    family=VIDEO_FAMILY,
    description="HunyuanVideo 1.5 text-to-video pipeline: 2-block 32-wide HunyuanVideo15 transformer, an 8-channel "
    "causal 3D VAE, Qwen2.5-VL text model (two 32-wide layers) and a one-layer ByT5 glyph encoder",
    build=build_tiny_hunyuan_video15,
)

TINY_HUNYUAN_VIDEO15_I2V = BuiltinModel(
    name="tiny-hunyuan-video15-i2v",
    folder_name="tiny-hunyuan-video15-i2v-v1",
    family=VIDEO_FAMILY,
    description="HunyuanVideo 1.5 image-to-video pipeline: tiny-hunyuan-video15's parts with an i2v transformer and "
    "a one-layer 16-wide SigLIP image encoder (32 px, 16 tokens)",
    build=build_tiny_hunyuan_video15_i2v,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


def _hunyuan15(heads, ffn_mult):
    """HunyuanVideo 1.5 (text-to-video; the image-to-video transformer differs in its input channels only): the
    text, glyph and image embedders' input widths narrowed like the width (2048 real)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    width = heads * 128
    return (
        HunyuanVideo15Transformer3DModel(
            in_channels=65,
            out_channels=32,
            num_attention_heads=heads,
            attention_head_dim=128,
            num_layers=2,
            num_refiner_layers=2,
            mlp_ratio=4.0,
            text_embed_dim=width * 3584 // 2048,
            text_embed_2_dim=width * 1472 // 2048,
            image_embed_dim=width * 1152 // 2048,
            task_type="t2v",
        ),
        width,
        0,
        0,
    )


HUNYUAN15_CONTEXT = (1000, 256, 729)  # caption, glyph and image tokens (its card: dstune.models.hunyuan_video15.card)


def _hunyuan15_split(context: int) -> tuple[int, int, int]:
    """`context` split as the real model's is (caption : glyph : image = 1000 : 256 : 729), each at least 1."""
    total = sum(HUNYUAN15_CONTEXT)
    glyph = max(1, round(context * HUNYUAN15_CONTEXT[1] / total))
    image = max(1, round(context * HUNYUAN15_CONTEXT[2] / total))
    return context - glyph - image, glyph, image


def _hunyuan15_run(model, tokens, context, dtype):
    """`tokens` = 2 latent frames x side^2; text-to-video as dstune trains it: zero image embeds (masked), the
    caption and glyph tokens with their masks."""
    import torch

    side = square_side(tokens // 2)
    config = model.config
    caption, glyph, image = _hunyuan15_split(context)
    latents = randn(1, config.in_channels, 2, side, side, dtype=dtype)
    text = randn(1, caption, config.text_embed_dim, dtype=dtype)
    glyphs = randn(1, glyph, config.text_embed_2_dim, dtype=dtype)
    images = torch.zeros(1, image, config.image_embed_dim, dtype=dtype)
    return lambda: mse(
        model(
            hidden_states=latents,
            timestep=torch.tensor([500.0], dtype=dtype),
            encoder_hidden_states=text,
            encoder_attention_mask=torch.ones(1, caption, dtype=torch.long),
            encoder_hidden_states_2=glyphs,
            encoder_attention_mask_2=torch.ones(1, glyph, dtype=torch.long),
            image_embeds=images,
            return_dict=False,
        )[0]
    )


ACTIVATION_CASES = (
    Case(
        "hunyuan-video15",
        "HunyuanVideo 1.5 (dual-stream blocks over the clip and caption + glyph + image tokens, token refiner)",
        _hunyuan15,
        _hunyuan15_run,
        sizes=((32, 8), (72, 8), (32, 24), (72, 24)),
        check_size=(50, 12),
        block_lists=attr("transformer_blocks"),  # the token refiner's 2 blocks (not checkpointed): outside
        joint_mask=True,
        # the (clip + context)^2 masks each block builds, forwards and when it is recomputed: measured one head
        # wide over sequences long enough for them to be a third of the step
        transients=True,
        transient_sizes=((2048, 64), (4608, 64), (2048, 256), (4608, 256)),
        transient_check=(3200, 128),
        transient_heads=1,
    ),
)
