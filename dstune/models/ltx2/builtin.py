"""Built-in tiny LTX-2: `builtin:tiny-ltx2`, a real LTX2Pipeline folder (video with its audio) with tiny components.

- LTX2VideoTransformer3DModel: two blocks, video stream 2 heads x 8 (16 wide) and audio stream 2 heads x 8, patch
  1x1x1; video in_channels 8 (the VAE's latent channels), audio in_channels 8 (2 audio latent channels x 4 latent
  mel bins, as the real 128 = 8 x 16); RoPE's VAE factors (4, 8, 8) are the tiny VAE's;
- AutoencoderKLLTX2Video: the real causal layout (a 2x2 pixel patch, then a spatial, a temporal and a
  spatio-temporal down stage) at widths 8-16 with 8 latent channels: 8x spatial and 4x temporal compression (the
  real VAE: 32x and 8x, 128 channels), so a 9-frame 32 x 32 clip is an (8, 3, 4, 4) latent, 48 tokens. Untrained:
  renders are noise-like clips;
- AutoencoderKLLTX2Audio: stereo mel spectrograms of 16 bins (the real: 64) at 16 kHz with a 160-sample hop, 2
  latent channels, 4x down in time and in mel bins (the class's fixed factor); LTX2Vocoder: 32 mel channels in
  (2 x 16), two 2x upsampling stages, stereo out at 16 kHz;
- Gemma3ForConditionalGeneration (the pipeline's text encoder class): a two-layer 16-wide Gemma 3 text model with a
  one-layer 16-wide SigLIP tower (never used for text), and a byte-fallback GemmaTokenizer (Gemma's special tokens
  and the 256 byte tokens, built without files); the pipeline stacks all three hidden states, so a caption is
  (tokens, 48) before the connectors;
- LTX2TextConnectors: one 16-wide layer per modality with 8 learnable registers (the real: 128), turning the
  stacked Gemma states into the video and audio text embeddings (16 wide = the transformer's caption_channels);
- FlowMatchEulerDiscreteScheduler with LTX-2's resolution-dependent shift (base 0.95 at 1024 tokens to 2.05 at
  4096), as the real folder's.
"""

from __future__ import annotations

from pathlib import Path

from dstune.spec.section import VIDEO_FAMILY
from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, save_pipeline
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, attr, mse, randn, square_side
from dstune.models.ltx2.card import AV_CAPTION_TOKENS

_SEED = 70
TEXT_WIDTH = 16  # Gemma 3's hidden size = the connectors' caption_channels = the transformer's caption_channels
TEXT_LAYERS = 2  # the pipeline stacks the embeddings and every layer's states: 3 x 16 per token
VIDEO_LATENT_CHANNELS = 8
AUDIO_LATENT_CHANNELS, AUDIO_MEL_BINS = 2, 16  # packed audio tokens: 2 channels x 16 / 4 latent mel bins = 8 wide
SPATIAL, TEMPORAL = 8, 4  # the tiny VAE's compression (the real one's: 32, 8)
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")

TINY_LTX2_TRANSFORMER = dict(
    in_channels=VIDEO_LATENT_CHANNELS,
    out_channels=VIDEO_LATENT_CHANNELS,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    vae_scale_factors=(TEMPORAL, SPATIAL, SPATIAL),
    audio_in_channels=AUDIO_LATENT_CHANNELS * AUDIO_MEL_BINS // 4,
    audio_out_channels=AUDIO_LATENT_CHANNELS * AUDIO_MEL_BINS // 4,
    audio_num_attention_heads=2,
    audio_attention_head_dim=8,
    audio_cross_attention_dim=16,
    num_layers=2,
    caption_channels=TEXT_WIDTH,
)
TINY_LTX2_CONNECTORS = dict(
    caption_channels=TEXT_WIDTH,
    text_proj_in_factor=TEXT_LAYERS + 1,
    video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=8,
    video_connector_num_layers=1,
    video_connector_num_learnable_registers=8,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=8,
    audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=8,
    connector_rope_base_seq_len=64,
)
TINY_LTX2_VAE = dict(
    latent_channels=VIDEO_LATENT_CHANNELS,
    block_out_channels=(8, 16, 16),
    decoder_block_out_channels=(8, 16),
    layers_per_block=(1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1),
    spatio_temporal_scaling=(True, True, True),
    decoder_spatio_temporal_scaling=(True, True),
    decoder_inject_noise=(False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True),
    upsample_factor=(2, 2),
    patch_size=2,
    patch_size_t=1,
    spatial_compression_ratio=SPATIAL,
    temporal_compression_ratio=TEMPORAL,
)
# base_channels = latent channels x latent mel bins: the size of the per-channel statistics the pipeline normalises by
TINY_LTX2_AUDIO_VAE = dict(
    base_channels=AUDIO_LATENT_CHANNELS * AUDIO_MEL_BINS // 4,
    output_channels=2,
    ch_mult=(1, 2, 2),
    num_res_blocks=1,
    in_channels=2,
    resolution=32,
    latent_channels=AUDIO_LATENT_CHANNELS,
    mel_bins=AUDIO_MEL_BINS,
    sample_rate=16000,
    mel_hop_length=160,
)
TINY_LTX2_VOCODER = dict(
    in_channels=2 * AUDIO_MEL_BINS,
    hidden_channels=16,
    out_channels=2,
    upsample_kernel_sizes=[4, 4],
    upsample_factors=[2, 2],
    resnet_kernel_sizes=[3],
    resnet_dilations=[[1, 3]],
    output_sampling_rate=16000,
)
# LTX2Pipeline's resolution-dependent shift (calculate_shift over the video tokens), as the real folder's scheduler
LTX2_SCHEDULER = dict(
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
)


def tiny_gemma_tokenizer():
    """A byte-fallback GemmaTokenizer: Gemma's special tokens, then one token per byte (<0x00>..<0xFF>)."""
    from transformers import GemmaTokenizer

    vocab = {token: number for number, token in enumerate(GEMMA_SPECIALS)}
    vocab.update({f"<0x{byte:02X}>": len(GEMMA_SPECIALS) + byte for byte in range(256)})
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=1024)


def tiny_gemma3(tokenizer):
    """Gemma3ForConditionalGeneration: a two-layer 16-wide text model and a one-layer SigLIP tower."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    pad, eos, bos, unk = tokenizer.convert_tokens_to_ids(["<pad>", "<eos>", "<bos>", "<unk>"])
    config = Gemma3Config(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_WIDTH,
            intermediate_size=32,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=2048,
            sliding_window=64,
            pad_token_id=pad,
            eos_token_id=eos,
            bos_token_id=bos,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
        boi_token_index=bos,
        eoi_token_index=eos,
        image_token_index=unk,
    )
    return Gemma3ForConditionalGeneration(config)


def ltx2_parts() -> dict:
    """Every component of the tiny LTX2Pipeline folder (seeded)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = tiny_gemma_tokenizer()
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_gemma3(tokenizer)
        connectors = LTX2TextConnectors(**TINY_LTX2_CONNECTORS)
        vae = AutoencoderKLLTX2Video(**TINY_LTX2_VAE)
        audio_vae = AutoencoderKLLTX2Audio(**TINY_LTX2_AUDIO_VAE)
        vocoder = LTX2Vocoder(**TINY_LTX2_VOCODER)
        transformer = LTX2VideoTransformer3DModel(**TINY_LTX2_TRANSFORMER)
    return dict(
        transformer=transformer,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        vocoder=vocoder,
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER),
    )


def build_tiny_ltx2(out: Path, needs: dict) -> dict:
    """builtin:tiny-ltx2: an LTX2Pipeline folder."""
    with quiet_hf_libraries():
        from diffusers import LTX2Pipeline
    parts = ltx2_parts()
    return save_pipeline(LTX2Pipeline(**parts), out, parts["transformer"])


TINY_LTX2 = BuiltinModel(
    name="tiny-ltx2",
    folder_name="tiny-ltx2-v1",
    family=VIDEO_FAMILY,
    description="LTX-2 audio+video pipeline: 2-block LTX2 transformer (16-wide video and audio streams), an 8-channel "
    "causal video VAE (8x spatial, 4x temporal), a 16-bin stereo audio VAE and vocoder, a two-layer "
    "16-wide Gemma 3 text encoder and one-layer text connectors",
    build=build_tiny_ltx2,
)


# ------------------------------------------------------------------------------- LTX-2.3 and LTX-2.5
# What the conversion of Lightricks' 2.3 and 2.5 checkpoints to diffusers sets (scripts/convert_ltx2_to_diffusers.py
# in diffusers), at the tiny widths: the transformer without its caption projections (the connectors project per
# modality instead), gated attention and the prompt's cross-attention modulated by sigma, split RoPE; the 2.5
# transformer's video feed-forward without bias and its keyframe embedding. The audio stream is 8 wide here (2 x 4,
# half the video's, as the real 2,048 against 4,096), so that a swapped width fails.
AUDIO_WIDTH_23 = 8
TINY_LTX23_TRANSFORMER = dict(
    TINY_LTX2_TRANSFORMER,
    audio_attention_head_dim=AUDIO_WIDTH_23 // 2,
    audio_cross_attention_dim=AUDIO_WIDTH_23,
    gated_attn=True,
    cross_attn_mod=True,
    audio_gated_attn=True,
    audio_cross_attn_mod=True,
    rope_type="split",
    use_prompt_embeddings=False,
    perturbed_attn=True,
)
TINY_LTX25_TRANSFORMER = dict(TINY_LTX23_TRANSFORMER, ff_bias=False, use_keyframes_abs_pos_embedding=True)
# per-modality projections: the stacked text states RMS-normalised per token, then one projection per stream, to
# the transformer's cross-attention widths (the real: 4,096 and 2,048)
TINY_LTX23_CONNECTORS = dict(
    TINY_LTX2_CONNECTORS,
    audio_connector_attention_head_dim=AUDIO_WIDTH_23 // 2,
    video_gated_attn=True,
    audio_gated_attn=True,
    rope_type="split",
    per_modality_projections=True,
    video_hidden_dim=TINY_LTX2_TRANSFORMER["cross_attention_dim"],
    audio_hidden_dim=AUDIO_WIDTH_23,
    proj_bias=True,
)
TINY_DURATION_HEAD = dict(
    video_cross_attention_dim=TINY_LTX2_TRANSFORMER["cross_attention_dim"],
    audio_cross_attention_dim=AUDIO_WIDTH_23,
    pooler_hidden_dim=16,
    num_queries=1,
    num_pooler_heads=2,
    mlp_hidden_dim=16,
)


def tiny_gemma4(tokenizer):
    """Gemma4UnifiedForConditionalGeneration (LTX-2.5's text encoder class): a two-layer 16-wide text model, one
    sliding and one full attention layer, no vision or audio tower."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    pad, eos, bos, unk = tokenizer.convert_tokens_to_ids(["<pad>", "<eos>", "<bos>", "<unk>"])
    config = Gemma4UnifiedConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_WIDTH,
            intermediate_size=32,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=2048,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
            pad_token_id=pad,
            eos_token_id=eos,
            bos_token_id=bos,
        ),
        boi_token_id=bos,
        eoi_token_id=eos,
        image_token_id=unk,
        video_token_id=unk,
        boa_token_id=bos,
        eoa_token_index=eos,
        audio_token_id=unk,
    )
    return Gemma4UnifiedForConditionalGeneration(config)


def ltx23_parts(version: str) -> dict:
    """Every component of a tiny LTX-2.3 ("2.3") or LTX-2.5 ("2.5": Gemma 4 and the duration head) folder."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.duration_head import LTX2DurationHead

    parts = ltx2_parts()  # the VAEs, vocoder, tokenizer and scheduler as LTX-2.0's
    later = version == "2.5"
    with deterministic_cpu(_SEED + 1, BUILD_THREADS):
        if later:
            parts["text_encoder"] = tiny_gemma4(parts["tokenizer"])
            parts["duration_head"] = LTX2DurationHead(**TINY_DURATION_HEAD)
        parts["connectors"] = LTX2TextConnectors(**TINY_LTX23_CONNECTORS)
        transformer = TINY_LTX25_TRANSFORMER if later else TINY_LTX23_TRANSFORMER
        parts["transformer"] = LTX2VideoTransformer3DModel(**transformer)
    return parts


def build_tiny_ltx23(version: str):
    def build(out: Path, needs: dict) -> dict:
        with quiet_hf_libraries():
            from diffusers import LTX2Pipeline
        parts = ltx23_parts(version)
        return save_pipeline(LTX2Pipeline(**parts), out, parts["transformer"])

    return build


TINY_LTX23 = BuiltinModel(
    name="tiny-ltx2-3",
    folder_name="tiny-ltx2-3-v1",
    family=VIDEO_FAMILY,
    description="LTX-2.3 audio+video pipeline: tiny-ltx2's parts with 2.3's transformer (gated attention, "
    "sigma-modulated prompt attention, no caption projection; an 8-wide audio stream) and text connectors with "
    "per-modality projections",
    build=build_tiny_ltx23("2.3"),
)
TINY_LTX25 = BuiltinModel(
    name="tiny-ltx2-5",
    folder_name="tiny-ltx2-5-v1",
    family=VIDEO_FAMILY,
    description="LTX-2.5 audio+video pipeline: tiny-ltx2-3 with a two-layer 16-wide Gemma 4 text encoder, 2.5's "
    "transformer (video feed-forward without bias, keyframe embedding) and a duration head",
    build=build_tiny_ltx23("2.5"),
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


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


def _ltx2_run(model, tokens, context, dtype, per_token: bool = False):
    """As dstune trains it (dstune.models.ltx2.model): `tokens` = 2 latent frames x side^2 video tokens, the audio
    stream on one zero token isolated from the video, `context` caption tokens for both streams; with `per_token`
    (image-to-video) a timestep per video token, the first frame's 0, so a modulation per token."""
    import torch

    side = square_side(tokens // 2)
    config = model.config
    video = randn(1, tokens, config.in_channels, dtype=dtype)
    audio = torch.zeros(1, 1, config.audio_in_channels, dtype=dtype)
    text = randn(1, context, config.caption_channels, dtype=dtype)
    mask = torch.ones(1, context, dtype=torch.long)
    sigma = torch.tensor([0.5], dtype=dtype)
    timestep = sigma
    if per_token:
        timestep = torch.full((1, tokens), 0.5, dtype=dtype)
        timestep[:, : side * side] = 0.0
    return lambda: mse(
        model(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=text,
            audio_encoder_hidden_states=text,
            timestep=timestep,
            audio_timestep=sigma,
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


def _ltx2_av_run(model, tokens, context, dtype):
    """A clip with sound, as dstune trains it (dstune.models.ltx2.model, Ltx2.loss): `tokens` video tokens (2 latent frames x
    side^2) and `context` sound tokens in one call, both streams attending each other (isolate_modalities off), the
    caption fixed at AV_CAPTION_TOKENS; the loss the video's plus the sound's."""
    import torch

    side = square_side(tokens // 2)
    config = model.config
    video = randn(1, tokens, config.in_channels, dtype=dtype)
    audio = randn(1, context, config.audio_in_channels, dtype=dtype)
    text = randn(1, AV_CAPTION_TOKENS, config.caption_channels, dtype=dtype)
    mask = torch.ones(1, AV_CAPTION_TOKENS, dtype=torch.long)
    sigma = torch.tensor([0.5], dtype=dtype)

    def loss():
        video_out, audio_out = model(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=text,
            audio_encoder_hidden_states=text,
            timestep=sigma,
            sigma=sigma,
            audio_sigma=sigma,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=2,
            height=side,
            width=side,
            fps=24.0,
            audio_num_frames=context,
            isolate_modalities=False,
            return_dict=False,
        )[:2]
        return mse(video_out) + mse(audio_out)

    return loss


# the three cases' measurement grid: (clip tokens, caption tokens; ltx2-av: sound tokens) fitted at three sizes,
# checked at a fourth
MEASURED_AT = {"sizes": ((32, 8), (72, 8), (32, 24)), "check_size": (50, 12), "block_lists": attr("transformer_blocks")}

ACTIVATION_CASES = (
    Case(
        "ltx2-av",
        "LTX-2 with sound (both streams, audio-to-video and video-to-audio attention; caption fixed: its bytes are "
        "ltx2's)",
        _ltx2,
        _ltx2_av_run,
        **MEASURED_AT,
    ),
    Case(
        "ltx2",
        "LTX-2 video stream (the audio stream on one zero token, as dstune trains it)",
        _ltx2,
        _ltx2_run,
        **MEASURED_AT,
    ),
    Case(
        "ltx2-i2v",
        "LTX-2 image-to-video: the video stream with a timestep per token (the first frame's 0)",
        _ltx2,
        lambda model, tokens, context, dtype: _ltx2_run(model, tokens, context, dtype, per_token=True),
        **MEASURED_AT,
    ),
)
