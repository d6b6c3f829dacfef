"""Tiny components that several built-in models share (each unit's builtin*.py builds its model from them): a
byte-level Qwen2 tokenizer with Qwen's chat tokens and its chat templates, a tiny Qwen3-VL configuration, a T5
tokenizer over single characters, a trained 16-channel VAE (so renders are images, not noise), two tiny VAE
configurations and a flow-matching scheduler. Moving a part here changes no built model: the values are the
ones the models were built with.
"""

from __future__ import annotations

import functools
import string

from dstune.builtin.common import BUILD_THREADS, bytes_to_unicode, deterministic_cpu, train_tiny_vae
from dstune.builtin.trained import TrainedPart, give_trained_weights

_SEED = 0
FLOW_VAE_PART = TrainedPart("tiny-flow-vae", train_tiny_vae)  # the flow models' 16-channel VAE (dstune.builtin.trained)
T5_MAX_LENGTH = 32  # model_max_length of the tiny T5 tokenizer: caps max_sequence_length, keeps sequences short
# the trained 16-channel VAE, as builtin:tiny-sd's 4-channel one is trained (common.train_tiny_vae)
FLOW_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(8, 16),
    layers_per_block=1,
    norm_num_groups=1,
    sample_size=32,
    mid_block_add_attention=False,
    shift_factor=0.0,
)

QWEN_CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
# len(dim_mult) == len(temperal_downsample) + 1; spatial factor 2 ** len(temperal_downsample) = 2
TINY_QWEN_VAE = dict(
    base_dim=8, z_dim=16, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False]
)
# dynamic, exponential shifting as the real model's scheduler (its training tables are then unshifted)
QWEN_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    time_shift_type="exponential",
)
# a KL VAE that patchifies 2x2 (AutoencoderKLFlux2's layout)
TINY_FLUX2_VAE = dict(
    block_out_channels=(8, 16),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    layers_per_block=1,
    latent_channels=8,
    norm_num_groups=4,
    sample_size=32,
    mid_block_add_attention=False,
)


def tiny_qwen_tokenizer():
    """A byte-level Qwen2 tokenizer (256 byte ids + Qwen's end-of-text and chat tokens), built in memory."""
    from transformers import Qwen2Tokenizer

    vocab = {char: number for number, char in enumerate(bytes_to_unicode())}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=1024,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_CHAT_TOKENS)})
    return tokenizer


QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen3_vl_config(tokenizer, width: int, layers: int):
    """A tiny Qwen3-VL configuration: `layers` text layers `width` wide and a one-block vision tower (text-to-image
    never calls it), for the built-ins whose text encoder is a Qwen3VLModel or a Qwen3VLForConditionalGeneration."""
    from transformers import Qwen3VLConfig

    end_of_text, image_pad = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|image_pad|>"])
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=32,
            max_position_embeddings=1024,
            rope_theta=10_000.0,
            bos_token_id=end_of_text,
            eos_token_id=end_of_text,
            pad_token_id=end_of_text,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=width,
            patch_size=14,
            deepstack_visual_indexes=[],
        ),
        image_token_id=image_pad,
    )


def tiny_mistral3_config(tokenizer, width: int, text_layers: int, image_token: str):
    """A Mistral3Config: `text_layers` `width`-wide Mistral text layers and a one-layer Pixtral vision tower (which
    text-to-image never calls), its special ids from `tokenizer` (<s>, </s>, <pad>, and `image_token`)."""
    from transformers import Mistral3Config

    bos, eos, pad, image = tokenizer.convert_tokens_to_ids(["<s>", "</s>", "<pad>", image_token])
    return Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=64,
            num_hidden_layers=text_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=1024,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            patch_size=14,
            image_size=56,
        ),
        image_token_index=image,
        spatial_merge_size=2,
    )


def tiny_t5_tokenizer(model_max_length: int = T5_MAX_LENGTH):
    """A T5 tokenizer over single characters (Unigram, 124 ids; pad 0, eos 1, unk 2), built in memory."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("\u2581" + c, -2.5) for c in string.ascii_lowercase]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


@functools.lru_cache(maxsize=1)
def _trained_vae_state() -> tuple[dict, dict]:
    """(state dict, facts) of the trained 16-channel VAE; computed once per process for both built-in models."""
    from diffusers import AutoencoderKL

    with deterministic_cpu(_SEED, BUILD_THREADS):
        vae = AutoencoderKL(**FLOW_VAE)
        facts = give_trained_weights(FLOW_VAE_PART, vae)
    return {k: v.clone() for k, v in vae.state_dict().items()}, facts


def trained_flow_vae():
    from diffusers import AutoencoderKL

    state, facts = _trained_vae_state()
    vae = AutoencoderKL(**FLOW_VAE)
    vae.load_state_dict(state)
    vae.register_to_config(scaling_factor=facts["vae_scaling_factor"])
    return vae.eval().requires_grad_(False), dict(facts)
