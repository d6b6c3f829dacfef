"""Built-in tiny Ideogram 4: `builtin:tiny-ideogram4`, a real Ideogram4Pipeline folder with tiny components.

Two Ideogram4Transformer2DModel (the trained `transformer` and the frozen `unconditional_transformer` the pipeline's
asymmetric guidance blends in; one block each, 32 wide, 3-axis MRoPE), a random 8-channel AutoencoderKLFlux2
(dstune.builtin.parts' config, its batch-norm statistics at their initial values), a Qwen3VLModel of 36 text layers 16 wide
(the pipeline concatenates the hidden states of 13 of them, up to layer 35) with a one-block vision tower the
text-to-image pipeline never calls, and the byte-level tokenizer of dstune.builtin.parts with a Qwen3-VL style
chat template that reads the `{"type": "text"}` content parts the pipeline writes. Built offline from fixed
configs and a fixed seed.

The tokenizer's model_max_length is 128, so the text side defaults to 128 tokens per caption here (the training
example's default, 2048, applies to real folders): a byte-level tokenizer spends one token per byte, and the
shapes captions in their chat template fit in 128.
"""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, save_pipeline
from dstune.builtin.parts import QWEN3_VL_CHAT_TEMPLATE, TINY_FLUX2_VAE, tiny_qwen3_vl_config
from dstune.builtin.parts import tiny_qwen_tokenizer
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, TRANSFORMER_SIZES, attr, mse, randn, square_side

_SEED = 50
TEXT_WIDTH = 16
TEXT_LAYERS = 36  # Ideogram4Pipeline reads layers 0, 3, ..., 33 and 35 (QWEN3_VL_ACTIVATION_LAYERS)
TAPPED_LAYERS = 13
TEXT_TOKENS = 128
# in_channels == 4 x the VAE's latent channels (2x2 patches); llm_features_dim == 13 tapped layers x TEXT_WIDTH;
# sum(mrope_section) == attention_head_dim / 2
TINY_IDEOGRAM4_TRANSFORMER = dict(
    in_channels=4 * TINY_FLUX2_VAE["latent_channels"],
    num_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    intermediate_size=64,
    adaln_dim=16,
    llm_features_dim=TAPPED_LAYERS * TEXT_WIDTH,
    rope_theta=10_000,
    mrope_section=(4, 2, 2),
)
# A Qwen3-VL chat format: content given as a list of {"type": "text"} parts (what Ideogram4Pipeline writes) or text


def tiny_qwen3_vl_encoder(tokenizer):
    """Qwen3VLModel: 36 text layers 16 wide and a one-block vision tower (text-to-image never calls it)."""
    from transformers import Qwen3VLModel

    return Qwen3VLModel(tiny_qwen3_vl_config(tokenizer, TEXT_WIDTH, TEXT_LAYERS))


def build_tiny_ideogram4(out: Path, needs: dict) -> dict:
    """builtin:tiny-ideogram4: an Ideogram4Pipeline folder."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Transformer2DModel

    with quiet_hf_libraries():
        from diffusers import Ideogram4Pipeline
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    tokenizer.model_max_length = TEXT_TOKENS
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_qwen3_vl_encoder(tokenizer)
        vae = AutoencoderKLFlux2(**TINY_FLUX2_VAE)
        transformer = Ideogram4Transformer2DModel(**TINY_IDEOGRAM4_TRANSFORMER)
        unconditional = Ideogram4Transformer2DModel(**TINY_IDEOGRAM4_TRANSFORMER)
    pipeline = Ideogram4Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        unconditional_transformer=unconditional,
    )
    return save_pipeline(pipeline, out, transformer)


TINY_IDEOGRAM4 = BuiltinModel(
    name="tiny-ideogram4",
    folder_name="tiny-ideogram4-v1",
    family="flow",
    description="Ideogram 4 pipeline: two one-block Ideogram 4 transformers (conditional, unconditional), Qwen3-VL "
    "(36 text layers 16 wide), random 8-channel AutoencoderKLFlux2",
    build=build_tiny_ideogram4,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


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
    import torch

    from diffusers import Ideogram4Pipeline

    side = square_side(tokens)
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


ACTIVATION_CASES = (
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
)
