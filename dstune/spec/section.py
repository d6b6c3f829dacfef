"""The base of every spec section (kept apart so the section modules and models.py share it without a cycle)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

# LoRA's usual targets in diffusers UNets and transformers: the attention projections (diffusers' LoRA examples),
DEFAULT_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
LM_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")  # and in a Llama-class causal LM

# `builtin:NAME` in model.pretrained and data.path: a tiny model or a synthetic dataset dstune makes offline.
BUILTIN_PREFIX = "builtin:"

# The spec's `model.family` of the video core (dstune.families.video_card), and its first name (after the first model
# it trained), which a spec may still write: validate notes that it is the old name.
VIDEO_FAMILY = "video"
VIDEO_FAMILY_ALIAS = "wan"

# The families that train on codec codes, which data.cache.codec_tokens caches (the data and model sections ask).
CODEC_TOKEN_FAMILIES = ("tts_lm", "tts_codebooks")


class Section(BaseModel):
    """Base for every spec section: frozen, and unknown keys are errors rather than silent defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    # A model section's LoRA file formats (output.lora_format, the default first -> the key scheme each is written
    # in; empty: no LoRA file), and whether its `pretrained` may be a single checkpoint file. Other sections ignore them.
    LORA_FORMATS: ClassVar[dict[str, str]] = {}
    SINGLE_FILE: ClassVar[bool] = False

    def folder_defaults(self, read) -> dict:
        """A model section's keys that the spec leaves unset and its pretrained folder decides: {key: value}, from
        `read(name)` (one of the folder's JSON files, None when absent). None here; dstune.model_defaults applies
        them for validate and start-up alike."""
        return {}
