"""builtin:tiny-pocket-tts: a tiny Pocket TTS made offline (listed by the pocket_tts unit): transformers'
PocketTTSForConditionalGeneration (a causal backbone over the voice prompt, the text and the audio latents, a flow
head that samples each latent from the backbone's state, an end-of-speech head) and a PocketTTSProcessor
(PocketTTSFeatureExtractor, a character-level tokenizer carrying Pocket TTS's four audio tokens, a chat template that
writes the class's prompt layout, and a tiny PocketTTSAudioTokenizerModel as its audio tokenizer).

What the processor and generate assume is the real model's: 24 kHz audio, the audio tokenizer's frame of 1920
samples (upsampling [6, 5, 4] x latent stride 16: 12.5 latents per second), the LSD flow head, the prompt layout
<voice BOS> <voice> x frames, the text, <audio BOS>, then one <audio> per latent. Only the widths are tiny (latents of
8 values, one backbone layer pair, one flow block) and the vocabulary (characters instead of the real 4000-piece
SentencePiece model). The weights are the classes' own random initialisation; what the samples test is that
generation and decoding run.

The processor keeps the codec outside the model class, naming it by path (`audio_tokenizer_name_or_path`): it is
written to `audio_tokenizer/` in the folder and named by the folder's final path in the cache (the build writes into
a temporary sibling that is then renamed).
"""

from __future__ import annotations

import string
from pathlib import Path

from dstune.builtin.common import BuiltinModel, deterministic_cpu
from dstune.hf import quiet_hf_libraries
from dstune.families.flow_head_tts import FlowHeadLossModule
from dstune.memory.activation_cases import LM_VOCAB, Case, attr, generator, randn
from dstune.spec.section import LM_LORA_TARGET_MODULES

_SEED = 0
FOLDER_NAME = "tiny-pocket-tts-v1"
AUDIO_TOKENIZER_FOLDER = "audio_tokenizer"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0-3: the real tokenizer's, pad 3
CHARACTERS = ("\u2581",) + tuple(string.ascii_letters + string.digits + ".,!?'-:;")
# the tokenizer's attribute -> its token: the voice's placeholder, the audio latent's, the voice BOS, the audio BOS
AUDIO_TOKENS = {
    "audio_prompt_token": "<|voice|>",
    "audio_latent_token": "<|audio|>",
    "audio_prompt_bos_token": "<|voice_bos|>",
    "audio_bos_token": "<|audio_bos|>",
}
# The prompt layout PocketTTSProcessor expects (its docstring): the voice BOS and the voice, the text, the audio BOS;
# a training target (the assistant's audio) follows the audio BOS.
CHAT_TEMPLATE = (
    "{%- for message in messages if message['role'] != 'assistant' -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}<|voice_bos|><|voice|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endfor -%}<|audio_bos|>"
    "{%- for message in messages if message['role'] == 'assistant' -%}"
    "{%- for part in message['content'] if part['type'] == 'audio' -%}<|voice|>{%- endfor -%}{%- endfor -%}"
)
TINY_AUDIO_TOKENIZER = dict(
    hidden_size=16,
    num_filters=2,
    upsample_groups=16,
    num_hidden_layers=1,
    intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    latent_dim=8,
)
# The runtime values generate falls back to (transformers' _GENERATION_DEFAULTS) and Kyutai's sampling temperature
TINY_POCKET_TTS_GENERATION = dict(
    do_sample=True, temperature=0.7, num_flow_steps=1, eos_threshold=-4.0, min_frames_before_eos=6
)


def tiny_pocket_tts_tokenizer():
    """A character-level tokenizer (a SentencePiece-style word boundary) with Pocket TTS's audio tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: number for number, token in enumerate(SPECIAL_TOKENS + CHARACTERS + tuple(AUDIO_TOKENS.values()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=dict(AUDIO_TOKENS),
        model_max_length=4096,
    )


def tiny_pocket_tts_config(tokenizer):
    from transformers import PocketTTSConfig

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in AUDIO_TOKENS.items()}
    latent = TINY_AUDIO_TOKENIZER["latent_dim"]
    return PocketTTSConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=4096,
        latent_dim=latent,
        pad_token_id=tokenizer.pad_token_id,
        audio_prompt_token_id=ids["audio_prompt_token"],
        audio_latent_token_id=ids["audio_latent_token"],
        audio_prompt_bos_token_id=ids["audio_prompt_bos_token"],
        audio_bos_token_id=ids["audio_bos_token"],
        flow_head_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            latent_dim=latent,
            condition_dim=32,
            frequency_embedding_size=16,
            loss_weighting_hidden_size=8,
            loss_weighting_num_layers=1,
        ),
    )


def build_tiny_pocket_tts(out: Path, needs: dict) -> dict:
    from transformers import (
        GenerationConfig,
        PocketTTSAudioTokenizerConfig,
        PocketTTSAudioTokenizerModel,
        PocketTTSFeatureExtractor,
        PocketTTSForConditionalGeneration,
        PocketTTSProcessor,
    )

    out = Path(out)
    final = out.parent / FOLDER_NAME  # where dstune.builtin renames the finished folder to
    tokenizer = tiny_pocket_tts_tokenizer()
    with deterministic_cpu(_SEED, 1), quiet_hf_libraries():
        codec = PocketTTSAudioTokenizerModel(PocketTTSAudioTokenizerConfig(**TINY_AUDIO_TOKENIZER)).eval()
        model = PocketTTSForConditionalGeneration(tiny_pocket_tts_config(tokenizer)).eval()
    pad = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(**TINY_POCKET_TTS_GENERATION, pad_token_id=pad)
    with quiet_hf_libraries():
        codec.save_pretrained(out / AUDIO_TOKENIZER_FOLDER)
        codec.name_or_path = str(final / AUDIO_TOKENIZER_FOLDER)  # what processor_config.json names
        feature_extractor = PocketTTSFeatureExtractor(
            sampling_rate=codec.config.sampling_rate,
            frame_size=codec.config.frame_size,
            pad_to_multiple_of=codec.config.frame_size,
        )
        PocketTTSProcessor(feature_extractor, tokenizer, codec, chat_template=CHAT_TEMPLATE).save_pretrained(out)
        model.save_pretrained(out)
    return {
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "codec_parameters": sum(p.numel() for p in codec.parameters()),
    }


TINY_POCKET_TTS = BuiltinModel(
    name="tiny-pocket-tts",
    folder_name=FOLDER_NAME,
    family="tts_codebooks",
    description="Pocket TTS (PocketTTSForConditionalGeneration: causal backbone + LSD flow head over 12.5 Hz codec "
    "latents, voice prompt) with a tiny PocketTTSAudioTokenizerModel as its PocketTTSProcessor's audio tokenizer",
    build=build_tiny_pocket_tts,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step as dstune trains it (its FlowHeadLossModule: the backbone over the
# text and the latents, the LSD loss per sample with the self-distillation term, the end-of-speech loss), whose saved
# tensors bench/activation_table.py counts (docs/memory.md): the measured activation constants the memory plan uses.

HEAD_DIM = 64  # eustlb/pocket-tts: hidden 1024 over 16 heads
# its flow head as the real one has it: 6 blocks at half the backbone's width, a frequency embedding a quarter of it,
# over latents of 1/32 of it (32 values at 1024); not checkpointed, so measured whole with what lies outside the
# backbone's blocks (per latent and per width unit). The latents are narrowed with the rest (unlike other cases' latent
# channels): every tensor of the flow head is a latent or a flow-width vector per draw, so a latent kept at 32 values
# beside a 64-wide flow head would be counted per width unit and overstate the real model's several times over.
LATENT_PER_WIDTH = 32
FLOW_LAYERS = 6


def _pocket_tts(heads, ffn_mult):
    """eustlb/pocket-tts's structure: a backbone at head dim 64 (MLP 4x the width, measured apart), the LSD flow head
    at half its width, conditioned on its state; the self-distillation term on every step (the step that holds the
    most: the plan counts the worst step)."""
    from transformers import PocketTTSConfig, PocketTTSForConditionalGeneration

    width = heads * HEAD_DIM
    ffn = 4 * width * ffn_mult
    latent = width // LATENT_PER_WIDTH
    config = PocketTTSConfig(
        vocab_size=LM_VOCAB + 4,
        hidden_size=width,
        head_dim=HEAD_DIM,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=ffn,
        latent_dim=latent,
        pad_token_id=3,
        audio_prompt_token_id=LM_VOCAB,
        audio_latent_token_id=LM_VOCAB + 1,
        audio_prompt_bos_token_id=LM_VOCAB + 2,
        audio_bos_token_id=LM_VOCAB + 3,
        lsd_distill_probability=1.0,
        flow_head_config=dict(
            hidden_size=width // 2,
            num_hidden_layers=FLOW_LAYERS,
            latent_dim=latent,
            condition_dim=width,
            frequency_embedding_size=width // 4,
        ),
    )
    return PocketTTSForConditionalGeneration(config), width, ffn, 0  # no logits over the vocabulary


def _pocket_tts_run(model, tokens, context, dtype):
    """`context` text tokens, the audio BOS, then `tokens` latents (one <audio> each), as the processor lays out a
    training utterance (a voice prompt's latents are positions of the backbone like the text's), through the
    FlowHeadLossModule dstune trains."""
    import torch

    config = model.config
    ids = torch.cat(
        [
            torch.randint(4, LM_VOCAB, (1, context), generator=generator()),
            torch.tensor([[config.audio_bos_token_id]]),
            torch.full((1, tokens), config.audio_latent_token_id),
        ],
        1,
    )
    trained = FlowHeadLossModule(model).train()
    inputs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        labels=randn(1, tokens, config.latent_dim, dtype=dtype),
        labels_mask=torch.ones(1, tokens, dtype=torch.long),
        seeds=torch.tensor([0]),
        distill_seed=0,
    )
    anchor = torch.zeros((), requires_grad=True)
    return lambda: trained(anchor, **inputs).float()


ACTIVATION_CASES = (
    Case(
        "pocket-tts",
        "Pocket TTS (a backbone over the text and one position per latent, the LSD flow head per latent)",
        _pocket_tts,
        _pocket_tts_run,
        sizes=((8, 8), (24, 8), (8, 24)),
        check_size=(16, 12),
        lora_targets=LM_LORA_TARGET_MODULES,
        block_lists=attr(backbone="model.layers"),
        ffn=True,
        heads=2,
        check_heads=3,
    ),
)
