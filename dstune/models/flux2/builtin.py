"""Built-in tiny FLUX.2 [klein]: `builtin:tiny-flux2`, a real Flux2KleinPipeline folder with tiny components.

Flux2Transformer2DModel (one double-stream and one single-stream block, 32 wide, 4-axis RoPE), AutoencoderKLFlux2
(8 latent channels, spatial factor 2, its batch-norm statistics at their initial values: the VAE is random, so
renders are noise-like images, which is all the tests need), a Qwen3 causal LM of 27 layers 32 wide (the pipeline
reads the hidden states of layers 9, 18 and 27) and the byte-level tokenizer of dstune.builtin.parts with a
Qwen3-style chat template, built offline from fixed configs and a fixed seed.

`builtin:tiny-flux2-dev` is FLUX.2 [dev]'s Flux2Pipeline folder: the same transformer shape with a guidance
embedding and the same VAE, a tiny Mistral3ForConditionalGeneration, and as its `tokenizer` a byte-level fast
tokenizer with Mistral's special tokens and chat template, standing where a real folder's PixtralProcessor goes:
transformers 5 refuses to build that processor without torchvision, which the tested environment cannot import
(docs/family-flow.md, FLUX.2 [dev]). Flux2Pipeline only calls its apply_chat_template, which both have.
"""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, bytes_to_unicode, deterministic_cpu, save_pipeline
from dstune.builtin.parts import TINY_FLUX2_VAE, tiny_mistral3_config, tiny_qwen_tokenizer
from dstune.builtin.parts import QWEN3_CHAT_TEMPLATE
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, TRANSFORMER_SIZES, attr, mse, randn, square_side

_SEED = 40
_DEV_SEED = 41
TEXT_WIDTH = 32
# in_channels == 4 x latent_channels (the VAE patchifies 2x2); joint_attention_dim == 3 text layers x TEXT_WIDTH;
# sum(axes_dims_rope) == attention_head_dim
TINY_FLUX2_TRANSFORMER = dict(
    patch_size=1,
    in_channels=32,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=3 * TEXT_WIDTH,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
FLUX2_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


def build_tiny_flux2(out: Path, needs: dict) -> dict:
    """builtin:tiny-flux2: a Flux2KleinPipeline folder."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with quiet_hf_libraries():
        from diffusers import Flux2KleinPipeline
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=TEXT_WIDTH,
                intermediate_size=64,
                num_hidden_layers=27,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                max_position_embeddings=1024,
                bos_token_id=end_of_text,
                eos_token_id=end_of_text,
                pad_token_id=end_of_text,
            )
        )
        vae = AutoencoderKLFlux2(**TINY_FLUX2_VAE)
        transformer = Flux2Transformer2DModel(**TINY_FLUX2_TRANSFORMER)
    pipeline = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return save_pipeline(pipeline, out, transformer)


TINY_FLUX2 = BuiltinModel(
    name="tiny-flux2",
    folder_name="tiny-flux2-v1",
    family="flow",
    description="FLUX.2 [klein] pipeline: one double- and one single-stream Flux2 block, Qwen3 causal LM (27 layers "
    "32 wide), random 8-channel FLUX.2 VAE",
    build=build_tiny_flux2,
)


# Mistral's special tokens as Mistral-Small-3 (FLUX.2 [dev]'s text encoder) numbers them: the controls first
MISTRAL_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
)
# The Mistral chat format Flux2Pipeline's messages go through: content given as a list of {"type": "text"} parts
# (format_input's layout) or as a string; system -> [SYSTEM_PROMPT]..[/SYSTEM_PROMPT], user -> [INST]..[/INST]
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_TEXT_LAYERS = 30  # Flux2Pipeline reads the hidden states of layers 10, 20 and 30


def tiny_mistral_tokenizer():
    """A byte-level fast tokenizer (Mistral's special tokens, then the 256 bytes; no merges) with the Mistral chat
    template, built in memory with the tokenizers library. It stands where a real FLUX.2 [dev] folder has its
    PixtralProcessor, which transformers 5 refuses to build without torchvision (docs/family-flow.md)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: number for number, token in enumerate(MISTRAL_SPECIAL_TOKENS)}
    vocab.update({char: len(MISTRAL_SPECIAL_TOKENS) + number for number, char in enumerate(bytes_to_unicode())})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(MISTRAL_SPECIAL_TOKENS[3:])})
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def tiny_mistral3_encoder(tokenizer):
    """Mistral3ForConditionalGeneration: a 30-layer, 32-wide Mistral text model and a one-layer Pixtral vision
    tower (which text-to-image never calls)."""
    from transformers import Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration(tiny_mistral3_config(tokenizer, TEXT_WIDTH, MISTRAL_TEXT_LAYERS, "[IMG]"))


def build_tiny_flux2_dev(out: Path, needs: dict) -> dict:
    """builtin:tiny-flux2-dev: a Flux2Pipeline folder (klein's transformer shape with a guidance embedding and its
    VAE, a tiny Mistral3 and the stand-in tokenizer saved as the folder's `tokenizer`)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    tokenizer = tiny_mistral_tokenizer()
    with deterministic_cpu(_DEV_SEED, BUILD_THREADS):
        text_encoder = tiny_mistral3_encoder(tokenizer)
        vae = AutoencoderKLFlux2(**TINY_FLUX2_VAE)
        transformer = Flux2Transformer2DModel(**{**TINY_FLUX2_TRANSFORMER, "guidance_embeds": True})
    pipeline = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return save_pipeline(pipeline, out, transformer)


TINY_FLUX2_DEV = BuiltinModel(
    name="tiny-flux2-dev",
    folder_name="tiny-flux2-dev-v1",
    family="flow",
    description="FLUX.2 [dev] pipeline: klein's tiny Flux2 transformer with a guidance embedding and VAE, a "
    "Mistral3 (30 text layers 32 wide, one-layer Pixtral vision tower) and a byte-level stand-in for "
    "the PixtralProcessor with Mistral's chat template",
    build=build_tiny_flux2_dev,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


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
    import torch

    from diffusers import Flux2Pipeline

    side = square_side(tokens)
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


ACTIVATION_CASES = (
    Case(
        "flux2",
        "FLUX.2 [klein] and [dev] (one transformer class)",
        _flux2,
        _flux2_run,
        sizes=TRANSFORMER_SIZES,
        check_size=(25, 12),
        block_lists=attr("transformer_blocks", "single_transformer_blocks"),
    ),
)
