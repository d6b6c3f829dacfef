"""builtin:tiny-speecht5: SpeechT5 text-to-speech (~40 k parameters, a character-level sentencepiece tokenizer, 20 mel
bins at 16 kHz) and a tiny HiFi-GAN vocoder, made offline from configs (listed on its card, dstune.registry)."""

from __future__ import annotations

from pathlib import Path

from dstune.builtin.common import BuiltinModel, deterministic_cpu
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, attr, generator, randn

_SEED = 0
TINY_SPEECHT5_RATE, TINY_SPEECHT5_MELS = 16000, 20
_SPM_CORPUS = [
    "0 1 2 3 4 5 6 7 8 9",
    "the quick brown fox jumps over the lazy dog",
    ". , ! ? ' -",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
]


def _char_tokenizer(out: Path):
    """A character-level sentencepiece model trained in memory (SpeechT5Tokenizer needs an spm file)."""
    import io

    import sentencepiece
    from transformers import SpeechT5Tokenizer

    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_SPM_CORPUS),
        model_writer=buffer,
        model_type="char",
        vocab_size=80,
        character_coverage=1.0,
        pad_id=1,
        unk_id=3,
        bos_id=0,
        eos_id=2,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (out / "spm_char.model").write_bytes(buffer.getvalue())
    return SpeechT5Tokenizer(vocab_file=str(out / "spm_char.model"))


def build_tiny_speecht5(out: Path, needs: dict) -> dict:
    from transformers import (
        SpeechT5Config,
        SpeechT5FeatureExtractor,
        SpeechT5ForTextToSpeech,
        SpeechT5HifiGan,
        SpeechT5HifiGanConfig,
        SpeechT5Processor,
    )

    tokenizer = _char_tokenizer(out)
    extractor = SpeechT5FeatureExtractor(
        sampling_rate=TINY_SPEECHT5_RATE,
        num_mel_bins=TINY_SPEECHT5_MELS,
        hop_length=16,
        win_length=64,
        fmin=80,
        fmax=7600,
    )
    with deterministic_cpu(_SEED, 1):
        model = SpeechT5ForTextToSpeech(
            SpeechT5Config(
                vocab_size=len(tokenizer),
                hidden_size=32,
                encoder_layers=1,
                encoder_attention_heads=2,
                encoder_ffn_dim=64,
                decoder_layers=1,
                decoder_attention_heads=2,
                decoder_ffn_dim=64,
                num_mel_bins=TINY_SPEECHT5_MELS,
                reduction_factor=2,
                speech_decoder_prenet_layers=2,
                speech_decoder_prenet_units=32,
                speech_decoder_postnet_layers=2,
                speech_decoder_postnet_units=32,
                speech_decoder_postnet_kernel=5,
                speaker_embedding_dim=16,
                max_text_positions=128,
                max_speech_positions=512,
                use_guided_attention_loss=True,
                guided_attention_loss_num_heads=2,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=2,
                encoder_layerdrop=0.0,
                decoder_layerdrop=0.0,
            )
        )  # a dropped only layer leaves no cross attention
        vocoder = SpeechT5HifiGan(
            SpeechT5HifiGanConfig(
                model_in_dim=TINY_SPEECHT5_MELS,
                sampling_rate=TINY_SPEECHT5_RATE,
                upsample_initial_channel=32,
                upsample_rates=[4, 4, 4, 4],
                upsample_kernel_sizes=[8, 8, 8, 8],
                resblock_kernel_sizes=[3],
                resblock_dilation_sizes=[[1, 3]],
            )
        )  # 4*4*4*4 = 256 samples = the 16 ms hop
    with quiet_hf_libraries():
        SpeechT5Processor(tokenizer=tokenizer, feature_extractor=extractor).save_pretrained(out)
        model.save_pretrained(out)
        vocoder.save_pretrained(out / "vocoder")
    return {
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "vocoder_parameters": sum(p.numel() for p in vocoder.parameters()),
    }


TINY_SPEECHT5 = BuiltinModel(
    name="tiny-speecht5",
    folder_name="tiny-speecht5-v1",
    family="speecht5",
    description="SpeechT5 TTS (~40 k parameters, char tokenizer, 20 mel bins at 16 kHz) + tiny HiFi-GAN vocoder",
    build=build_tiny_speecht5,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


def _speecht5(heads, ffn_mult):
    from transformers import SpeechT5Config, SpeechT5ForTextToSpeech

    width = heads * 64
    config = SpeechT5Config(
        hidden_size=width,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=4 * width,
        decoder_ffn_dim=4 * width,
        encoder_layers=2,
        decoder_layers=2,
        speech_decoder_prenet_units=width // 3,
        speech_decoder_postnet_units=width // 3,
        speaker_embedding_dim=512,
        num_mel_bins=80,
        reduction_factor=2,
        vocab_size=81,
        use_guided_attention_loss=True,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
    )
    return SpeechT5ForTextToSpeech(config), width, 0, 0


def _speecht5_run(model, tokens, context, dtype):
    """`tokens` decoder steps (2 mel frames each), `context` transcript tokens, as dstune's speecht5 loss runs."""
    import torch

    ids = torch.randint(4, 81, (1, context), generator=generator())
    labels = randn(1, 2 * tokens, 80, dtype=dtype)
    speaker = randn(1, 512, dtype=dtype)
    return lambda: model(
        input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, speaker_embeddings=speaker
    ).loss.float()


ACTIVATION_CASES = (
    Case(
        "speecht5",
        "SpeechT5 text-to-speech (eager attention: scores kept)",
        _speecht5,
        _speecht5_run,
        sizes=((8, 6), (16, 6), (8, 12), (16, 12), (24, 6), (8, 18)),
        check_size=(12, 9),
        block_lists=attr(
            encoder="speecht5.encoder.wrapped_encoder.layers", decoder="speecht5.decoder.wrapped_decoder.layers"
        ),
        quadratic=True,
        checkpointing=False,
    ),
)
