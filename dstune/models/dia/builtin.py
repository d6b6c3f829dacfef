"""builtin:tiny-dia: a tiny Dia made offline (listed by the dia unit): transformers'
DiaForConditionalGeneration (a byte-level text encoder and an audio decoder over 9 DAC codebooks with Dia's delay
pattern) and a DiaProcessor (DiaTokenizer, DiaFeatureExtractor and a tiny DacModel as its audio tokenizer).

Everything the processor assumes by default is the real model's: 44.1 kHz audio, DAC's hop of 512 samples
(86.1 frames per second), 9 codebooks of 1024 codes, the audio ids EOS 1024, PAD 1025, BOS 1026 and the delay
pattern [0, 8, ..., 15]; so `DiaProcessor` with its defaults, the class's `generate` and `batch_decode` work on it
unchanged, as on nari-labs/Dia-1.6B-0626. Only the widths are tiny. DAC's codebooks start random (unlike Mimi's,
which start at zero), so its codes already follow the sound; the decoder is random and the samples noise-like.

Dia keeps its codec outside the model class: the processor's `processor_config.json` names the DacModel by path
(`audio_tokenizer_name_or_path`). The DAC is written to `audio_tokenizer/` in the folder and named by the folder's
final path in the cache (the build writes into a temporary sibling that is then renamed).
"""

from __future__ import annotations

from pathlib import Path


from dstune.builtin.common import BuiltinModel, deterministic_cpu
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, attr, generator
from dstune.spec.section import LM_LORA_TARGET_MODULES

_SEED = 0
FOLDER_NAME = "tiny-dia-v1"
AUDIO_TOKENIZER_FOLDER = "audio_tokenizer"
DIA_CODEBOOKS, DIA_CODEBOOK_SIZE, DIA_DELAY_PATTERN = 9, 1024, [0, 8, 9, 10, 11, 12, 13, 14, 15]
DIA_EOS, DIA_PAD, DIA_BOS = 1024, 1025, 1026  # the audio ids DiaProcessor defaults to (codes are 0..1023)
TINY_DAC = dict(
    encoder_hidden_size=4,
    downsampling_ratios=[2, 4, 8, 8],
    decoder_hidden_size=16,
    n_codebooks=DIA_CODEBOOKS,
    codebook_size=DIA_CODEBOOK_SIZE,
    codebook_dim=4,
    sampling_rate=44100,
)
# The real generation_config.json's sampling settings (classifier-free guidance over the text, top-k, top-p)
TINY_DIA_GENERATION = dict(do_sample=True, guidance_scale=3.0, temperature=1.8, top_p=0.95, top_k=45, max_length=3072)


def tiny_dia_config():
    from transformers import DiaConfig, DiaDecoderConfig, DiaEncoderConfig

    encoder = DiaEncoderConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=256,
        max_position_embeddings=1024,
    )
    decoder = DiaDecoderConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        cross_num_attention_heads=2,
        cross_head_dim=16,
        cross_num_key_value_heads=2,
        cross_hidden_size=32,
        vocab_size=DIA_CODEBOOK_SIZE + 4,
        num_channels=DIA_CODEBOOKS,
        max_position_embeddings=3072,
        eos_token_id=DIA_EOS,
        pad_token_id=DIA_PAD,
        bos_token_id=DIA_BOS,
    )
    return DiaConfig(
        encoder_config=encoder,
        decoder_config=decoder,
        delay_pattern=list(DIA_DELAY_PATTERN),
        eos_token_id=DIA_EOS,
        pad_token_id=DIA_PAD,
        bos_token_id=DIA_BOS,
    )


def build_tiny_dia(out: Path, needs: dict) -> dict:
    from transformers import (
        DacConfig,
        DacModel,
        DiaFeatureExtractor,
        DiaForConditionalGeneration,
        DiaProcessor,
        DiaTokenizer,
        GenerationConfig,
    )

    out = Path(out)
    final = out.parent / FOLDER_NAME  # where dstune.builtin renames the finished folder to
    with deterministic_cpu(_SEED, 1), quiet_hf_libraries():
        dac = DacModel(DacConfig(**TINY_DAC)).eval()
        model = DiaForConditionalGeneration(tiny_dia_config()).eval()
    model.generation_config = GenerationConfig(
        **TINY_DIA_GENERATION,
        bos_token_id=DIA_BOS,
        eos_token_id=DIA_EOS,
        pad_token_id=DIA_PAD,
        decoder_start_token_id=DIA_BOS,
    )
    with quiet_hf_libraries():
        dac.save_pretrained(out / AUDIO_TOKENIZER_FOLDER)
        dac.name_or_path = str(final / AUDIO_TOKENIZER_FOLDER)  # what processor_config.json names
        feature_extractor = DiaFeatureExtractor(
            sampling_rate=dac.config.sampling_rate, hop_length=dac.config.hop_length
        )
        DiaProcessor(feature_extractor, DiaTokenizer(), dac).save_pretrained(out)
        model.save_pretrained(out)
    return {
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "codec_parameters": sum(p.numel() for p in dac.parameters()),
    }


TINY_DIA = BuiltinModel(
    name="tiny-dia",
    folder_name=FOLDER_NAME,
    family="tts_codebooks",
    description="Dia (DiaForConditionalGeneration: byte text encoder + audio decoder, 9 codebooks, delay pattern "
    "[0, 8..15]) with a tiny 44.1 kHz DAC as its DiaProcessor's audio tokenizer",
    build=build_tiny_dia,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


DIA_CHANNELS, DIA_VOCAB = 9, 1028  # Dia-1.6B's DAC codebooks and code vocabulary (not narrowed: logits apart)


def _dia(heads, ffn_mult):
    """Dia-1.6B's structure: the decoder (head dim 128, GQA 4:1, MLP 4x) and an encoder half as wide (MLP 4x its
    width), cross-attention from the decoder's width to the encoder's; per decoder-width unit."""
    from transformers import DiaConfig, DiaDecoderConfig, DiaEncoderConfig, DiaForConditionalGeneration

    width = heads * 128
    encoder = width // 2
    config = DiaConfig(
        encoder_config=DiaEncoderConfig(
            hidden_size=encoder,
            intermediate_size=4 * encoder,
            num_attention_heads=encoder // 128,
            num_key_value_heads=encoder // 128,
            head_dim=128,
            num_hidden_layers=2,
            vocab_size=256,
        ),
        decoder_config=DiaDecoderConfig(
            hidden_size=width,
            intermediate_size=4 * width,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4),
            head_dim=128,
            cross_num_attention_heads=heads,
            cross_num_key_value_heads=heads,
            cross_head_dim=128,
            cross_hidden_size=encoder,
            num_hidden_layers=2,
            vocab_size=DIA_VOCAB,
            num_channels=DIA_CHANNELS,
        ),
        delay_pattern=[0, 8, 9, 10, 11, 12, 13, 14, 15],
    )
    return DiaForConditionalGeneration(config), width, 0, DIA_VOCAB


def _dia_run(model, tokens, context, dtype):
    """`context` transcript bytes into the encoder, `tokens` decoder positions of 9 channels, every one labelled."""
    import torch

    ids = torch.randint(1, 256, (1, context), generator=generator())
    codes = torch.randint(0, DIA_VOCAB - 4, (1, tokens, DIA_CHANNELS), generator=generator())
    return lambda: model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        decoder_input_ids=codes,
        decoder_attention_mask=torch.ones(1, tokens, dtype=torch.long),
        labels=codes.transpose(1, 2).reshape(DIA_CHANNELS, tokens).contiguous(),  # (B * C, T), channel-major
    ).loss.float()


ACTIVATION_CASES = (
    Case(
        "dia",
        "Dia (encoder over the transcript's bytes, decoder over 9 delayed DAC channels, head dim 128)",
        _dia,
        _dia_run,
        sizes=((16, 8), (48, 8), (16, 24)),
        check_size=(32, 12),
        lora_targets=LM_LORA_TARGET_MODULES,
        block_lists=attr(encoder="model.encoder.layers", decoder="model.decoder.layers"),
        heads=4,
        check_heads=8,
    ),
)
