"""Built-in tiny Krea 2: `builtin:tiny-krea2` (the base, "Raw" layout) and `builtin:tiny-krea2-turbo` (the few-step
distilled layout), real Krea2Pipeline folders with tiny components.

Krea2Transformer2DModel (two 32-wide blocks, one text-fusion block of each kind), a random 16-channel
AutoencoderKLQwenImage (dstune.builtin.parts' config), a Qwen3VLModel text encoder (three 32-wide text layers and a
one-block vision tower the pipeline never calls for text-to-image) and the byte-level Qwen2 tokenizer of
dstune.builtin.parts, built offline from fixed configs and fixed seeds. The pipeline stacks the text encoder's hidden
states of TEXT_LAYERS (the real model taps 12 of Qwen3-VL-4B's 37), so the transformer's num_text_layers is 2.

The two folders differ as the released checkpoints do: the Turbo folder's model_index.json says is_distilled
(Krea2Pipeline then samples with the fixed shift mu = 1.15 instead of the resolution's) and its transformer has
other weights (another seed); the VAE, text encoder, tokenizer, scheduler and every config are the same, so a LoRA
trained on one loads on the other.
"""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, save_pipeline
from dstune.builtin.parts import TINY_QWEN_VAE, tiny_qwen_tokenizer
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, TRANSFORMER_SIZES, attr, mse, randn, square_side

_SEED = 60  # the VAE and the text encoder (the same in both folders) and the Raw transformer
_TURBO_SEED = 61  # the Turbo folder's transformer
TEXT_WIDTH = 32  # the text encoder's hidden size = the transformer's text_hidden_dim
TEXT_LAYERS = (1, 3)  # indices into the encoder's hidden_states (0: the embeddings), as text_encoder_select_layers
# in_channels == 4 x the VAE's z_dim (2x2 packing); sum(axes_dims_rope) == attention_head_dim
TINY_KREA2_TRANSFORMER = dict(
    in_channels=64,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    timestep_embed_dim=32,
    text_hidden_dim=TEXT_WIDTH,
    num_text_layers=len(TEXT_LAYERS),
    text_num_attention_heads=2,
    text_num_key_value_heads=2,
    text_intermediate_size=64,
    num_layerwise_text_blocks=1,
    num_refiner_text_blocks=1,
    axes_dims_rope=(4, 6, 6),
)
# the released scheduler: resolution-aware exponential dynamic shifting (the training tables are then unshifted)
KREA2_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=6400,
    time_shift_type="exponential",
)


def tiny_qwen3_vl_encoder(tokenizer):
    """Qwen3VLModel with three 32-wide text layers and a one-block vision tower."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    end_of_text, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_WIDTH,
            intermediate_size=64,
            num_hidden_layers=max(TEXT_LAYERS),
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=2048,
            pad_token_id=end_of_text,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
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
            num_position_embeddings=64,
            deepstack_visual_indexes=[],
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=end_of_text,
        eos_token_id=im_end,
        pad_token_id=end_of_text,
    )
    return Qwen3VLModel(config)


def _build_tiny_krea2(out: Path, distilled: bool) -> dict:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel

    with quiet_hf_libraries():
        from diffusers import Krea2Pipeline
    tokenizer = tiny_qwen_tokenizer()
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_qwen3_vl_encoder(tokenizer)
        vae = AutoencoderKLQwenImage(**TINY_QWEN_VAE)
        transformer = Krea2Transformer2DModel(**TINY_KREA2_TRANSFORMER)
    if distilled:
        with deterministic_cpu(_TURBO_SEED, BUILD_THREADS):
            transformer = Krea2Transformer2DModel(**TINY_KREA2_TRANSFORMER)
    pipeline = Krea2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**KREA2_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        text_encoder_select_layers=TEXT_LAYERS,
        is_distilled=distilled,
    )
    return save_pipeline(pipeline, out, transformer)


def build_tiny_krea2(out: Path, needs: dict) -> dict:
    """builtin:tiny-krea2: a Krea2Pipeline folder of the base (Raw) layout."""
    return _build_tiny_krea2(out, distilled=False)


def build_tiny_krea2_turbo(out: Path, needs: dict) -> dict:
    """builtin:tiny-krea2-turbo: the distilled layout (is_distilled, its own transformer weights)."""
    return _build_tiny_krea2(out, distilled=True)


TINY_KREA2 = BuiltinModel(
    name="tiny-krea2",
    folder_name="tiny-krea2-v1",
    family="flow",
    description="Krea 2 (Raw) pipeline: 2-block Krea 2 transformer, Qwen3-VL text encoder (three 32-wide layers, "
    "two tapped), random 16-channel AutoencoderKLQwenImage",
    build=build_tiny_krea2,
)
TINY_KREA2_TURBO = BuiltinModel(
    name="tiny-krea2-turbo",
    folder_name="tiny-krea2-turbo-v1",
    family="flow",
    description="Krea 2 Turbo layout: tiny-krea2's parts, is_distilled, and a transformer of its own weights",
    build=build_tiny_krea2_turbo,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


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
    import torch

    from diffusers import Krea2Pipeline

    side = square_side(tokens)
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


ACTIVATION_CASES = (
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
)
