"""The `model` section of the multi-codebook TTS models trained through their own transformers class
(`model.family tts_codebooks`), listed in the spec's union by dstune.models.registry. Torch-free."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, model_validator

from dstune.models import registry
from dstune.spec.speech_models import LmLoraSection, LmLoraSpec


class TtsCodebooksModel(LmLoraSection):
    """A multi-codebook TTS model trained through its own transformers class (chosen by the folder's
    `architectures`): Sesame CSM (CsmForConditionalGeneration: backbone + depth decoder over Mimi codebooks), and the
    classes other units declare on the family (their `pipelines`, dstune.families.codebook_models)."""

    modality: ClassVar[str] = "audio"
    TRAINED_CLASSES: ClassVar[tuple[str, ...]] = ("CsmForConditionalGeneration", *registry.pipelines("tts_codebooks"))
    MODEL_FOLDER_FIELDS: ClassVar[tuple[str, ...]] = ("pretrained",)
    COMPANION_FOLDERS: ClassVar[dict[str, str]] = {}
    FILE_FIELDS: ClassVar[tuple[str, ...]] = ()
    family: Literal["tts_codebooks"] = Field(
        description="Model family. `tts_codebooks`: a TTS model that predicts several codec codebooks per audio "
        "frame, trained through its own transformers class and loss (the folder's architecture says which: "
        f"{', '.join(TRAINED_CLASSES)}). Its codec is the folder's own (Mimi inside CSM's class; the DAC "
        "DiaProcessor names). See docs/tts.md."
    )
    pretrained: str = Field(
        "builtin:tiny-csm",
        description="The model's transformers folder (config.json naming its class, weights, its processor files), "
        "a hub id already in the local Hugging Face cache, or a built-in tiny model of the family (`builtin:tiny-csm`; "
        "`dstune init --model NAME` names each model's).",
    )
    train: Literal["full", "lora"] = Field(
        "full",
        description="`full`: every weight but the codec's is trained. `lora`: peft LoRA adapters on "
        "`lora.target_modules` (the attention of every transformer in the class by default: CSM's backbone and "
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
        description="Recompute the transformers' activations in backward (CSM's backbone and depth decoder, "
        "an encoder-decoder's encoder and decoder).",
    )
    max_sample_seconds: float = Field(
        2.0, gt=0, description="Samples during training: the longest audio generated per prompt, in seconds."
    )
    sample_temperature: float = Field(
        0.8,
        ge=0,
        description="Samples: softmax temperature of the audio codes (CSM: backbone and depth decoder; "
        "other classes: every codebook, with the folder's generation_config for the rest) (0: greedy).",
    )

    @model_validator(mode="after")
    def _lora_only_with_lora(self) -> "TtsCodebooksModel":
        if self.lora is not None and self.train != "lora":
            raise ValueError("lora settings are given but `train` is 'full': set `train: lora`, or remove `lora`")
        return self
