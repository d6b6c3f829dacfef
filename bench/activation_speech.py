"""The speech models whose activations bench/activation_table.py measures (the real transformers classes, narrow;
see bench/activation_models.py for the width rule): a Llama-class LM (tts_lm, Orpheus), SpeechT5, Sesame CSM (the
backbone over the transcript and the frames, the depth decoder over each frame's codebooks) and Dia (the encoder over
the transcript's bytes, the decoder over the delayed frames of its 9 channels)."""

from __future__ import annotations

import torch
from activation_cases import Case, attr, generator, randn


LM_VOCAB = 1000  # narrow: the logits are counted apart, per vocabulary entry


def _llama(heads, ffn_mult):
    from transformers import LlamaConfig, LlamaForCausalLM

    width = heads * 64
    ffn = 4 * width * ffn_mult
    config = LlamaConfig(
        hidden_size=width,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        num_hidden_layers=2,
        vocab_size=LM_VOCAB,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config), width, ffn, LM_VOCAB


def _llama_run(model, tokens, context, dtype):
    ids = torch.randint(0, LM_VOCAB, (1, tokens), generator=generator())
    return lambda: model(input_ids=ids, labels=ids).loss.float()


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
    ids = torch.randint(4, 81, (1, context), generator=generator())
    labels = randn(1, 2 * tokens, 80, dtype=dtype)
    speaker = randn(1, 512, dtype=dtype)
    return lambda: model(
        input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, speaker_embeddings=speaker
    ).loss.float()


CSM_CODEBOOKS = 32  # Sesame CSM-1B's Mimi codebooks: the depth decoder's positions per frame (not narrowed)


def _csm(heads, ffn_mult):
    """CSM-1B's structure: a Llama-class backbone (head dim 64, GQA 4:1, MLP 4x) and a depth decoder half as wide
    (head dim 128, its MLP 4x the backbone's width), both measured per backbone-width unit."""
    from transformers import CsmConfig, CsmForConditionalGeneration

    width = heads * 64
    depth = width // 2
    config = CsmConfig(
        hidden_size=width,
        intermediate_size=4 * width,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        num_hidden_layers=2,
        vocab_size=LM_VOCAB,
        text_vocab_size=LM_VOCAB,
        num_codebooks=CSM_CODEBOOKS,
        codebook_pad_token_id=LM_VOCAB - 1,
        audio_token_id=LM_VOCAB - 2,
        audio_eos_token_id=LM_VOCAB - 3,
        pad_token_id=LM_VOCAB - 4,
        bos_token_id=1,
        depth_decoder_config={
            "hidden_size": depth,
            "intermediate_size": 4 * width,
            "num_attention_heads": max(1, depth // 128),
            "num_key_value_heads": 1,
            "head_dim": 128,
            "num_hidden_layers": 2,
            "vocab_size": LM_VOCAB,
            "num_codebooks": CSM_CODEBOOKS,
            "backbone_hidden_size": width,
        },
        attn_implementation="sdpa",
    )
    return CsmForConditionalGeneration(config), width, 0, LM_VOCAB


def _csm_run(model, tokens, context, dtype):
    """`context` transcript tokens, then `tokens` audio frames (the last the EOS frame), as dstune's CSM loss runs
    it (dstune.models.csm.family: the frames' codes embedded in place of the <|AUDIO|> tokens, every frame labelled)."""
    from dstune.models.csm.family import CodebookFramesModel

    config = model.config
    ids = torch.cat(
        [
            torch.randint(4, LM_VOCAB - 8, (1, context), generator=generator()),
            torch.full((1, tokens), config.audio_token_id),
        ],
        1,
    )
    codes = torch.randint(1, LM_VOCAB - 8, (1, context + tokens, CSM_CODEBOOKS), generator=generator())
    labels = codes.clone()
    labels[:, :context] = -100
    trained = CodebookFramesModel(model)
    return lambda: trained(ids, codes, torch.ones_like(ids), labels=labels).loss.float()


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
    ids = torch.randint(1, 256, (1, context), generator=generator())
    codes = torch.randint(0, DIA_VOCAB - 4, (1, tokens, DIA_CHANNELS), generator=generator())
    return lambda: model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        decoder_input_ids=codes,
        decoder_attention_mask=torch.ones(1, tokens, dtype=torch.long),
        labels=codes.transpose(1, 2).reshape(DIA_CHANNELS, tokens).contiguous(),  # (B * C, T), channel-major
    ).loss.float()


SPEECH_CASES = [
    Case(
        "llama",
        "tts_lm: Llama-class causal LM (GQA 4:1, head dim 64)",
        _llama,
        _llama_run,
        sizes=((32, 0), (96, 0)),
        check_size=(64, 0),
        block_lists=attr("model.layers"),
        ffn=True,
        heads=4,
        check_heads=6,
    ),
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
    Case(
        "csm",
        "Sesame CSM (Llama-class backbone over transcript + frames, depth decoder over each frame's 32 codebooks)",
        _csm,
        _csm_run,
        sizes=((8, 8), (24, 8), (8, 24)),
        check_size=(16, 12),
        block_lists=attr(backbone="backbone_model.layers", depth="depth_decoder.model.layers"),
        head_copy=True,
        heads=4,
        check_heads=8,
    ),
    Case(
        "dia",
        "Dia (encoder over the transcript's bytes, decoder over 9 delayed DAC channels, head dim 128)",
        _dia,
        _dia_run,
        sizes=((16, 8), (48, 8), (16, 24)),
        check_size=(32, 12),
        block_lists=attr(encoder="model.encoder.layers", decoder="model.decoder.layers"),
        heads=4,
        check_heads=8,
    ),
]
