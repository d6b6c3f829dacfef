"""builtin:tiny-orpheus: a tiny model in Orpheus's own format, made offline (registered in dstune.builtin).

A 2-layer Llama with Orpheus's vocabulary of 156938 ids (Llama-3's 128256 text ids, 10 added control tokens, 7 x 4096
audio ids) and tied embeddings, a byte-level tokenizer that puts its text bytes at ids 0..255, `<|begin_of_text|>`
at 128000, `<|eot_id|>` at 128009, `<custom_token_N>` at 128256 + N (the names Orpheus's tokenizer gives its
added tokens) and `<reserved_N>` at every other id (so that, as with Orpheus's tokenizer, added tokens get ids from
156938 on), a tiny SNAC at 24 kHz (512 samples per hop, strides 4, 2, 1: 7 codes per 2048-sample frame) in
`codec/`, and the `orpheus` layout in dstune_tts.json. Everything is seeded; SNAC's decoder noise is off so
decoding is deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstune.builtin.common import BuiltinModel, deterministic_cpu
from dstune.models.tts_lm.token_layouts import LLAMA3_TEXT_VOCAB, ORPHEUS_SNAC, TTS_LAYOUT_FILE, orpheus_layout
from dstune.hf import quiet_hf_libraries

_SEED = 0
TINY_SNAC = dict(
    sampling_rate=ORPHEUS_SNAC["sampling_rate"],
    encoder_dim=4,
    encoder_rates=[2, 4, 8, 8],
    decoder_dim=32,
    decoder_rates=[8, 8, 4, 2],
    attn_window_size=None,
    codebook_size=ORPHEUS_SNAC["codebook_size"],
    codebook_dim=4,
    vq_strides=ORPHEUS_SNAC["vq_strides"],
    noise=False,
    depthwise=True,
)


def orpheus_style_tokenizer(special_tokens: dict):
    """Byte-level text ids 0..255 plus Orpheus's named ids (a BPE without merges: one token per byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {char: number for number, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|begin_of_text|>"] = special_tokens["start_of_text"]
    vocab["<|eot_id|>"] = special_tokens["end_of_text"]
    layout = orpheus_layout()
    vocab.update(
        {f"<custom_token_{n}>": LLAMA3_TEXT_VOCAB + n for n in range(layout["vocab_size"] - LLAMA3_TEXT_VOCAB)}
    )
    named = set(vocab.values())  # every other id gets a name too, so added tokens land after 156937, as in Orpheus's
    vocab.update({f"<reserved_{n}>": n for n in range(layout["vocab_size"]) if n not in named})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", special_tokens["start_of_text"])]
    )
    pad = f"<custom_token_{special_tokens['pad_token'] - LLAMA3_TEXT_VOCAB}>"
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token=pad
    )


def build_tiny_orpheus(out: Path, needs: dict) -> dict:
    from snac import SNAC
    from transformers import LlamaConfig, LlamaForCausalLM

    layout = orpheus_layout("tokenizer")
    special = layout["special_tokens"]
    with deterministic_cpu(_SEED, 1):
        codec = SNAC(**TINY_SNAC).eval()
        lm = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=layout["vocab_size"],
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=512,
                tie_word_embeddings=True,
                bos_token_id=special["start_of_text"],
                eos_token_id=special["end_of_speech"],
                pad_token_id=special["pad_token"],
            )
        )
    with quiet_hf_libraries():
        lm.save_pretrained(out)
        orpheus_style_tokenizer(special).save_pretrained(out)
    (out / "codec").mkdir()
    (out / "codec" / "config.json").write_text(json.dumps(TINY_SNAC, indent=2) + "\n")
    torch.save(codec.state_dict(), out / "codec" / "pytorch_model.bin")
    (out / TTS_LAYOUT_FILE).write_text(json.dumps(layout, indent=2) + "\n")
    return {
        "lm_parameters": sum(p.numel() for p in lm.parameters()),
        "codec_parameters": sum(p.numel() for p in codec.parameters()),
    }


TINY_ORPHEUS = BuiltinModel(
    name="tiny-orpheus",
    folder_name="tiny-orpheus-v2",
    family="tts_lm",
    description="Orpheus-format Llama (~2.5 M parameters, 156938 ids, tied) + tiny SNAC (24 kHz, 7 codes per frame)",
    build=build_tiny_orpheus,
)
