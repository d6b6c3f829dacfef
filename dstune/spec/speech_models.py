"""What the speech families' `model` sections share: LoRA on a causal LM (LmLoraSpec, LmLoraSection). The sections
themselves are their model units' (dstune/models/<name>/spec.py). Torch-free like the rest of the spec."""

from __future__ import annotations

from typing import ClassVar, Optional

from pydantic import Field, field_validator

from dstune.spec.model_sections import LM_LORA_TARGET_MODULES, LoraSpec
from dstune.spec.section import Section


class LmLoraSpec(LoraSpec):
    """LoRA on a causal LM: the same settings, with a Llama-class LM's attention projections as the targets."""

    target_modules: list[str] = Field(
        default_factory=lambda: list(LM_LORA_TARGET_MODULES),
        description="Names (or dotted name suffixes, as peft matches them) of the LM's linear layers that get an "
        "adapter. The default, the attention projections q_proj, k_proj, v_proj, o_proj, fits Llama- and "
        "Qwen-class causal LMs.",
    )


class LmLoraSection(Section):
    """What the speech sections that train a causal LM share about LoRA: `lora` left without
    target_modules gets the attention projections, written into the spec the run saves, and the settings in
    effect are LmLoraSpec's defaults when `lora` is left out."""

    LORA_FORMATS: ClassVar[dict[str, str]] = {"peft": "peft"}  # a peft adapter folder beside the merged model

    @field_validator("lora", check_fields=False)
    @classmethod
    def _lm_target_modules(cls, value):
        if value is not None and "target_modules" not in value.model_fields_set:
            return value.model_copy(update={"target_modules": list(LM_LORA_TARGET_MODULES)})
        return value

    @property
    def lora_settings(self) -> Optional[LoraSpec]:
        """The LoRA settings in effect (None for full training); target_modules default to the attention."""
        if self.train != "lora":
            return None
        return self.lora if self.lora is not None else LmLoraSpec()
