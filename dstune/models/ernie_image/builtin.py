"""Built-in tiny ERNIE-Image: `builtin:tiny-ernie-image`, a real ErnieImagePipeline folder with tiny components.

ErnieImageTransformer2DModel (two 32-wide blocks of 2 heads, rotary axes (4, 6, 6) summing to the head dimension as
the released (32, 48, 48) does), a random 8-channel AutoencoderKLFlux2 (dstune.builtin.parts' config, its batch-norm
statistics at their initial values), a Mistral3Model text encoder (three 32-wide text layers; the pipeline reads the
second-to-last hidden states; a one-layer Pixtral vision tower text-to-image never calls) and a byte-level fast
tokenizer with Mistral's <s> / </s> that adds <s> as the released tokenizer does, built offline from fixed configs
and a fixed seed. The optional prompt enhancer (`pe`, `pe_tokenizer`) is left out, as the pipeline allows: it
rewrites prompts at sampling time only and plays no part in training.
"""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, bytes_to_unicode, deterministic_cpu, save_pipeline
from dstune.builtin.parts import TINY_FLUX2_VAE, tiny_mistral3_config
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, TRANSFORMER_SIZES, attr, mse, randn, square_side

_SEED = 70
TEXT_WIDTH = 32
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
# in_channels == out_channels == 4 x the VAE's latent channels (2x2 patchified); text_in_dim == the text width;
# sum(rope_axes_dim) == hidden_size / num_attention_heads
TINY_ERNIE_TRANSFORMER = dict(
    hidden_size=32,
    num_attention_heads=2,
    num_layers=2,
    ffn_hidden_size=96,
    in_channels=4 * TINY_FLUX2_VAE["latent_channels"],
    out_channels=4 * TINY_FLUX2_VAE["latent_channels"],
    patch_size=1,
    text_in_dim=TEXT_WIDTH,
    rope_theta=256,
    rope_axes_dim=(4, 6, 6),
)
ERNIE_SCHEDULER = dict(num_train_timesteps=1000, shift=4.0, use_dynamic_shifting=False)  # the released scheduler


def tiny_byte_tokenizer():
    """A byte-level fast tokenizer (the special tokens, then the 256 bytes; no merges) that starts every encoding
    with <s>, built in memory with the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: number for number, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + number for number, char in enumerate(bytes_to_unicode())})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
    )


def tiny_mistral3_model(tokenizer):
    """Mistral3Model: three 32-wide Mistral text layers and a one-layer Pixtral vision tower."""
    from transformers import Mistral3Model

    return Mistral3Model(tiny_mistral3_config(tokenizer, TEXT_WIDTH, 3, "<unk>"))


def _randomise_zero_init(transformer) -> None:
    """The class starts its shared modulation and its output layer at zero (every block's gate closed, a zero
    output), which a released checkpoint is not: a LoRA on the blocks would get no gradient. Drawn small here."""
    import torch

    for layer in (transformer.adaLN_modulation[-1], transformer.final_linear):
        torch.nn.init.normal_(layer.weight, std=0.05)
        torch.nn.init.normal_(layer.bias, std=0.05)


def build_tiny_ernie_image(out: Path, needs: dict) -> dict:
    """builtin:tiny-ernie-image: an ErnieImagePipeline folder (no prompt enhancer)."""
    from diffusers import AutoencoderKLFlux2, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler

    with quiet_hf_libraries():
        from diffusers import ErnieImagePipeline
    tokenizer = tiny_byte_tokenizer()
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_mistral3_model(tokenizer)
        vae = AutoencoderKLFlux2(**TINY_FLUX2_VAE)
        transformer = ErnieImageTransformer2DModel(**TINY_ERNIE_TRANSFORMER)
        _randomise_zero_init(transformer)
    pipeline = ErnieImagePipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**ERNIE_SCHEDULER),
    )
    return save_pipeline(pipeline, out, transformer)


TINY_ERNIE_IMAGE = BuiltinModel(
    name="tiny-ernie-image",
    folder_name="tiny-ernie-image-v1",
    family="flow",
    description="ERNIE-Image pipeline: 2-block ERNIE-Image transformer, Mistral3 text encoder (three 32-wide "
    "layers), random 8-channel AutoencoderKLFlux2, byte-level tokenizer; no prompt enhancer",
    build=build_tiny_ernie_image,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


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
    import torch

    side = square_side(tokens)
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


ACTIVATION_CASES = (
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
)
