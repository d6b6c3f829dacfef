"""Built-in tiny Wan 2.1 text-to-video: `builtin:tiny-wan`, a real WanPipeline folder with tiny components.

WanTransformer3DModel (two 24-wide layers, patch (1, 2, 2)), AutoencoderKLWan (the real 3D causal layout at base
width 3: 8x spatial and 4x temporal compression, 16 latent channels with per-channel latents_mean / latents_std, left
untrained, so renders are noise-like clips), a UMT5 text encoder (two 32-wide layers) with the single-character T5
tokenizer of builtin:tiny-flow built in memory, and the scheduler Wan2.1-T2V ships with (UniPCMultistepScheduler
predicting flow with flow_shift 3.0). A 5-frame 32x32 clip is a (16, 2, 4, 4) latent, 8 transformer tokens.

`builtin:tiny-wan-a14b` is the Wan 2.2 A14B layout on the same parts: two experts (`transformer` for the high-noise
timesteps, `transformer_2` for the low-noise ones, each like tiny-wan's, seeded apart) and boundary_ratio 0.875 (the
A14B text-to-video value), with flow_shift 12.0 (Wan 2.2 A14B's text-to-video sample shift).

`builtin:tiny-wan-i2v` is the Wan 2.1 image-to-video layout (WanImageToVideoPipeline): the transformer takes 36
input channels (16 noisy + 4 mask + 16 condition) and image embeddings (image_dim 32), beside a two-layer 32-wide
CLIPVisionModel (32 px images in 8 px patches: 17 hidden states) and its CLIPImageProcessor (32 px).

`builtin:tiny-wan22-ti2v` is the Wan 2.2 TI2V 5B layout (WanPipeline with expand_timesteps): the Wan 2.2 VAE
(z_dim 48, residual, 2x2 pixel patches: 16x spatial, 4x temporal) at base width 8 with per-channel latents_mean /
latents_std, and a transformer of 48 input channels; UniPC with flow_shift 5.0 (TI2V 5B's). A 5-frame 32x32 clip is
a (48, 2, 2, 2) latent, 2 transformer tokens.
"""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, save_pipeline
from dstune.builtin.parts import tiny_t5_tokenizer
from dstune.hf import quiet_hf_libraries
from dstune.models.wan.card import IMAGE_EMBEDDING_TEXT_TOKENS
from dstune.memory.activation_cases import Case, attr, mse, randn, square_side
from dstune.spec.section import VIDEO_FAMILY

_SEED = 40
TEXT_WIDTH = 32  # UMT5 d_model = the transformer's text_dim
TINY_WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=16,
    out_channels=16,
    text_dim=TEXT_WIDTH,
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
# three down stages (8x spatial), the last two also halve time (4x): the real Wan 2.1 VAE's factors
TINY_WAN_VAE = dict(
    base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
)
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers' scheduler_config.json (flow_shift 3.0, the 480p value)
WAN_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def tiny_umt5_encoder():
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=124,
            d_model=TEXT_WIDTH,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )


WAN22_BOUNDARY_RATIO = 0.875


def _build(out: Path, two_experts: bool) -> dict:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    with quiet_hf_libraries():
        from diffusers import WanPipeline
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_umt5_encoder()
        vae = AutoencoderKLWan(**TINY_WAN_VAE)
        transformer = WanTransformer3DModel(**TINY_WAN_TRANSFORMER)
    experts = {}
    if two_experts:
        with deterministic_cpu(_SEED + 1, BUILD_THREADS):
            experts = dict(
                transformer_2=WanTransformer3DModel(**TINY_WAN_TRANSFORMER), boundary_ratio=WAN22_BOUNDARY_RATIO
            )
    scheduler = UniPCMultistepScheduler(**{**WAN_SCHEDULER, "flow_shift": 12.0 if two_experts else 3.0})
    pipeline = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
        **experts,
    )
    return save_pipeline(pipeline, out, transformer, {"vae_parameters": sum(p.numel() for p in vae.parameters())})


def _tiny_clip():
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=CLIP_WIDTH,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    )
    with quiet_hf_libraries():
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return encoder, processor


CLIP_WIDTH = 32
# Wan2.1-I2V's transformer: 2 x 16 + 4 input channels, CLIP's image embeddings projected to the inner width
TINY_WAN_I2V_TRANSFORMER = {**TINY_WAN_TRANSFORMER, "in_channels": 36, "image_dim": CLIP_WIDTH, "added_kv_proj_dim": 24}
# Wan2.2's VAE layout (diffusers' TI2V 5B config at base width 8): residual blocks, 2x2 pixel patches in and out
TINY_WAN22_VAE = dict(
    base_dim=8,
    decoder_base_dim=8,
    z_dim=48,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    latents_mean=[round(0.05 * ((i * 7) % 11 - 5), 4) for i in range(48)],
    latents_std=[round(0.5 + 0.05 * ((i * 5) % 9), 4) for i in range(48)],
)


def build_tiny_wan_i2v(out: Path, needs: dict) -> dict:
    """builtin:tiny-wan-i2v: a Wan 2.1 image-to-video WanImageToVideoPipeline folder."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    with quiet_hf_libraries():
        from diffusers import WanImageToVideoPipeline
    with deterministic_cpu(_SEED + 2, BUILD_THREADS):
        text_encoder = tiny_umt5_encoder()
        vae = AutoencoderKLWan(**TINY_WAN_VAE)
        transformer = WanTransformer3DModel(**TINY_WAN_I2V_TRANSFORMER)
        image_encoder, image_processor = _tiny_clip()
    pipeline = WanImageToVideoPipeline(
        tokenizer=tiny_t5_tokenizer(IMAGE_EMBEDDING_TEXT_TOKENS),  # the text the image cross-attention expects
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER),
        image_encoder=image_encoder,
        image_processor=image_processor,
        transformer=transformer,
    )
    return save_pipeline(pipeline, out, transformer)


def build_tiny_wan22_ti2v(out: Path, needs: dict) -> dict:
    """builtin:tiny-wan22-ti2v: a Wan 2.2 TI2V (expand_timesteps) WanPipeline folder."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    with quiet_hf_libraries():
        from diffusers import WanPipeline
    with deterministic_cpu(_SEED + 3, BUILD_THREADS):
        text_encoder = tiny_umt5_encoder()
        vae = AutoencoderKLWan(**TINY_WAN22_VAE)
        transformer = WanTransformer3DModel(**{**TINY_WAN_TRANSFORMER, "in_channels": 48, "out_channels": 48})
    pipeline = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=UniPCMultistepScheduler(**{**WAN_SCHEDULER, "flow_shift": 5.0}),
        expand_timesteps=True,
    )
    return save_pipeline(pipeline, out, transformer, {"vae_parameters": sum(p.numel() for p in vae.parameters())})


def build_tiny_wan(out: Path, needs: dict) -> dict:
    """builtin:tiny-wan: a Wan 2.1 WanPipeline folder."""
    return _build(out, two_experts=False)


def build_tiny_wan_a14b(out: Path, needs: dict) -> dict:
    """builtin:tiny-wan-a14b: a two-expert (Wan 2.2 A14B layout) WanPipeline folder."""
    return _build(out, two_experts=True)


TINY_WAN = BuiltinModel(
    name="tiny-wan",
    folder_name="tiny-wan-v1",
    family=VIDEO_FAMILY,
    description="Wan 2.1 text-to-video pipeline: two-layer Wan transformer (24 wide), UMT5 text encoder (two "
    "32-wide layers), a random AutoencoderKLWan with the real 8x spatial / 4x temporal factors",
    build=build_tiny_wan,
)
TINY_WAN_A14B = BuiltinModel(
    name="tiny-wan-a14b",
    folder_name="tiny-wan-a14b-v1",
    family=VIDEO_FAMILY,
    description="Wan 2.2 A14B layout: two tiny Wan experts (high and low noise, boundary_ratio 0.875) on tiny-wan's "
    "VAE and UMT5",
    build=build_tiny_wan_a14b,
)
TINY_WAN_I2V = BuiltinModel(
    name="tiny-wan-i2v",
    folder_name="tiny-wan-i2v-v2",
    family=VIDEO_FAMILY,
    description="Wan 2.1 image-to-video pipeline: tiny-wan's parts with a 36-channel transformer reading image "
    "embeddings, a two-layer 32-wide CLIPVisionModel with its CLIPImageProcessor, and a 512-token tokenizer (the text "
    "its image cross-attention expects)",
    build=build_tiny_wan_i2v,
)
TINY_WAN22_TI2V = BuiltinModel(
    name="tiny-wan22-ti2v",
    folder_name="tiny-wan22-ti2v-v1",
    family=VIDEO_FAMILY,
    description="Wan 2.2 TI2V layout (expand_timesteps): a tiny Wan 2.2 VAE (z_dim 48, 16x spatial) and a "
    "48-channel Wan transformer, with tiny-wan's UMT5",
    build=build_tiny_wan22_ti2v,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


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
    import torch

    side = 2 * square_side(tokens // 2)
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


ACTIVATION_CASES = (
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
)
