"""The models whose activations bench/activation_table.py measures: each the REAL diffusers / transformers class with
a narrow configuration of the published model's structure (its head dimension, MLP ratio, block kinds, norms and
modulation; 2-4 heads instead of 24-48, 2 blocks of each kind), and one training forward + loss on it.

Width: every tensor a block keeps is tokens x (a multiple of the width, of the MLP width, or of the heads at the real
head dimension), so its bytes per token are linear in the width and the MLP width; the measured constants are per
width unit (and per MLP unit where a family's configs set the MLP width apart: Wan's ffn_dim, Llama's
intermediate_size), and the estimate multiplies them by the real model's. The widths around the blocks (text
projections' inputs, pooled vectors) are narrowed by the same factor so that they scale alike; only the latent
channels and the rotary tables (head-dimension wide) do not, which is under 1 % of the total.

A case's sizes: `tokens` is the token count the constants are per (image tokens, video tokens, latent pixels of a
UNet, LM tokens, SpeechT5 decoder steps), `context` the second sequence (text tokens, SpeechT5 transcript tokens).
"""

from __future__ import annotations

import math
import torch
from activation_cases import Case, attr, mse, randn
from activation_speech import SPEECH_CASES


def _square(tokens: int) -> int:
    side = math.isqrt(tokens)
    assert side * side == tokens, f"{tokens} image tokens: a square count is needed"
    return side


# --------------------------------------------------------------------------------------------------- UNets


def _unet(config: dict):
    """The UNet's structure with every channel count x heads / 10 (heads 2: a fifth; SDXL keeps 64-wide heads)."""

    def build(heads, ffn_mult):
        from diffusers import UNet2DConditionModel

        def narrow(value: int) -> int:
            return value * heads // 10

        channels = [narrow(c) for c in config["block_out_channels"]]
        settings = dict(config, block_out_channels=channels, cross_attention_dim=narrow(config["cross_attention_dim"]))
        if "transformer_layers_per_block" in config:  # SDXL: heads of 64 channels
            settings["attention_head_dim"] = [max(1, narrow(h)) for h in config["attention_head_dim"]]
            settings["projection_class_embeddings_input_dim"] = narrow(1280) + 6 * 256
        return UNet2DConditionModel(**settings), channels[0], 0, 0

    return build


def unet_structure(config: dict) -> dict:
    """What a UNet's measured constants hold for: its blocks and channel ratios (any first width)."""
    from dstune.memory.activations import unet_structure as structure

    return structure(config)


def _unet_run(model, tokens, context, dtype):
    side = _square(tokens)
    latents = randn(1, 4, side, side, dtype=dtype)
    text = randn(1, context, model.config.cross_attention_dim, dtype=dtype)
    extra = {}
    if model.config.addition_embed_type == "text_time":
        pooled = model.config.projection_class_embeddings_input_dim - 6 * model.config.addition_time_embed_dim
        extra = {
            "added_cond_kwargs": {
                "text_embeds": randn(1, pooled, dtype=dtype),
                "time_ids": torch.tensor([[side * 8, side * 8, 0, 0, side * 8, side * 8]], dtype=dtype),
            }
        }
    return lambda: mse(model(latents, torch.tensor([500]), text, **extra).sample)


SD15_UNET = dict(
    act_fn="silu",
    attention_head_dim=8,
    block_out_channels=[320, 640, 1280, 1280],
    cross_attention_dim=768,
    layers_per_block=2,
    norm_num_groups=32,
    in_channels=4,
    out_channels=4,
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
)
SDXL_UNET = dict(
    act_fn="silu",
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    attention_head_dim=[5, 10, 20],
    block_out_channels=[320, 640, 1280],
    cross_attention_dim=2048,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    in_channels=4,
    layers_per_block=2,
    norm_num_groups=32,
    out_channels=4,
    projection_class_embeddings_input_dim=2816,
    transformer_layers_per_block=[1, 2, 10],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    use_linear_projection=True,
)

# --------------------------------------------------------------------------------------------------- flow models


def _sd3(heads, ffn_mult):
    from diffusers import SD3Transformer2DModel

    width = heads * 64
    return (
        SD3Transformer2DModel(
            attention_head_dim=64,
            num_attention_heads=heads,
            num_layers=3,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            caption_projection_dim=width,
            joint_attention_dim=width * 4096 // 1536,
            pooled_projection_dim=width * 2048 // 1536,
            pos_embed_max_size=96,
            sample_size=64,
        ),
        width,
        0,
        0,
    )


def _sd3_run(model, tokens, context, dtype):
    side = 2 * _square(tokens)
    latents = randn(1, 16, side, side, dtype=dtype)
    text = randn(1, context, model.config.joint_attention_dim, dtype=dtype)
    pooled = randn(1, model.config.pooled_projection_dim, dtype=dtype)
    return lambda: mse(
        model(
            hidden_states=latents,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=torch.tensor([500.0]),
            return_dict=False,
        )[0]
    )


def _flux(heads, ffn_mult):
    from diffusers import FluxTransformer2DModel

    width = heads * 128
    return (
        FluxTransformer2DModel(
            attention_head_dim=128,
            num_attention_heads=heads,
            num_layers=2,
            num_single_layers=2,
            in_channels=64,
            joint_attention_dim=width * 4096 // 3072,
            pooled_projection_dim=width * 768 // 3072,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
        width,
        0,
        0,
    )


def _flux_run(model, tokens, context, dtype):
    side = _square(tokens)
    packed = randn(1, tokens, 64, dtype=dtype)
    text = randn(1, context, model.config.joint_attention_dim, dtype=dtype)
    pooled = randn(1, model.config.pooled_projection_dim, dtype=dtype)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(dtype)
    return lambda: mse(
        model(
            hidden_states=packed,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=torch.tensor([0.5], dtype=dtype),
            guidance=torch.tensor([3.5], dtype=dtype),
            txt_ids=torch.zeros(context, 3, dtype=dtype),
            img_ids=img_ids,
            return_dict=False,
        )[0]
    )


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
    side = _square(tokens)
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
    side = 2 * _square(tokens)
    latents = [randn(16, 1, side, side, dtype=dtype)]
    text = [randn(context, model.config.cap_feat_dim, dtype=dtype)]
    return lambda: mse(torch.stack(model(latents, torch.tensor([0.5], dtype=dtype), text, return_dict=False)[0]))


def _flux2(heads, ffn_mult):
    from diffusers import Flux2Transformer2DModel

    width = heads * 128
    return (
        Flux2Transformer2DModel(
            attention_head_dim=128,
            num_attention_heads=heads,
            num_layers=2,
            num_single_layers=2,
            mlp_ratio=3.0,
            in_channels=128,
            joint_attention_dim=width * 7680 // 3072,
            timestep_guidance_channels=256,
            axes_dims_rope=(32, 32, 32, 32),
            guidance_embeds=False,
        ),
        width,
        0,
        0,
    )


def _flux2_run(model, tokens, context, dtype):
    from diffusers import Flux2Pipeline

    side = _square(tokens)
    latents = randn(1, 128, side, side, dtype=dtype)
    text = randn(1, context, model.config.joint_attention_dim, dtype=dtype)
    img_ids, txt_ids = Flux2Pipeline._prepare_latent_ids(latents), Flux2Pipeline._prepare_text_ids(text)
    packed = Flux2Pipeline._pack_latents(latents)
    return lambda: mse(
        model(
            hidden_states=packed,
            encoder_hidden_states=text,
            timestep=torch.tensor([0.5], dtype=dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
    )


def _ideogram4(heads, ffn_mult):
    from diffusers import Ideogram4Transformer2DModel

    width = heads * 256
    ffn = 2 * width * ffn_mult
    return (
        Ideogram4Transformer2DModel(
            in_channels=128,
            num_layers=2,
            attention_head_dim=256,
            num_attention_heads=heads,
            intermediate_size=ffn,
            adaln_dim=width // 9,
            llm_features_dim=width * 104 // 9,
            mrope_section=(24, 20, 20),
        ),
        width,
        ffn,
        0,
    )


def _ideogram4_run(model, tokens, context, dtype):
    """One sample's packed sequence: `context` text positions (the caption left-padded to them), then the image."""
    from diffusers import Ideogram4Pipeline

    side = _square(tokens)
    position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids([context], side, side, context, "cpu")
    hidden = torch.cat([torch.zeros(1, context, 128, dtype=dtype), randn(1, side * side, 128, dtype=dtype)], dim=1)
    text = torch.cat(
        [
            randn(1, context, model.config.llm_features_dim, dtype=dtype),
            torch.zeros(1, side * side, model.config.llm_features_dim, dtype=dtype),
        ],
        dim=1,
    )
    return lambda: mse(
        model(
            hidden_states=hidden,
            timestep=torch.tensor([0.5], dtype=dtype),
            encoder_hidden_states=text,
            position_ids=position_ids,
            segment_ids=segment_ids,
            indicator=indicator,
            return_dict=False,
        )[0]
    )


def _krea2(heads, ffn_mult):
    """Krea 2: one stream of text + image tokens, GQA at the real 4:1, SwiGLU at 16384 / 6144 of the width; the
    text arrives as 12 tapped layers of a text width narrowed like the width (20 heads, as Qwen3-VL-4B's 2560)."""
    from diffusers import Krea2Transformer2DModel

    width = heads * 128
    text_width = 20 * max(1, width * 2560 // 6144 // 20)
    return (
        Krea2Transformer2DModel(
            in_channels=64,
            num_layers=2,
            attention_head_dim=128,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4),
            intermediate_size=width * 16384 // 6144,
            text_hidden_dim=text_width,
            num_text_layers=12,
            text_num_attention_heads=20,
            text_num_key_value_heads=20,
            text_intermediate_size=text_width * 6912 // 2560,
            axes_dims_rope=(32, 48, 48),
        ),
        width,
        0,
        0,
    )


def _krea2_run(model, tokens, context, dtype):
    from diffusers import Krea2Pipeline

    side = _square(tokens)
    packed = randn(1, tokens, 64, dtype=dtype)
    text = randn(1, context, 12, model.config.text_hidden_dim, dtype=dtype)
    mask = torch.ones(1, context, dtype=torch.bool)
    ids = Krea2Pipeline.prepare_position_ids(context, side, side, "cpu")
    return lambda: mse(
        model(
            hidden_states=packed,
            encoder_hidden_states=text,
            timestep=torch.tensor([0.5], dtype=dtype),
            position_ids=ids,
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
    )


def _ernie_image(heads, ffn_mult):
    """ERNIE-Image: one stream of image + text tokens at the real head dimension 128, one AdaLN modulation shared by
    every block, a GELU-gated MLP at 3 x the width; the text arrives at 3072 / 4096 of the width."""
    from diffusers import ErnieImageTransformer2DModel

    width = heads * 128
    ffn = 3 * width * ffn_mult
    return (
        ErnieImageTransformer2DModel(
            hidden_size=width,
            num_attention_heads=heads,
            num_layers=2,
            ffn_hidden_size=ffn,
            in_channels=128,
            out_channels=128,
            text_in_dim=width * 3072 // 4096,
            rope_axes_dim=(32, 48, 48),
        ),
        width,
        ffn,
        0,
    )


def _ernie_image_run(model, tokens, context, dtype):
    """One sample: `tokens` image tokens (a square grid of 128-channel patchified latents), `context` text tokens."""
    side = _square(tokens)
    latents = randn(1, 128, side, side, dtype=dtype)
    text = randn(1, context, model.config.text_in_dim, dtype=dtype)
    return lambda: mse(
        model(
            hidden_states=latents,
            timestep=torch.tensor([500.0], dtype=dtype),
            text_bth=text,
            text_lens=torch.tensor([context]),
            return_dict=False,
        )[0]
    )


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
    side = _square(tokens)
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


# --------------------------------------------------------------------------------------------------- Wan


def _wan(ffn_ratio: float, in_channels: int, image: bool):
    def build(heads, ffn_mult):
        from diffusers import WanTransformer3DModel

        width = heads * 128
        ffn = int(width * ffn_ratio) * ffn_mult
        model = WanTransformer3DModel(
            attention_head_dim=128,
            num_attention_heads=heads,
            num_layers=2,
            ffn_dim=ffn,
            in_channels=in_channels,
            out_channels=16 if in_channels != 48 else 48,
            text_dim=width * 4096 // 5120,
            freq_dim=256,
            qk_norm="rms_norm_across_heads",
            cross_attn_norm=True,
            patch_size=(1, 2, 2),
            added_kv_proj_dim=width if image else None,
            image_dim=width * 1280 // 5120 if image else None,
        )
        return model, width, ffn, 0

    return build


def _wan_run(model, tokens, context, dtype):
    """`tokens` = 2 latent frames x side^2 patches; image-to-video (Wan 2.1): a third of the context is the image's.
    TI2V (48 channels): a timestep per token, as dstune passes it."""
    side = 2 * _square(tokens // 2)
    config = model.config
    latents = randn(1, config.in_channels, 2, side, side, dtype=dtype)
    image_tokens = context // 3 if config.image_dim else 0
    text = randn(1, context - image_tokens, config.text_dim, dtype=dtype)
    extra = (
        {"encoder_hidden_states_image": randn(1, image_tokens, config.image_dim, dtype=dtype)} if image_tokens else {}
    )
    timestep = (
        torch.full((1, tokens), 500.0, dtype=dtype) if config.in_channels == 48 else torch.tensor([500.0], dtype=dtype)
    )
    return lambda: mse(
        model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False, **extra)[0]
    )


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


HUNYUAN15_CONTEXT = (1000, 256, 729)  # caption, glyph and image tokens (dstune.models.hunyuan_video15.facts)


def _hunyuan15_split(context: int) -> tuple[int, int, int]:
    """`context` split as the real model's is (caption : glyph : image = 1000 : 256 : 729), each at least 1."""
    total = sum(HUNYUAN15_CONTEXT)
    glyph = max(1, round(context * HUNYUAN15_CONTEXT[1] / total))
    image = max(1, round(context * HUNYUAN15_CONTEXT[2] / total))
    return context - glyph - image, glyph, image


def _hunyuan15_run(model, tokens, context, dtype):
    """`tokens` = 2 latent frames x side^2; text-to-video as dstune trains it: zero image embeds (masked), the
    caption and glyph tokens with their masks."""
    side = _square(tokens // 2)
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


def _ltx2(heads, ffn_mult):
    """LTX-2: the video stream (head dim 128) and the audio stream narrowed alike (heads of 64, half the width, as
    the real 32 x 64 against 32 x 128); the caption width 3840 / 4096 of the width."""
    from diffusers import LTX2VideoTransformer3DModel

    width = heads * 128
    return (
        LTX2VideoTransformer3DModel(
            in_channels=128,
            out_channels=128,
            num_attention_heads=heads,
            attention_head_dim=128,
            cross_attention_dim=width,
            audio_in_channels=128,
            audio_out_channels=128,
            audio_num_attention_heads=heads,
            audio_attention_head_dim=64,
            audio_cross_attention_dim=width // 2,
            caption_channels=width * 3840 // 4096,
            num_layers=2,
            rope_type="split",
        ),
        width,
        0,
        0,
    )


def _ltx2_run(model, tokens, context, dtype):
    """As dstune trains it (dstune.models.ltx2.recipe): `tokens` = 2 latent frames x side^2 video tokens, the audio
    stream on one zero token isolated from the video, `context` caption tokens for both streams."""
    side = _square(tokens // 2)
    config = model.config
    video = randn(1, tokens, config.in_channels, dtype=dtype)
    audio = torch.zeros(1, 1, config.audio_in_channels, dtype=dtype)
    text = randn(1, context, config.caption_channels, dtype=dtype)
    mask = torch.ones(1, context, dtype=torch.long)
    sigma = torch.tensor([0.5], dtype=dtype)
    return lambda: mse(
        model(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=text,
            audio_encoder_hidden_states=text,
            timestep=sigma,
            sigma=sigma,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=2,
            height=side,
            width=side,
            fps=24.0,
            audio_num_frames=1,
            isolate_modalities=True,
            return_dict=False,
        )[0]
    )


TRANSFORMER_SIZES = ((16, 8), (36, 8), (16, 24))  # (image tokens, text tokens)
CASES = [
    Case(
        "sd15-unet",
        "SD 1.x/2.x UNet (SD 1.5 structure, channels / 5)",
        _unet(SD15_UNET),
        _unet_run,
        sizes=((64, 77), (256, 77)),
        check_size=(576, 77),
        check_heads=1,
        check_precision="fp32",
        extra={"structure": unet_structure(SD15_UNET)},
    ),
    Case(
        "sdxl-unet",
        "SDXL UNet (channels / 5)",
        _unet(SDXL_UNET),
        _unet_run,
        sizes=((64, 77), (256, 77)),
        check_size=(144, 77),
        check_heads=1,
        check_precision="fp32",
        extra={"structure": unet_structure(SDXL_UNET)},
    ),
    Case(
        "sd3",
        "SD3 (MMDiT, head dim 64)",
        _sd3,
        _sd3_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("transformer_blocks"),
    ),
    Case(
        "flux1",
        "Flux.1 (double + single blocks, head dim 128)",
        _flux,
        _flux_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("transformer_blocks", "single_transformer_blocks"),
    ),
    Case(
        "qwen-image",
        "Qwen-Image and Qwen-Image-Edit (one transformer class)",
        _qwen,
        _qwen_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("transformer_blocks"),
    ),
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
    Case(
        "flux2",
        "FLUX.2 [klein] and [dev] (one transformer class)",
        _flux2,
        _flux2_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("transformer_blocks", "single_transformer_blocks"),
    ),
    Case(
        "ideogram4",
        "Ideogram 4 (one stream over the padded text and the image, head dim 256)",
        _ideogram4,
        _ideogram4_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("layers"),
        ffn=True,
    ),
    Case(
        "krea2",
        "Krea 2 Raw and Turbo (single stream, text fusion over 12 tapped layers)",
        _krea2,
        _krea2_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        heads=4,
        check_heads=2,
        block_lists=attr("transformer_blocks"),
    ),
    Case(
        "ernie-image",
        "ERNIE-Image (one stream over the image and the text, shared modulation, head dim 128)",
        _ernie_image,
        _ernie_image_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("layers"),
        ffn=True,
    ),
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
    Case(
        "wan-t2v",
        "Wan 2.1 / 2.2 text-to-video (and Wan 2.2 A14B image-to-video: channels only)",
        _wan(13824 / 5120, 16, False),
        _wan_run,
        sizes=((32, 8), (72, 8), (32, 24)),
        check_size=(50, 12),
        block_lists=attr("blocks"),
        ffn=True,
    ),
    Case(
        "wan-i2v",
        "Wan 2.1 image-to-video (CLIP image tokens in the cross-attention)",
        _wan(13824 / 5120, 36, True),
        _wan_run,
        sizes=((32, 9), (72, 9), (32, 24)),
        check_size=(50, 12),
        block_lists=attr("blocks"),
        ffn=True,
    ),
    Case(
        "wan-ti2v",
        "Wan 2.2 TI2V 5B (a timestep per token)",
        _wan(14336 / 3072, 48, False),
        _wan_run,
        sizes=((32, 8), (72, 8), (32, 24)),
        check_size=(50, 12),
        block_lists=attr("blocks"),
        ffn=True,
    ),
    Case(
        "hunyuan-video15",
        "HunyuanVideo 1.5 (dual-stream blocks over the clip and caption + glyph + image tokens, token refiner)",
        _hunyuan15,
        _hunyuan15_run,
        sizes=((32, 8), (72, 8), (32, 24), (72, 24)),
        check_size=(50, 12),
        block_lists=attr("transformer_blocks"),  # the token refiner's 2 blocks (not checkpointed): outside
        joint_mask=True,
    ),
    Case(
        "ltx2",
        "LTX-2 video stream (the audio stream on one zero token, as dstune trains it)",
        _ltx2,
        _ltx2_run,
        sizes=((32, 8), (72, 8), (32, 24)),
        check_size=(50, 12),
        block_lists=attr("transformer_blocks"),
    ),
    *SPEECH_CASES,
]
CASES_BY_KEY = {case.key: case for case in CASES}
