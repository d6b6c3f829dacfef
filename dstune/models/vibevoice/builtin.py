"""builtin:tiny-vibevoice: a tiny VibeVoice made offline (listed by the vibevoice unit): transformers'
VibeVoiceForConditionalGeneration (a Qwen2 LM whose hidden state conditions a diffusion head over the acoustic
tokenizer's continuous latents) with a tiny VibeVoiceAcousticTokenizerModel inside it (`audio_tower`), a tiny
semantic encoder, a byte-level Qwen2 tokenizer carrying VibeVoice's audio tokens, and the VibeVoiceProcessor
(tokenizer + VibeVoiceAcousticTokenizerFeatureExtractor + the chat template's layout) that `from_pretrained` uses.

What the processor and generate assume is the real model's: 24 kHz audio, the acoustic tokenizer's hop of 3200
samples (downsampling [2, 2, 4, 5, 5, 8]: 7.5 latents per second), the audio tokens <|vision_start|>,
<|vision_end|> and <|vision_pad|>, the v-prediction cosine DPM-Solver scheduler in the generation config and its
classifier-free guidance of 1.3. Only the widths are tiny (latents of 8 values, one ConvNeXt block per stage).
The weights are random but for a short fit of the LM to the token layout of builtin:tones utterances (script, audio
BOS, one placeholder per 3200 samples, audio EOS, end of text), so that generate emits latents to decode from the
start; the latents themselves are noise-like. What the samples test is that generation and decoding run.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dstune.builtin.common import BuiltinModel, bytes_to_unicode, deterministic_cpu
from dstune.builtin.trained import TrainedPart, give_trained_weights
from dstune.data.synthetic import TONES_NUM_SAMPLES, TONES_SAMPLE_RATE, render_tones, tones_text
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import LM_VOCAB, Case, attr, generator, randn
from dstune.spec.section import LM_LORA_TARGET_MODULES
from dstune.models.vibevoice.card import VIBEVOICE_CARD
from dstune.models.vibevoice.model import VibeVoiceModule, factors_as_buffers, noise_scheduler

_SEED = 0
FOLDER_NAME = "tiny-vibevoice-v1"
AUDIO_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")  # audio BOS, audio EOS, one latent
TINY_ACOUSTIC = dict(
    hidden_size=8,
    num_filters=2,
    downsampling_ratios=[2, 2, 4, 5, 5, 8],
    depths=[1, 1, 1, 1, 1, 1, 1],
    ffn_expansion=2,
)
TINY_SEMANTIC = dict(
    hidden_size=8, num_filters=2, downsampling_ratios=[2, 2, 4, 5, 5, 8], depths=[1] * 7, ffn_expansion=2
)
# The real generation_config.json's diffusion sampling (VibeVoice-1.5B-hf): DPM-Solver++ on a cosine schedule with
# v-prediction, 10 steps, guidance 1.3
TINY_VIBEVOICE_GENERATION = dict(
    guidance_scale=1.3,
    num_diffusion_steps=10,
    noise_scheduler_class="DPMSolverMultistepScheduler",
    noise_scheduler_config={"beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"},
    max_length=512,
)
# VibeVoice's prompt layout (the layout of its processor's chat template): system prompt, the reference voices,
# the script's turns, then the speech output after an audio BOS.
CHAT_TEMPLATE = (
    '{{- " Transform the text provided by various speakers into speech output, utilizing the distinct voice of '
    'each respective speaker.\\n" -}}'
    "{%- set voiced = namespace(roles=[]) -%}"
    "{%- for message in messages -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' and message['role'] not in voiced.roles -%}"
    "{%- set voiced.roles = voiced.roles + [message['role']] -%}{%- endif -%}{%- endfor -%}{%- endfor -%}"
    '{%- if voiced.roles -%}{{- " Voice input:\\n" -}}'
    '{%- for role in voiced.roles -%}{{- " Speaker " ~ role ~ ":<|vision_start|><|vision_pad|><|vision_end|>\\n" -}}'
    "{%- endfor -%}{%- endif -%}"
    '{{- " Text input:\\n" -}}'
    "{%- for message in messages -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}"
    '{{- " Speaker " ~ message[\'role\'] ~ ": " ~ part[\'text\'] ~ "\\n" -}}'
    "{%- endif -%}{%- endfor -%}{%- endfor -%}"
    '{{- " Speech output:\\n<|vision_start|>" -}}'
)


def tiny_vibevoice_tokenizer():
    """A byte-level Qwen2 tokenizer with <|endoftext|> (end of text and padding) and VibeVoice's audio tokens."""
    from transformers import Qwen2Tokenizer

    vocab = {char: number for number, char in enumerate(bytes_to_unicode())}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(AUDIO_TOKENS)})
    return tokenizer


def tiny_vibevoice_config(tokenizer):
    from transformers import VibeVoiceConfig

    end, bos, eos, audio = tokenizer.convert_tokens_to_ids(["<|endoftext|>", *AUDIO_TOKENS])
    return VibeVoiceConfig(
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=end,
            eos_token_id=end,
            pad_token_id=end,
        ),
        audio_config=dict(model_type="vibevoice_acoustic_tokenizer", **TINY_ACOUSTIC),
        semantic_model_config=dict(model_type="vibevoice_acoustic_tokenizer_encoder", **TINY_SEMANTIC),
        diffusion_head_config=dict(num_hidden_layers=1, intermediate_size=64, frequency_embedding_size=16),
        pad_token_id=end,
        eos_token_id=end,
        audio_bos_token_id=bos,
        audio_eos_token_id=eos,
        audio_token_id=audio,
    )


def fit_token_layout(model, processor, steps: int = 40) -> None:
    """A few AdamW steps of the class's LM loss (no diffusion) on builtin:tones scripts laid out as dstune trains
    them, the placeholders left as tokens: the LM learns to answer the speech BOS with placeholders and to end."""
    tokenizer, config = processor.tokenizer, model.config
    end = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    rows = []
    for index in range(0, TONES_NUM_SAMPLES, 16):
        text = tones_text(index)
        frames = math.ceil(len(render_tones(text)) * 24000 / TONES_SAMPLE_RATE / config.audio_config.hop_length)
        messages = [{"role": "0", "content": [{"type": "text", "text": text}]}]
        prompt = tokenizer(processor.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
        rows.append(prompt + [config.audio_token_id] * frames + [config.audio_eos_token_id, end])
    ids = torch.full((len(rows), max(map(len, rows))), end)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), 1
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.AdamW(model.model.language_model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    model.eval()


LM_PART = "tiny-vibevoice-lm"


def _lm_part(processor) -> TrainedPart:
    """Its LM after fit_token_layout, stored with dstune (dstune.builtin.trained); the rest is its initialisation."""

    def train(model) -> dict:
        fit_token_layout(model, processor)
        return {}

    return TrainedPart(
        LM_PART,
        train,
        stored=lambda model: {k: v for k, v in model.state_dict().items() if k.startswith("model.language_model.")},
    )


def build_tiny_vibevoice(out: Path, needs: dict) -> dict:
    from transformers import (
        GenerationConfig,
        VibeVoiceAcousticTokenizerFeatureExtractor,
        VibeVoiceForConditionalGeneration,
        VibeVoiceProcessor,
    )

    tokenizer = tiny_vibevoice_tokenizer()
    with deterministic_cpu(_SEED, 1), quiet_hf_libraries():
        model = VibeVoiceForConditionalGeneration(tiny_vibevoice_config(tokenizer)).eval()
        feature_extractor = VibeVoiceAcousticTokenizerFeatureExtractor(
            sampling_rate=24000, pad_to_multiple_of=model.config.audio_config.hop_length
        )
        processor = VibeVoiceProcessor(feature_extractor, tokenizer, chat_template=CHAT_TEMPLATE)
        give_trained_weights(_lm_part(processor), model)
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config = GenerationConfig(
        **TINY_VIBEVOICE_GENERATION, bos_token_id=end, eos_token_id=end, pad_token_id=end
    )
    with quiet_hf_libraries():
        model.save_pretrained(out)
        processor.save_pretrained(out)
    tokenizers = sum(
        p.numel() for m in (model.model.audio_tower, model.model.semantic_tokenizer_encoder) for p in m.parameters()
    )
    return {"model_parameters": model.num_parameters() - tokenizers, "codec_parameters": tokenizers}


TINY_VIBEVOICE = BuiltinModel(
    name="tiny-vibevoice",
    folder_name=FOLDER_NAME,
    family="tts_codebooks",
    description="VibeVoice (VibeVoiceForConditionalGeneration: Qwen2 LM + diffusion head over 7.5 Hz acoustic "
    "latents) with a tiny acoustic tokenizer inside it and its VibeVoiceProcessor",
    build=build_tiny_vibevoice,
    trained_parts=(LM_PART,),
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step as dstune trains it (its VibeVoiceModule: the LM's loss from the
# labels and the diffusion head's over every latent), whose saved tensors bench/activation_table.py counts
# (docs/memory.md): the measured activation constants the memory plan uses for this model.

ACOUSTIC_LATENT = 64  # VibeVoice-1.5B's acoustic latent width (not narrowed: the latents are the data)
# the diffusion head's layers as VibeVoice-1.5B has them: not checkpointed, so measured whole with what lies outside
# the LM's blocks (per latent and per width unit)
DIFFUSION_LAYERS = 4


def _vibevoice(heads, ffn_mult):
    """VibeVoice-1.5B's structure: a Qwen2 LM at head dim 128 (GQA 6:1, MLP 8960 / 1536 of the width, measured
    apart), the diffusion head at the LM's width (MLP 3x, its 4 layers), tiny frozen tokenizers (the training
    forward never runs them)."""
    from transformers import VibeVoiceConfig, VibeVoiceForConditionalGeneration

    width = heads * 128
    ffn = width * 8960 // 1536 * ffn_mult
    config = VibeVoiceConfig(
        text_config=dict(
            model_type="qwen2",
            vocab_size=LM_VOCAB,
            hidden_size=width,
            intermediate_size=ffn,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 6),
            tie_word_embeddings=True,
        ),
        audio_config=dict(
            model_type="vibevoice_acoustic_tokenizer", **dict(TINY_ACOUSTIC, hidden_size=ACOUSTIC_LATENT)
        ),
        semantic_model_config=dict(model_type="vibevoice_acoustic_tokenizer_encoder", **TINY_SEMANTIC),
        diffusion_head_config=dict(
            num_hidden_layers=DIFFUSION_LAYERS,
            hidden_size=width,
            intermediate_size=3 * width,
            latent_size=ACOUSTIC_LATENT,
        ),
        pad_token_id=LM_VOCAB - 1,
        eos_token_id=LM_VOCAB - 1,
        audio_bos_token_id=LM_VOCAB - 2,
        audio_eos_token_id=LM_VOCAB - 3,
        audio_token_id=LM_VOCAB - 4,
    )
    return VibeVoiceForConditionalGeneration(config), width, ffn, LM_VOCAB


def _vibevoice_run(model, tokens, context, dtype):
    """`context` script tokens, then `tokens` acoustic latents (one <audio> placeholder each) and the end, as
    dstune.models.vibevoice.model.VibeVoice.encode_batch lays them out, through the VibeVoiceModule the family trains."""
    import torch

    config = model.config
    ids = torch.cat(
        [
            torch.randint(0, LM_VOCAB - 8, (1, context), generator=generator()),
            torch.full((1, tokens), config.audio_token_id),
            torch.full((1, 1), config.audio_eos_token_id),
        ],
        1,
    )
    audio_mask = ids == config.audio_token_id
    condition_mask = torch.zeros_like(audio_mask)
    condition_mask[:, :-1] = audio_mask[:, 1:]
    if "latent_scaling_factor" in model.model._parameters:
        factors_as_buffers(model, VIBEVOICE_CARD.latent_factors)
    scheduler = noise_scheduler(model)
    trained = VibeVoiceModule(model, scheduler, int(scheduler.config.num_train_timesteps), VIBEVOICE_CARD.noise_draws)
    latents = randn(tokens, ACOUSTIC_LATENT, dtype=dtype)
    inputs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        latents=latents,
        labels=ids,
        audio_mask=audio_mask,
        condition_mask=condition_mask,
        seeds=torch.tensor([0]),
    )
    return lambda: trained(**inputs)[0].float()


ACTIVATION_CASES = (
    Case(
        "vibevoice",
        "VibeVoice (Qwen2 LM over the script and one position per acoustic latent, diffusion head per latent)",
        _vibevoice,
        _vibevoice_run,
        sizes=((8, 8), (24, 8), (8, 24)),
        check_size=(16, 12),
        lora_targets=LM_LORA_TARGET_MODULES,
        block_lists=attr(lm="model.language_model.layers"),
        ffn=True,
        heads=2,
        check_heads=3,
    ),
)
