"""The card type of the flow-head TTS models on the multi-codebook core (`FlowHeadTTSCard`, torch-free): a causal
backbone over one stream (a voice prompt, the text, the speech's continuous codec latents) whose state conditions an
LSD flow head that samples each next latent, and an end-of-speech head; the processor's audio tokenizer (outside the
class, named by processor_config.json) is the frozen codec whose latents the codec cache holds.

What the memory plan knows of such a model: the class counted without its codecs, each codec counted from its own
config (`companion_configs`), and one clip's activations: from the constants measured on the class itself where the
activation table holds the card's key (its unit's activation case: the backbone's blocks, and outside them the flow
head's passes over each latent's noise draws; the latents are the tokens, the text and the voice prompt's frames the
context), else from the generic formulas: the backbone over the voice prompt, the text and one position per latent,
and the flow head run on the class's noise draws per latent, three passes each (the diagonal term, the
self-distillation term's forward-mode JVP and its target)."""

from __future__ import annotations

from dataclasses import dataclass

from dstune.families.codebooks_card import CodebooksCard, processor_codec_config
from dstune.memory.activations import (
    TEXT_TOKENS_PER_SECOND,
    ModelShape,
    activation_constants,
    codec_frame_rate,
    in_plan_units,
    measured_sample_bytes,
    transformer_layer_bytes,
)
from dstune.memory.counts import count_component, read_config
from dstune.memory.plan import ModelCounts

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds
FLOW_HEAD_PASSES = 3  # the flow head's passes per noise draw in the loss: diagonal, JVP, distillation target


@dataclass(frozen=True, kw_only=True)
class FlowHeadTTSCard(CodebooksCard):
    codec_subfolder: str  # where dstune's built-in and stored folders keep the audio tokenizer (its config)
    latents_kind: str  # the codec cache's kind: the audio tokenizer's float latents per frame
    voice_seconds: float  # the longest voice prompt a training utterance is given (its reference clip's start)

    def codec_config_path(self, folder, config_origin: str):
        """The audio tokenizer's config.json (dstune.families.codebooks_card.processor_codec_config)."""
        return processor_codec_config(folder, self.codec_subfolder, config_origin, "the audio tokenizer")

    def companion_configs(self, folder, config_origin: str) -> dict:
        """The frozen parts outside the class, name -> config.json: the audio tokenizer (a model whose voice
        prompts come from another encoder adds it)."""
        return {"codec": self.codec_config_path(folder, config_origin)}

    def count_model(self, spec, num_samples: int, folder, origin: str, config: dict, counted: tuple) -> ModelCounts:
        params, _, lora_params, default_lora, _ = counted
        configs = self.companion_configs(folder, origin)
        companions = {name: count_component(str(path))[0] for name, path in configs.items()}
        frame_rate = float(config.get("frame_rate") or codec_frame_rate(read_config(configs["codec"])))
        seconds = spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS
        hidden, ffn = int(config.get("hidden_size", 1024)), int(config.get("intermediate_size", 4096))
        head = config.get("flow_head_config") or {}
        head_width, head_layers = int(head.get("hidden_size", 512)), int(head.get("num_hidden_layers", 6))
        frames = seconds * frame_rate
        context = min(seconds, self.voice_seconds) * frame_rate + seconds * TEXT_TOKENS_PER_SECOND
        layers = int(config.get("num_hidden_layers", 6))
        if self.key in activation_constants():
            shape = ModelShape(hidden, {"backbone": layers}, ffn=ffn)
            sample = measured_sample_bytes(self.key, shape, frames, context, spec.train.precision)
            full, checkpointed = in_plan_units(sample, spec.train.precision)
        else:
            layer = transformer_layer_bytes(frames + context, hidden, ffn, gated=False)
            draws = frames * int(config.get("flow_loss_num_samples", 4)) * FLOW_HEAD_PASSES
            flow = draws * head_layers * transformer_layer_bytes(1, head_width, head_width, gated=False)
            full = layers * layer + flow
            checkpointed = (frames + context) * hidden * 2 * layers + layer + flow
        latent = int(config.get("latent_dim", 32))
        cached = ("codec",) if spec.data.cache.codec_tokens else ()
        cache_bytes = int(4 * frame_rate * latent * seconds * num_samples) if spec.data.cache.codec_tokens else 0
        return ModelCounts(
            "model",
            params,
            lora_params or params,
            params,  # ZeRO-3 gathers the whole class at once (a leaf module: the flow head's JVP)
            companions,
            cached,
            int(full),
            int(checkpointed),
            default_lora,
            cache_bytes,
            origin,
        )
