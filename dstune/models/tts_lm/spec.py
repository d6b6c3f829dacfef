"""The `model` section of the codec-token TTS language models (`model.family tts_lm`, Orpheus's layout included),
listed in the spec's union by dstune.registry.FAMILY_SECTIONS. Torch-free."""

from __future__ import annotations

from typing import Callable, ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from dstune.spec.speech_models import LmLoraSection, LmLoraSpec

TTS_LAYOUT_FILE = "dstune_tts.json"  # a tts_lm folder's token layout (dstune.models.tts_lm.token_layouts describes it)


def default_codec(layout_file: Optional[dict], token_layout: Optional[str]) -> str:
    """The codec of a tts_lm model whose spec leaves model.codec out: the one its folder's dstune_tts.json
    (`layout_file`) names, else SNAC for the orpheus layout, else EnCodec (dstune's layout over a plain LM)."""
    if layout_file is not None and layout_file.get("codec"):
        return str(layout_file["codec"])
    return "snac" if token_layout == "orpheus" else "encodec"


class TtsLmModelSpec(LmLoraSection):
    modality: ClassVar[str] = "audio"  # what the data is (dstune.spec.models.VIDEO_FAMILIES, AUDIO_FAMILIES)
    # What `dstune validate` checks of the folders offline: see DenoiserModelBase.
    MODEL_FOLDER_FIELDS: ClassVar[tuple[str, ...]] = ("pretrained",)
    COMPANION_FOLDERS: ClassVar[dict[str, str]] = {"codec_pretrained": "codec"}
    FILE_FIELDS: ClassVar[tuple[str, ...]] = ()
    family: Literal["tts_lm"] = Field(
        description="Model family. `tts_lm`: a transformers causal LM (Llama/Qwen-class) over text tokens followed "
        "by audio-codec tokens; a frozen codec (EnCodec, DAC, Mimi or SNAC) turns audio into tokens and back. The "
        "token layout (model.token_layout) says the prompt, the interleave and the loss mask. See docs/tts.md."
    )
    pretrained: str = Field(
        "builtin:tiny-tts-lm",
        description="A causal-LM folder (config.json + weights, optionally a tokenizer and a `codec/` subfolder and "
        "the `dstune_tts.json` a dstune export writes), a hub id already in the local Hugging Face cache, or "
        "`builtin:tiny-tts-lm` (a tiny model built offline). An LM without audio tokens gets them appended.",
    )
    codec: Optional[Literal["encodec", "dac", "mimi", "snac"]] = Field(
        None,
        description="The codec class: EncodecModel, DacModel or MimiModel (transformers), or SNAC (the "
        "`snac` package; Orpheus's codec, hierarchical codebooks). Omitted: the codec the pretrained folder's "
        "dstune_tts.json names, else `snac` with token_layout orpheus, else `encodec`.",
    )
    token_layout: Optional[Literal["dstune", "orpheus"]] = Field(
        None,
        description="The token layout preset (docs/tts.md): `dstune` (text, BOS, flattened codes, EOS; loss on "
        "audio) or `orpheus` (Orpheus's prompt tokens and SNAC 24 kHz codes, 7 per frame from id 128266; loss on "
        "every token). Omitted: the pretrained folder's dstune_tts.json, else `dstune`. A folder's layout wins and "
        "must agree with this key when both are given.",
    )
    codec_pretrained: Optional[str] = Field(
        None, description="The codec folder or hub id (already downloaded). Omitted: `<pretrained>/codec`."
    )
    num_codebooks: Optional[int] = Field(
        None,
        gt=0,
        description="Residual codebooks kept per audio frame (the first N: coarse to fine). Omitted: the "
        "pretrained folder's dstune_tts.json, else every codebook the codec makes.",
    )
    added_tokens: Optional[list[str]] = Field(
        None,
        description="New text tokens for a new language (words or characters), added to the folder's tokenizer; "
        "the LM's embeddings grow to hold their ids (before ZeRO partitions them) and they are trained with the rest. "
        "The export's tokenizer and layout include them. Not with `train: lora` (the new rows would stay untrained).",
    )
    train: Literal["full", "lora"] = Field(
        "full",
        description="`full`: every weight of the LM is trained. `lora`: the LM is frozen and peft LoRA "
        "adapters on `lora.target_modules` are trained and checkpointed; the export is the merged transformers "
        "folder (synthesize and the model's own inference code use it unchanged) with the peft adapter folder in "
        "`adapter/` (PeftModel.from_pretrained onto the base folder). See docs/tts.md.",
    )
    lora: Optional[LmLoraSpec] = Field(
        None,
        description="LoRA settings, only with `train: lora`: `rank` (16), `alpha` (= rank), `target_modules` "
        "([q_proj, k_proj, v_proj, o_proj]: a Llama's attention projections), `dropout` (0.0); omitted: those defaults.",
    )

    @field_validator("added_tokens")
    @classmethod
    def _added_tokens_are_distinct_text(cls, value):
        if value is not None and (any(not t.strip() for t in value) or len(set(value)) != len(value)):
            raise ValueError(f"added_tokens {value}: each must be non-blank text, and listed once")
        return value

    gradient_checkpointing: bool = Field(
        False, description="Recompute LM activations in backward (torch non-reentrant checkpointing)."
    )
    max_sample_seconds: float = Field(
        2.0, gt=0, description="Samples during training: the longest audio generated per prompt, in seconds."
    )
    sample_temperature: float = Field(
        0.8, ge=0, description="Samples: softmax temperature of the audio tokens (0: greedy)."
    )

    def folder_defaults(self, read: Callable[[str], Optional[dict]]) -> dict:
        """The keys this section leaves unset that the pretrained folder decides (`read(name)`: one of its JSON
        files, None when absent): the codec its dstune_tts.json names, so that validate and start-up agree."""
        if self.codec is not None:
            return {}
        return {"codec": default_codec(read(TTS_LAYOUT_FILE), self.token_layout)}

    @model_validator(mode="after")
    def _layout_fits_codec(self) -> "TtsLmModelSpec":
        if self.token_layout == "orpheus" and self.codec != "snac":
            raise ValueError(f"token_layout orpheus writes SNAC codes: set codec: snac (it is {self.codec!r})")
        if self.token_layout == "dstune" and self.codec == "snac":
            raise ValueError(
                "token_layout dstune writes one code per codebook per frame, and SNAC's codebooks run at "
                "different rates: use token_layout: orpheus with codec: snac"
            )
        if self.token_layout == "orpheus" and self.num_codebooks not in (None, 7):
            raise ValueError(f"num_codebooks {self.num_codebooks}: the orpheus layout writes 7 codes per frame")
        if self.lora is not None and self.train != "lora":
            raise ValueError("lora settings are given but `train` is 'full': set `train: lora`, or remove `lora`")
        if self.train == "lora" and self.added_tokens:
            raise ValueError(
                "added_tokens with train: lora: the new tokens' embedding rows would not be trained (only "
                "adapters are), so the new language could not be learned. Use train: full for a "
                "vocabulary extension, then LoRA from its export."
            )
        return self
