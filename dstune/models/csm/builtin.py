"""builtin:tiny-csm: a tiny Sesame CSM made offline (registered in dstune.builtin): transformers'
CsmForConditionalGeneration (a Llama-shaped backbone over text + Mimi frames, a depth decoder over the codebooks of
each frame) with a tiny Mimi codec inside it, a byte-level tokenizer with CSM's special tokens, and the CsmProcessor
(tokenizer + EncodecFeatureExtractor) that its own recipe and `from_pretrained` use.

The Mimi keeps the real model's 24 kHz rate, 12.5 frames per second and convolution strides (CsmProcessor counts a
clip's frames with the real Mimi's kernels and strides), with tiny widths and 4 codebooks of 32 codes. Mimi's
codebooks start at zero in transformers (every frame would be code 0), so each is fitted by a residual k-means of
its (random) projections over builtin:tones: codes then follow the sound. The decoder is left random (the samples of
this tiny model are noise-like; what they test is that generation and decoding run).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dstune.builtin.common import BuiltinModel, deterministic_cpu
from dstune.builtin.trained import TrainedPart, give_trained_weights
from dstune.data.audio import resample
from dstune.data.synthetic import TONES_NUM_SAMPLES, TONES_SAMPLE_RATE, render_tones, tones_text
from dstune.hf import quiet_hf_libraries
from dstune.models.csm.model import CodebookFramesModel
from dstune.memory.activation_cases import Case, LM_VOCAB, attr, generator
from dstune.spec.section import LM_LORA_TARGET_MODULES

_SEED = 0
CSM_SPECIAL_TOKENS = {"<|begin_of_text|>": 256, "<|end_of_text|>": 257, "<|AUDIO|>": 258, "<|audio_eos|>": 259}
TINY_CSM_TEXT_VOCAB = 260  # UTF-8 bytes + CSM's four special tokens
TINY_CSM_CODEBOOKS, TINY_CSM_CODEBOOK_SIZE = 4, 32
TINY_MIMI = dict(
    hidden_size=16,
    num_filters=4,
    codebook_size=TINY_CSM_CODEBOOK_SIZE,
    codebook_dim=8,
    num_quantizers=TINY_CSM_CODEBOOKS,
    vector_quantization_hidden_dimension=8,
    num_hidden_layers=1,
    intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    upsample_groups=16,
    sliding_window=16,
    max_position_embeddings=512,
)


def csm_style_tokenizer():
    """Byte-level text ids 0..255 and CSM's special tokens (<|AUDIO|> is a frame, <|audio_eos|> the end frame)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: number for number, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(CSM_SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
        additional_special_tokens=["<|AUDIO|>", "<|audio_eos|>"],
    )


def tiny_csm_config():
    from transformers import CsmConfig, MimiConfig

    size = TINY_CSM_CODEBOOK_SIZE + 3  # the codes, then CSM's extra ids (its 2051 = 2048 + 3); the last pads
    return CsmConfig(
        num_codebooks=TINY_CSM_CODEBOOKS,
        vocab_size=size,
        text_vocab_size=TINY_CSM_TEXT_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=CSM_SPECIAL_TOKENS["<|end_of_text|>"],
        codebook_pad_token_id=size - 1,
        codebook_eos_token_id=0,
        bos_token_id=CSM_SPECIAL_TOKENS["<|begin_of_text|>"],
        audio_token_id=CSM_SPECIAL_TOKENS["<|AUDIO|>"],
        audio_eos_token_id=CSM_SPECIAL_TOKENS["<|audio_eos|>"],
        depth_decoder_config=dict(
            num_codebooks=TINY_CSM_CODEBOOKS,
            backbone_hidden_size=32,
            vocab_size=size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=TINY_CSM_CODEBOOKS + 1,
        ),
        codec_config=MimiConfig(**TINY_MIMI).to_dict(),
    )


def fit_mimi_codebooks(codec, waves: list[torch.Tensor], iterations: int = 8) -> None:
    """Residual k-means, codebook after codebook, of what each of Mimi's two quantizers (semantic, acoustic) is
    given over `waves`: the codes then depend on the sound instead of all being 0."""
    captured = {}
    quantizers = (
        codec.quantizer.semantic_residual_vector_quantizer,
        codec.quantizer.acoustic_residual_vector_quantizer,
    )
    hooks = [
        q.input_proj.register_forward_hook(lambda m, i, out, n=n: captured.setdefault(n, []).append(out))
        for n, q in enumerate(quantizers)
    ]
    with torch.no_grad():
        for wave in waves:
            codec.encode(wave.reshape(1, 1, -1))
        for hook in hooks:
            hook.remove()
        for number, quantizer in enumerate(quantizers):
            residual = torch.cat([x[0].t() for x in captured[number]])
            residual = residual + 1e-3 * torch.randn_like(residual)  # silent frames are identical: keep them apart
            for layer in quantizer.layers:
                size = layer.codebook.embed_sum.shape[0]
                centroids = residual[torch.randperm(len(residual))[:size]].clone()
                for _ in range(iterations):
                    nearest = torch.cdist(residual, centroids).argmin(1)
                    for code in range(size):
                        if (nearest == code).any():
                            centroids[code] = residual[nearest == code].mean(0)
                layer.codebook.embed_sum.copy_(centroids)
                layer.codebook.cluster_usage.fill_(1.0)
                layer.codebook.initialized.fill_(1.0)
                residual = residual - centroids[torch.cdist(residual, centroids).argmin(1)]


def _fit_codebooks(codec) -> dict:
    rate = codec.config.sampling_rate
    waves = [
        torch.from_numpy(resample(render_tones(tones_text(i)), TONES_SAMPLE_RATE, rate))
        for i in range(0, TONES_NUM_SAMPLES, 4)
    ]
    fit_mimi_codebooks(codec, waves)
    return {}


# its Mimi's fitted codebooks (the rest of Mimi is its random initialisation), stored with dstune
# (dstune.builtin.trained)
CODEBOOKS_PART = TrainedPart(
    "tiny-csm-codebooks",
    _fit_codebooks,
    stored=lambda codec: {key: value for key, value in codec.state_dict().items() if ".codebook." in key},
)


def build_tiny_csm(out: Path, needs: dict) -> dict:
    from transformers import CsmForConditionalGeneration, CsmProcessor, EncodecFeatureExtractor

    config = tiny_csm_config()
    rate = config.codec_config.sampling_rate
    with deterministic_cpu(_SEED, 1), quiet_hf_libraries():
        model = CsmForConditionalGeneration(config).eval()
        give_trained_weights(CODEBOOKS_PART, model.codec_model)
    processor = CsmProcessor(EncodecFeatureExtractor(feature_size=1, sampling_rate=rate), csm_style_tokenizer())
    with quiet_hf_libraries():
        model.save_pretrained(out)
        processor.save_pretrained(out)
    codec = sum(p.numel() for p in model.codec_model.parameters())
    return {"model_parameters": sum(p.numel() for p in model.parameters()) - codec, "codec_parameters": codec}


TINY_CSM = BuiltinModel(
    name="tiny-csm",
    folder_name="tiny-csm-v1",
    family="tts_codebooks",
    description="Sesame CSM (CsmForConditionalGeneration, ~50 k parameters + depth decoder) with a tiny Mimi "
    "(24 kHz, 12.5 frames/s, 4 x 32 codes) and its CsmProcessor",
    build=build_tiny_csm,
    trained_parts=(CODEBOOKS_PART.name,),
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step, whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.


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
    it (dstune.models.csm.model: the frames' codes embedded in place of the <|AUDIO|> tokens, every frame labelled)."""
    import torch

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


ACTIVATION_CASES = (
    Case(
        "csm",
        "Sesame CSM (Llama-class backbone over transcript + frames, depth decoder over each frame's 32 codebooks)",
        _csm,
        _csm_run,
        sizes=((8, 8), (24, 8), (8, 24)),
        check_size=(16, 12),
        lora_targets=LM_LORA_TARGET_MODULES,
        block_lists=attr(backbone="backbone_model.layers", depth="depth_decoder.model.layers"),
        head_copy=True,
        heads=4,
        check_heads=8,
    ),
)
