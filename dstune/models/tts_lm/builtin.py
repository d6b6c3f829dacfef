"""The built-in tiny codec-token TTS LM, made offline from configs (listed on its card, dstune.registry).

builtin:tiny-tts-lm: a 2-layer Llama causal LM over 256 byte-level text tokens followed by EnCodec tokens
(2 codebooks of 32 codes, 50 frames per second at 8 kHz), plus the EnCodec model in `codec/` and the
`dstune_tts.json` layout the tts_lm family reads. EnCodec's codebooks start as zeros in transformers (every frame
would quantise to code 0), so they are filled with seeded random vectors: distinct sounds then get distinct codes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstune.builtin.common import BuiltinModel, deterministic_cpu
from dstune.builtin.trained import TrainedPart, give_trained_weights
from dstune.data.audio import resample
from dstune.data.synthetic import TONES_NUM_SAMPLES, TONES_SAMPLE_RATE, render_tones, tones_text
from dstune.models.tts_lm.token_layouts import TTS_LAYOUT_FILE, tts_layout
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import Case, LM_VOCAB, attr, generator
from dstune.spec.section import LM_LORA_TARGET_MODULES

_SEED = 0
TINY_CODEC = dict(
    target_bandwidths=[1.0],
    sampling_rate=8000,
    audio_channels=1,
    num_filters=4,
    num_residual_layers=1,
    upsampling_ratios=[8, 5, 4],
    codebook_size=32,
    hidden_size=16,
    num_lstm_layers=1,
    codebook_dim=16,
    kernel_size=7,
    last_kernel_size=7,
    residual_kernel_size=3,
    compress=2,
)
TINY_NUM_CODEBOOKS = 2
TINY_TEXT_VOCAB = 256  # UTF-8 bytes
DECODER_STEPS = 120


def build_tiny_tts_lm(out: Path, needs: dict) -> dict:
    from transformers import EncodecConfig, EncodecModel, LlamaConfig, LlamaForCausalLM

    codec_config = EncodecConfig(**TINY_CODEC)
    layout = tts_layout(
        "bytes",
        TINY_TEXT_VOCAB,
        TINY_NUM_CODEBOOKS,
        codec_config.codebook_size,
        "encodec",
        codec_config.sampling_rate,
        codec_config.frame_rate,
    )
    with deterministic_cpu(_SEED, 1):
        codec = EncodecModel(codec_config).eval()
        facts = give_trained_weights(CODEC_PART, codec)
        lm = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=layout["vocab_size"],
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                tie_word_embeddings=False,
                pad_token_id=layout["pad"],
                bos_token_id=layout["audio_bos"],
                eos_token_id=layout["audio_eos"],
            )
        )
    with quiet_hf_libraries():
        lm.save_pretrained(out)
        codec.save_pretrained(out / "codec")
    (out / TTS_LAYOUT_FILE).write_text(json.dumps(layout, indent=2) + "\n")
    return {
        **facts,
        "lm_parameters": sum(p.numel() for p in lm.parameters()),
        "codec_parameters": sum(p.numel() for p in codec.parameters()),
    }


def _fit_codebooks(codec, iterations: int = 10) -> None:
    """Residual k-means of the (random) encoder's frames over builtin:tones, one codebook after another, as
    EnCodec initialises its codebooks: codes then follow the sound (pitch) instead of all being one code."""
    with torch.no_grad():
        frames = torch.cat(
            [codec.encoder(w.reshape(1, 1, -1))[0].t() for w in _tones_at(codec.config.sampling_rate, 4)]
        )
        frames = frames + 1e-3 * torch.randn_like(frames)  # silence frames are identical: keep centroids apart
        residual = frames
        for layer in codec.quantizer.layers:
            size = layer.codebook.embed.shape[0]
            centroids = residual[torch.randperm(len(residual))[:size]].clone()
            for _ in range(iterations):
                assignment = torch.cdist(residual, centroids).argmin(1)
                for code in range(size):
                    members = residual[assignment == code]
                    if len(members):
                        centroids[code] = members.mean(0)
            layer.codebook.embed.copy_(centroids)
            layer.codebook.embed_avg.copy_(centroids)
            layer.codebook.cluster_size.fill_(1.0)
            residual = residual - centroids[torch.cdist(residual, centroids).argmin(1)]


def _tones_at(rate: int, step: int) -> list[torch.Tensor]:
    return [
        torch.from_numpy(resample(render_tones(tones_text(i)), TONES_SAMPLE_RATE, rate))
        for i in range(0, TONES_NUM_SAMPLES, step)
    ]


def _spectral_l1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    window = torch.hann_window(256)
    spec_a, spec_b = (torch.stft(x, 256, 64, window=window, return_complex=True).abs() for x in (a, b))
    return (spec_a - spec_b).abs().mean() + (torch.log(spec_a + 1e-4) - torch.log(spec_b + 1e-4)).abs().mean()


def _fit_decoder(codec, steps: int = DECODER_STEPS, batch: int = 4) -> dict:
    """Train the decoder (only) to turn the quantised tones back into the tones: a random decoder makes nearly the
    same noise whatever the codes, and samples could not be told apart by ear."""
    waves = _tones_at(codec.config.sampling_rate, 4)
    with torch.no_grad():
        quantised = [
            codec.quantizer.decode(
                codec.encode(w.reshape(1, 1, -1)).audio_codes[0, :, :TINY_NUM_CODEBOOKS].transpose(0, 1)
            )
            for w in waves
        ]
    optimizer = torch.optim.Adam(codec.decoder.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(_SEED)
    for _ in range(steps):
        chosen = torch.randint(0, len(waves), (batch,), generator=generator).tolist()
        loss = sum(_spectral_l1(codec.decoder(quantised[i])[0, 0, : len(waves[i])], waves[i]) for i in chosen) / batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    codec.eval().requires_grad_(False)
    return {"codec_decoder_steps": steps, "codec_decoder_spectral_l1": round(loss.item(), 4)}


def _fit_codec(codec) -> dict:
    _fit_codebooks(codec)
    return _fit_decoder(codec)


# its EnCodec with fitted codebooks and decoder, stored with dstune (dstune.builtin.trained)
CODEC_PART = TrainedPart("tiny-tts-lm-codec", _fit_codec)


TINY_TTS_LM = BuiltinModel(
    name="tiny-tts-lm",
    folder_name="tiny-tts-lm-v4",
    family="tts_lm",
    description="Llama-shaped causal LM (~0.1 M parameters) over byte text + EnCodec tokens (2 x 32 codes, 8 kHz)",
    build=build_tiny_tts_lm,
    trained_parts=(CODEC_PART.name,),
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


def _llama(heads, ffn_mult, vocab=LM_VOCAB):
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
        vocab_size=vocab,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config), width, ffn, vocab


def _llama_run(model, tokens, context, dtype):
    import torch

    ids = torch.randint(0, LM_VOCAB, (1, tokens), generator=generator())
    return lambda: model(input_ids=ids, labels=ids).loss.float()


ACTIVATION_CASES = (
    Case(
        "llama",
        "tts_lm: Llama-class causal LM (GQA 4:1, head dim 64)",
        _llama,
        _llama_run,
        sizes=((32, 0), (96, 0)),
        check_size=(64, 0),
        lora_targets=LM_LORA_TARGET_MODULES,
        block_lists=attr("model.layers"),
        ffn=True,
        heads=4,
        check_heads=6,
        # the fp32 logits' gradient over the vocabulary, at clip lengths where it is large and a vocabulary as
        # many times the width as Llama-3.2-1B's (128,256 + audio tokens over 2,048)
        transients=True,
        transient_sizes=((256, 0), (512, 0)),
        transient_check=(384, 0),
        transient_vocab=16_000,
    ),
)
