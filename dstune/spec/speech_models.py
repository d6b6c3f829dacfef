"""What the speech families' `model` sections share: LoRA on a causal LM (LmLoraSpec, LmLoraSection); and the section
of the multi-codebook TTS core (CodebooksModelSpec, `model.family tts_codebooks`). The sections of the families a
unit owns are its own (dstune/models/<name>/spec.py). Torch-free like the rest of the spec."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from dstune.spec.model_sections import LM_LORA_TARGET_MODULES, LoraSpec, first_builtin
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


class CodebooksModelSpec(LmLoraSection):
    """The multi-codebook TTS models, each trained through its own transformers class (the folder's `architectures`
    say which model: its card, dstune.families.codebooks)."""

    modality: ClassVar[str] = "audio"
    MODEL_FOLDER_FIELDS: ClassVar[tuple[str, ...]] = ("pretrained",)
    COMPANION_FOLDERS: ClassVar[dict[str, str]] = {}
    FILE_FIELDS: ClassVar[tuple[str, ...]] = ()
    family: Literal["tts_codebooks"] = Field(
        description="Model family. `tts_codebooks`: a TTS model that predicts several codec codebooks per audio "
        "frame, trained through its own transformers class and loss (the folder's architecture says which: the "
        "table at the top of this page). Its codec is the folder's own (inside the class, or named by its "
        "processor). See docs/tts.md."
    )
    pretrained: str = Field(
        default_factory=lambda: first_builtin("tts_codebooks"),
        description="The model's transformers folder (config.json naming its class, weights, its processor files), "
        "a hub id already in the local Hugging Face cache, or a built-in tiny model of the family (`builtin:NAME`; "
        "`dstune init --model NAME` names each model's). Omitted: the family's first model's built-in.",
    )
    train: Literal["full", "lora"] = Field(
        "full",
        description="`full`: every weight but the codec's is trained. `lora`: peft LoRA adapters on "
        "`lora.target_modules` (the attention of every transformer in the class by default: a backbone and its "
        "depth decoder; an encoder-decoder's encoder and decoder, self- and cross-attention) are trained; the "
        "export is the merged folder with the peft adapter in `adapter/`.",
    )
    lora: Optional[LmLoraSpec] = Field(
        None,
        description="LoRA settings, only with `train: lora`: `rank` (16), `alpha` (= rank), `target_modules` "
        "([q_proj, k_proj, v_proj, o_proj]), `dropout` (0.0); omitted: those defaults.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute the transformers' activations in backward (a backbone and its depth decoder, "
        "an encoder-decoder's encoder and decoder).",
    )
    max_sample_seconds: float = Field(
        2.0, gt=0, description="Samples during training: the longest audio generated per prompt, in seconds."
    )
    sample_temperature: float = Field(
        0.8,
        ge=0,
        description="Samples: softmax temperature of the audio codes (a backbone with a depth decoder: both; "
        "other classes: every codebook, with the folder's generation_config for the rest) (0: greedy).",
    )

    @model_validator(mode="after")
    def _lora_only_with_lora(self) -> "CodebooksModelSpec":
        if self.lora is not None and self.train != "lora":
            raise ValueError("lora settings are given but `train` is 'full': set `train: lora`, or remove `lora`")
        return self
