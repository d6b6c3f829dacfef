"""VibeVoice's torch-free facts, as its recipe on the tts_codebooks family (dstune.families.codebook_models): the
class's trained part counted without its two speech tokenizers (frozen, inside the class, counted apart, with the
acoustic tokenizer's copy that encodes the clips), and one clip's activations: the Qwen2 LM over the script's tokens
and one position per acoustic latent (7.5 per second), plus the diffusion head run DDPM_BATCH_MULTIPLIER times per
latent, from the constants measured on VibeVoiceForConditionalGeneration itself as the family trains it (the
"vibevoice" activation case in its builtin module: the head at the LM's width with its 4 layers, as VibeVoice-1.5B)
at the folder's LM width, MLP width, vocabulary and layers."""

from __future__ import annotations

import json
from functools import lru_cache

from dstune.families.codebook_models import CodebooksModel
from dstune.hf import quiet_hf_libraries
from dstune.memory.activations import TEXT_TOKENS_PER_SECOND, ModelShape, in_plan_units, measured_sample_bytes
from dstune.memory.counts import SizesUnknown
from dstune.memory.plan import ModelCounts

ARCHITECTURE = "VibeVoiceForConditionalGeneration"
LATENTS_KIND = "vibevoice_latents"  # the codec cache's kind: the acoustic tokenizer's float latents per frame
DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds
PROMPT_TOKENS = 40  # the chat template's system prompt and section headers


def _hop(audio: dict) -> int:
    hop = 1
    for ratio in audio.get("downsampling_ratios") or (2, 2, 4, 5, 5, 8):
        hop *= int(ratio)
    return hop


@lru_cache(maxsize=8)
def _tokenizer_params(config_text: str) -> tuple[int, int]:
    """(acoustic tokenizer (encoder + decoder), semantic encoder) parameters, on the meta device."""
    import torch
    import transformers

    config = json.loads(config_text)
    counts = []
    for key in ("audio_config", "semantic_model_config"):
        with quiet_hf_libraries(), torch.device("meta"):
            part = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(**config[key]))
        counts.append(sum(p.numel() for p in part.parameters()))
    return counts[0], counts[1]


def config_problem(config: dict):
    """Why the class cannot train a folder of this config.json, or None. microsoft/VibeVoice-1.5B ships the original
    layout, which VibeVoiceConfig does not read: it would build a default-sized model and load none of the weights."""
    if "decoder_config" in config and "text_config" not in config:
        return (
            "its config.json is in the original VibeVoice layout (decoder_config, acoustic_tokenizer_config), which "
            "transformers' VibeVoiceForConditionalGeneration does not read; use a folder converted to the "
            "transformers layout (text_config, audio_config), as bezzam/VibeVoice-1.5B-hf"
        )
    return None


def count(spec, num_samples: int, folder, origin: str, config: dict, counted: tuple) -> ModelCounts:
    params, largest, lora, default_lora = counted
    if config_problem(config):
        raise SizesUnknown(f"{origin}: {config_problem(config)}")
    try:
        audio, text = config["audio_config"], config["text_config"]
    except KeyError as err:
        raise SizesUnknown(f"{origin}: config.json has no {err}") from None
    acoustic, semantic = _tokenizer_params(json.dumps(config, sort_keys=True))
    trained = params - acoustic - semantic  # the tokenizers stay frozen inside the class
    frame_rate = 24000 / _hop(audio)
    seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
    shape = ModelShape(
        text["hidden_size"], {"lm": text["num_hidden_layers"]}, ffn=text["intermediate_size"], vocab=text["vocab_size"]
    )
    script = seconds * TEXT_TOKENS_PER_SECOND + PROMPT_TOKENS
    sample = measured_sample_bytes("vibevoice", shape, seconds * frame_rate, script, spec.train.precision)
    lm = in_plan_units(sample, spec.train.precision)
    cached = ("codec",) if spec.data.cache.codec_tokens else ()
    latent = int(audio.get("hidden_size", 64))
    cache_bytes = int(4 * frame_rate * latent * seconds * num_samples) if spec.data.cache.codec_tokens else 0
    return ModelCounts(
        "model",
        trained,
        lora or trained,
        largest,
        # the acoustic tokenizer's fp32 copy that encodes the clips (the cache replaces it), and both tokenizers
        # frozen inside the class (generate decodes and re-encodes with them)
        {"codec": acoustic, "tokenizers": acoustic + semantic},
        cached,
        int(lm[0]),
        int(lm[1]),
        default_lora,
        cache_bytes,
        origin,
    )


CODEBOOKS_MODEL = CodebooksModel(
    title="VibeVoice",
    architecture=ARCHITECTURE,
    torch_side="dstune.models.vibevoice.model",
    count=count,
    takes_voice_prompts=True,
    config_problem=config_problem,
    # the speech tokenizers, the semantic connector (only generate uses it) and the latent statistics
    frozen_parts=(
        "model.audio_tower",
        "model.semantic_tokenizer_encoder",
        "model.semantic_connector",
        "model.latent_scaling_factor",
        "model.latent_bias_factor",
    ),
)
