"""builtin:tiny-gradium-phonon: a tiny Gradium Phonon made offline (listed by the gradium_phonon unit): transformers'
GradiumPhononTTSForConditionalGeneration (a causal backbone over the voice prompt, the text and the audio latents, a
flow head that samples each latent from the backbone's state, an end-of-speech head), the PocketTTSProcessor that
transformers gives the model (PocketTTSFeatureExtractor, a character-level tokenizer carrying Phonon's three audio
tokens at the real ids, a chat template that writes the class's prompt layout, a tiny PocketTTSAudioTokenizerModel as
its audio tokenizer), and a tiny MimiEncoderModel as the speaker codec whose unquantized latents are the voice prompt.

What the processor and generate assume is the real model's: 24 kHz audio, the audio tokenizer's frame of 1920
samples (12.5 latents per second), the speaker codec's 12.5 frames per second, the LSD flow head, the prompt layout
<voice> x voice frames, the text, <audio BOS>, then one <audio> per latent (no voice BOS: Phonon has none). Only the
widths are tiny (latents of 8 values, voice prompt frames of 16, two backbone layers, one flow block) and the
vocabulary (characters instead of the real 4001 pieces). The weights are the classes' own random initialisation.

The processor names its audio tokenizer by path (`audio_tokenizer_name_or_path`): it is written to `audio_tokenizer/`
in the folder and named by the folder's final path in the cache (the build writes into a temporary sibling that is
then renamed); the speaker codec is the folder's `speaker_codec/`.
"""

from __future__ import annotations

import string
from pathlib import Path

from dstune.builtin.common import BuiltinModel, deterministic_cpu
from dstune.families.flow_head_tts import FlowHeadLossModule
from dstune.hf import quiet_hf_libraries
from dstune.memory.activation_cases import LM_VOCAB, Case, attr, generator, randn
from dstune.spec.section import LM_LORA_TARGET_MODULES
from dstune.models.gradium_phonon.card import GRADIUM_PHONON_CARD

_SEED = 0
FOLDER_NAME = "tiny-gradium-phonon-v1"
# ids 0-6 as the real tokenizer's: <unk> <s> </s> <pad>=3, then <|audio_bos|>=4 <|audio_prompt|>=5 <|audio_latent|>=6
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
AUDIO_TOKENS = {
    "audio_bos_token": "<|audio_bos|>",
    "audio_prompt_token": "<|audio_prompt|>",
    "audio_latent_token": "<|audio_latent|>",
}
CHARACTERS = ("\u2581",) + tuple(string.ascii_letters + string.digits + ".,!?'-:;")
# The prompt layout PocketTTSProcessor expects without a voice BOS: the voice, the text, the audio BOS; a training
# target (the assistant's audio) follows the audio BOS.
CHAT_TEMPLATE = (
    "{%- for message in messages if message['role'] != 'assistant' -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}<|audio_prompt|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endfor -%}<|audio_bos|>"
    "{%- for message in messages if message['role'] == 'assistant' -%}"
    "{%- for part in message['content'] if part['type'] == 'audio' -%}<|audio_prompt|>{%- endfor -%}{%- endfor -%}"
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
TINY_SPEAKER_CODEC = dict(  # a Mimi encoder: its latents have hidden_size values (the voice prompt's width)
    hidden_size=16,
    num_filters=2,
    num_hidden_layers=1,
    intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
)
TINY_GRADIUM_PHONON_GENERATION = dict(
    do_sample=True, temperature=0.7, num_flow_steps=1, eos_threshold=-4.0, min_frames_before_eos=6
)


def tiny_gradium_phonon_tokenizer():
    """A character-level tokenizer (a SentencePiece-style word boundary) with Phonon's audio tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: number for number, token in enumerate(SPECIAL_TOKENS + tuple(AUDIO_TOKENS.values()) + CHARACTERS)}
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


def tiny_gradium_phonon_config(tokenizer):
    from transformers import GradiumPhononTTSConfig

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in AUDIO_TOKENS.items()}
    latent = TINY_AUDIO_TOKENIZER["latent_dim"]
    return GradiumPhononTTSConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=4096,
        latent_dim=latent,
        audio_prompt_dim=TINY_SPEAKER_CODEC["hidden_size"],
        num_speakers_embedding_dim=4,
        duration_delta_embedding_dim=8,
        pad_token_id=tokenizer.pad_token_id,
        audio_prompt_token_id=ids["audio_prompt_token"],
        audio_latent_token_id=ids["audio_latent_token"],
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


def build_tiny_gradium_phonon(out: Path, needs: dict) -> dict:
    from transformers import (
        GenerationConfig,
        GradiumPhononTTSForConditionalGeneration,
        MimiEncoderConfig,
        MimiEncoderModel,
        PocketTTSAudioTokenizerConfig,
        PocketTTSAudioTokenizerModel,
        PocketTTSFeatureExtractor,
        PocketTTSProcessor,
    )

    out = Path(out)
    final = out.parent / FOLDER_NAME  # where dstune.builtin renames the finished folder to
    card = GRADIUM_PHONON_CARD
    tokenizer = tiny_gradium_phonon_tokenizer()
    with deterministic_cpu(_SEED, 1), quiet_hf_libraries():
        codec = PocketTTSAudioTokenizerModel(PocketTTSAudioTokenizerConfig(**TINY_AUDIO_TOKENIZER)).eval()
        speaker_codec = MimiEncoderModel(MimiEncoderConfig(**TINY_SPEAKER_CODEC)).eval()
        model = GradiumPhononTTSForConditionalGeneration(tiny_gradium_phonon_config(tokenizer)).eval()
    model.generation_config = GenerationConfig(**TINY_GRADIUM_PHONON_GENERATION, pad_token_id=tokenizer.pad_token_id)
    with quiet_hf_libraries():
        codec.save_pretrained(out / card.codec_subfolder)
        codec.name_or_path = str(final / card.codec_subfolder)  # what processor_config.json names
        speaker_codec.save_pretrained(out / card.speaker_codec_subfolder)
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
        "speaker_codec_parameters": sum(p.numel() for p in speaker_codec.parameters()),
    }


TINY_GRADIUM_PHONON = BuiltinModel(
    name="tiny-gradium-phonon",
    folder_name=FOLDER_NAME,
    family="tts_codebooks",
    description="Gradium Phonon (GradiumPhononTTSForConditionalGeneration: causal backbone + LSD flow head over "
    "12.5 Hz codec latents, a speaker codec's voice prompt) with a tiny PocketTTSAudioTokenizerModel as its "
    "processor's audio tokenizer and a tiny MimiEncoderModel as its speaker codec",
    build=build_tiny_gradium_phonon,
)


# ------------------------------------------------------------------------------- activation measurement
# The real class at a narrow width, trained one step as dstune trains it (the flow-head loss module: the backbone on
# the latents, the LSD loss per latent with its noise draws, the self-distillation term's JVP, the end-of-speech
# loss), whose saved tensors bench/activation_table.py counts (docs/memory.md): the measured activation constants
# the memory plan uses for this model.

REAL_WIDTH, REAL_HEAD_DIM, REAL_FLOW_WIDTH = 768, 64, 512  # gradium/phonon-31m-en's backbone and flow head widths
LATENT_DIM = 32  # the audio tokenizer's latent width (not narrowed: the latents are the data)


def _gradium_phonon(heads, ffn_mult):
    """gradium/phonon-31m-en's structure at `heads` heads of the real head dim: the backbone's MLP 4x its width
    (measured apart), the flow head at the real ratio of its width to the backbone's (its 6 blocks), the latents of
    32 values; a narrow vocabulary."""
    from transformers import GradiumPhononTTSConfig, GradiumPhononTTSForConditionalGeneration

    width = heads * REAL_HEAD_DIM
    ffn = width * 4 * ffn_mult
    flow = width * REAL_FLOW_WIDTH // REAL_WIDTH
    config = GradiumPhononTTSConfig(
        vocab_size=LM_VOCAB,
        hidden_size=width,
        num_attention_heads=heads,
        intermediate_size=ffn,
        num_hidden_layers=2,
        latent_dim=LATENT_DIM,
        flow_head_config=dict(hidden_size=flow, latent_dim=LATENT_DIM, condition_dim=width),
        lsd_distill_probability=1.0,  # the self-distillation term on: the step that keeps the most
    )
    return GradiumPhononTTSForConditionalGeneration(config), width, ffn, 0


def _gradium_phonon_run(model, tokens, context, dtype):
    """`context` text tokens, the audio BOS and `tokens` latents (one <audio> placeholder each), as
    dstune.families.flow_head_tts lays them out, through the module dstune trains (its per-sample LSD loss)."""
    import torch

    config = model.config
    ids = torch.cat(
        [
            torch.randint(10, config.vocab_size, (1, context), generator=generator()),
            torch.full((1, 1), config.audio_bos_token_id),
            torch.full((1, tokens), config.audio_latent_token_id),
        ],
        1,
    )
    trained = FlowHeadLossModule(model).train()
    inputs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        labels=randn(1, tokens, LATENT_DIM, dtype=dtype),
        labels_mask=torch.ones(1, tokens, dtype=torch.long),
        seeds=torch.tensor([0]),
        distill_seed=0,
    )
    anchor = torch.zeros((), dtype=dtype)
    return lambda: trained(anchor, **inputs).float()


ACTIVATION_CASES = (
    Case(
        "gradium-phonon",
        "Gradium Phonon (backbone over the text and one position per latent, the LSD flow head per latent)",
        _gradium_phonon,
        _gradium_phonon_run,
        sizes=((8, 8), (24, 8), (8, 24)),
        check_size=(16, 12),
        lora_targets=LM_LORA_TARGET_MODULES,
        block_lists=attr(backbone="model.layers"),
        ffn=True,
        heads=2,
        check_heads=3,
    ),
)
