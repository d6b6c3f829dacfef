"""Built-in tiny flow-matching models: `builtin:tiny-flow` (SD3-class), `builtin:tiny-flux` (Flux-class) and
`builtin:tiny-flux-kontext` (FLUX.1 Kontext, an 8x VAE: see TINY_KONTEXT_VAE).

Both are real diffusers pipeline folders written by `StableDiffusion3Pipeline` / `FluxPipeline.save_pretrained`,
built offline from fixed configs and a fixed seed (registered in dstune.builtin.BUILTIN_MODELS, which also
owns the build-once cache protocol). Sizes: 32 px images, 16x16x16 latents (a 2-block VAE, spatial factor 2),
transformers of ~0.1 M parameters, CLIP and T5 text encoders of a few tens of k.

The 16-channel VAE is trained exactly as builtin:tiny-sd's 4-channel one (dstune.builtin.common.train_tiny_vae:
shapes, first three latent channels follow the half-size RGB, channels centred through quant_conv), because a
random VAE decodes every latent to noise. Real SD3/Flux VAEs have no quant convs and centre with `shift_factor`
instead; the pipelines handle both layouts, so this VAE keeps its quant convs and a shift_factor of 0. Both models
share one VAE build per process. The tokenizers are built in memory: CLIP byte-level BPE (common.tiny_clip_tokenizer)
and a T5 Unigram vocabulary of single characters (no sentencepiece model file needed).
"""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import (
    BUILD_THREADS,
    BuiltinModel,
    deterministic_cpu,
    save_pipeline,
    tiny_clip_config,
    tiny_clip_tokenizer,
)
from dstune.builtin.parts import FLOW_VAE_PART, tiny_t5_tokenizer, trained_flow_vae
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, TRANSFORMER_SIZES, attr, mse, randn, square_side

_SEED = 0
# joint_attention_dim == T5 d_model (>= 2 x CLIP hidden: CLIP embeds are zero-padded to the T5 width);
# pooled_projection_dim == the two CLIP projections concatenated.
TINY_SD3_TRANSFORMER = dict(
    sample_size=16,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=64,
    caption_projection_dim=32,
    pooled_projection_dim=64,
    pos_embed_max_size=32,
)
TINY_SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
# in_channels == 4 x latent channels (2x2 packing); sum(axes_dims_rope) == attention_head_dim;
# joint_attention_dim == T5 d_model; pooled_projection_dim == CLIP hidden (pooler_output).
TINY_FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    out_channels=None,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
TINY_FLUX_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


def tiny_t5_encoder(d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=124,
            d_model=d_model,
            d_kv=8,
            d_ff=2 * d_model,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )


def build_tiny_flow(out: Path, needs: dict) -> dict:
    """builtin:tiny-flow: an SD3-class pipeline (SD3Transformer2DModel, CLIP x2 with projection, T5)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    with quiet_hf_libraries():
        from diffusers import StableDiffusion3Pipeline
    vae, facts = trained_flow_vae()
    with deterministic_cpu(_SEED + 1, BUILD_THREADS):
        text_encoder = CLIPTextModelWithProjection(tiny_clip_config())
        text_encoder_2 = CLIPTextModelWithProjection(tiny_clip_config())
        text_encoder_3 = tiny_t5_encoder(d_model=64)
        transformer = SD3Transformer2DModel(**TINY_SD3_TRANSFORMER)
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**TINY_SD3_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tiny_t5_tokenizer(),
    )
    return save_pipeline(pipeline, out, transformer, facts)


def build_tiny_flux(out: Path, needs: dict) -> dict:
    """builtin:tiny-flux: a Flux-class pipeline (FluxTransformer2DModel with guidance embedding, CLIP pooled, T5)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel

    with quiet_hf_libraries():
        from diffusers import FluxPipeline
    vae, facts = trained_flow_vae()
    with deterministic_cpu(_SEED + 2, BUILD_THREADS):
        text_encoder = CLIPTextModel(tiny_clip_config())
        text_encoder_2 = tiny_t5_encoder(d_model=32)
        transformer = FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER)
    pipeline = FluxPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**TINY_FLUX_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_t5_tokenizer(),
    )
    return save_pipeline(pipeline, out, transformer, facts)


# FLUX.1 Kontext's VAE: AutoencoderKL with three downsampling stages (8 px per latent, as the real one) and the real
# one's layout (no quant convs, a shift factor). FluxKontextPipeline resizes a sample's source image to about 1 MP,
# which tiny-flux's 2 px-per-latent VAE would make 65536 source tokens; at 8 px it is 4096. Random, not trained:
# renders are noise-like images, which is all the tests need.
TINY_KONTEXT_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 8, 16, 16),
    layers_per_block=1,
    norm_num_groups=4,
    sample_size=64,
    mid_block_add_attention=False,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.1159,
    scaling_factor=0.3611,
)


def build_tiny_flux_kontext(out: Path, needs: dict) -> dict:
    """builtin:tiny-flux-kontext: a FluxKontextPipeline folder (tiny-flux's transformer and text encoder configs,
    its own seed, an 8x VAE)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel

    with quiet_hf_libraries():
        from diffusers import FluxKontextPipeline
    with deterministic_cpu(_SEED + 3, BUILD_THREADS):
        vae = AutoencoderKL(**TINY_KONTEXT_VAE)
        text_encoder = CLIPTextModel(tiny_clip_config())
        text_encoder_2 = tiny_t5_encoder(d_model=32)
        transformer = FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER)
    pipeline = FluxKontextPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**TINY_FLUX_SCHEDULER),
        vae=vae.eval(),
        text_encoder=text_encoder,
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_t5_tokenizer(),
    )
    return save_pipeline(pipeline, out, transformer, {})


TINY_FLOW = BuiltinModel(
    name="tiny-flow",
    folder_name="tiny-flow-v1",
    family="flow",
    description="SD3-class pipeline: ~0.1 M-parameter SD3 transformer, CLIP x2 + T5, trained 16-channel VAE",
    build=build_tiny_flow,
    trained_parts=(FLOW_VAE_PART.name,),
)
TINY_FLUX = BuiltinModel(
    name="tiny-flux",
    folder_name="tiny-flux-v1",
    family="flow",
    description="Flux-class pipeline: ~0.1 M-parameter Flux transformer with guidance embedding, CLIP + T5, "
    "trained 16-channel VAE",
    build=build_tiny_flux,
    trained_parts=(FLOW_VAE_PART.name,),
)

TINY_FLUX_KONTEXT = BuiltinModel(
    name="tiny-flux-kontext",
    folder_name="tiny-flux-kontext-v1",
    family="flow",
    description="FLUX.1 Kontext pipeline: tiny-flux's transformer and text encoders (own seed), random 8x VAE; "
    "trains on source/target pairs",
    build=build_tiny_flux_kontext,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


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
    import torch

    side = 2 * square_side(tokens)
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
    import torch

    side = square_side(tokens)
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


SD3_ACTIVATION_CASES = (
    Case(
        "sd3",
        "SD3 (MMDiT, head dim 64)",
        _sd3,
        _sd3_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("transformer_blocks"),
    ),
)
FLUX_ACTIVATION_CASES = (
    Case(
        "flux1",
        "Flux.1 (double + single blocks, head dim 128)",
        _flux,
        _flux_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("transformer_blocks", "single_transformer_blocks"),
    ),
)
