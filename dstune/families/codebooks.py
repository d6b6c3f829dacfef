"""The multi-codebook TTS core (`model.family tts_codebooks`): `CodebooksModel`, the base class of every model
trained through its own transformers class and loss (each unit's models/<unit>/model.py), and what they share. Which class a folder holds is its config.json's `architectures` (the card: dstune.families.codebooks_card).

    load(card, model_spec, folders, ...)     the class and its processor; the codec taken out of the trained part
                                             (frozen, fp32, whole on every rank, outside DeepSpeed), so codes are
                                             cacheable (data.cache.codec_tokens) and the same for any batch or rank
    encode_batch(batch, dtype)               the class's inputs and labels
    loss(forward, encoded, seed, step)       the class's own loss from the labels
    sample(module, prompts, sample_spec)     the class's own generate, one clip per prompt
    export(state_dict, out_dir)              a folder the class's from_pretrained and its processor load

The trained module of every model holds the class under `model.`, so the export and the LoRA files here load the
class by its name and put the trained weights in. A model's class says what differs: how it takes its codec out
(`take_codec`), wraps the class (`trained_module`), builds one batch, generates and speaks from an exported folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dstune.families.base import FamilyError
from dstune.families.codebooks_card import CodebooksCard, card_of_folder
from dstune.families.precision import at_least_float32_dtype
from dstune.families.speakers import write_voices
from dstune.families.speech import CodecTokensModel, checkpoint_activations
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries
from dstune.resampling import resample

ADAPTER_FOLDER = "adapter"  # the peft adapter folder inside a LoRA export


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class CodebooksModel(CodecTokensModel):
    """A multi-codebook TTS class loaded for training (see the module docstring): `trainable` holds the class under
    `model.`, `processor` is its processor."""

    card: CodebooksCard

    def __init__(self, card: CodebooksCard, model_spec, folder: Path, device, processor):
        super().__init__(card, model_spec, folder, device)
        self.processor = processor

    # ------------------------------------------------------------------------------------------------ loading

    @classmethod
    def load(cls, card, model_spec, folders: dict, device, frozen_dtype=torch.float32, zero3_config=None, **_):
        """The class (fp32 in host memory, train mode: the start-up casts and moves it) and its processor; the
        codec in `frozen_dtype`, never below fp32 (its codes must not depend on the training precision)."""
        folder = folders["pretrained"]
        problem = card.config_problem(json.loads((folder / "config.json").read_text()))
        if problem:  # transformers would load it as another model (a default-sized one, none of its weights)
            raise FamilyError(f"{folder}: {problem}")
        whole, processor = cls.load_class(card, folder)
        model = cls(card, model_spec, folder, device, processor)
        model.codec = model.take_codec(whole, at_least_float32_dtype(frozen_dtype)).to(model.device)
        if model_spec.gradient_checkpointing:
            checkpoint_activations(whole)
        model.trainable = model.trained_module(whole)
        return model

    @classmethod
    def load_class(cls, card: CodebooksCard, folder: Path):
        """(the class fp32, its processor) from `folder`; FamilyError naming the folder when either fails."""
        import transformers
        from transformers import AutoProcessor

        try:
            with quiet_hf_libraries():
                whole = getattr(transformers, card.architecture).from_pretrained(folder, torch_dtype=torch.float32)
                processor = AutoProcessor.from_pretrained(folder)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError, ImportError) as err:
            raise FamilyError(
                f"{folder}: cannot load it as {card.architecture} with its processor ({first_line(err)})"
            ) from None
        return whole, processor

    def take_codec(self, whole, dtype: torch.dtype) -> torch.nn.Module:
        """The frozen codec (eval, no grad, in `dtype`), out of the trained part; sets codec_folder, codec_kind and
        the layout."""
        raise NotImplementedError

    def trained_module(self, whole) -> torch.nn.Module:
        """The module DeepSpeed wraps, holding the class under `model.`, in train mode."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ samples

    def generating_module(self, trainable_module):
        return getattr(trainable_module, "model", trainable_module)  # the class itself: its own generate

    def voice_prompts(self, sample_spec) -> list:
        return [self.voice_prompt(path) for path in getattr(sample_spec, "voice_prompts", None) or []]

    def voice_prompt(self, path):
        """A reference clip of sample.voice_prompts (and its transcript, for a class that reads one), as `speak`
        takes it."""
        return read_voice(path, self.sample_rate)

    @classmethod
    def speaks_from(cls, card: CodebooksCard, folder: Path) -> bool:
        try:
            return card_of_folder((card,), folder) is card
        except FamilyError:
            return False

    # ------------------------------------------------------------------------------------------------- export

    def whole_model(self, state_dict: dict):
        """The class loaded from the pretrained folder (its codec included) with the trained weights put in; what the
        trained module held frozen (the card's frozen_parts, a codec inside the class) stays the folder's."""
        import transformers

        with quiet_hf_libraries():
            whole = getattr(transformers, self.card.architecture).from_pretrained(
                self.folder, torch_dtype=torch.float32
            )
        trained = {k[len("model.") :]: v for k, v in state_dict.items() if k.startswith("model.")}
        missing, unexpected = whole.load_state_dict(trained, strict=False)
        kept = self.card.frozen_parts() + ((self.card.codec_inside(),) if self.card.codec_inside() else ())
        missing = [k for k in missing if not any(k == part or k.startswith(part + ".") for part in kept)]
        if missing or unexpected or len(trained) != len(state_dict):
            raise ValueError(
                f"trained weights do not fit {self.card.architecture}: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        return whole

    def write_folder(self, whole, work: Path) -> None:
        with quiet_hf_libraries():
            whole.save_pretrained(work, safe_serialization=True)
            self.processor.save_pretrained(work)
        write_voices(self.voices, work)

    def export(self, state_dict: dict, out_dir, pretrained_folder: Optional[Path] = None) -> Path:
        """A folder the class's from_pretrained and AutoProcessor load (a codec inside the class, as it keeps it)."""
        out_dir = Path(out_dir)
        with folder_written_atomically(out_dir, "export") as work:
            self.write_folder(self.whole_model(state_dict), work)
        return out_dir

    def save_lora_weights(self, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
        """A LoRA export: the peft adapter folder (`adapter/`, onto the pretrained folder's class) and the merged
        model as a full folder with its processor."""
        import transformers
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        folder = Path(folder)
        fields = {
            k: v for k, v in adapter_metadata.items() if k in LoraConfig.__dataclass_fields__ and k != "peft_type"
        }
        codec = self.card.codec_inside()  # a codec inside the class was never adapted
        excluded = {"exclude_modules": rf"{codec}\..*"} if codec else {}
        with quiet_hf_libraries():
            base = getattr(transformers, self.card.architecture).from_pretrained(self.folder, torch_dtype=torch.float32)
            peft_model = get_peft_model(base, LoraConfig(**{**fields, "init_lora_weights": False, **excluded}))
            renamed = {f"base_model.model.{k[len('model.') :]}": v for k, v in lora_layers.items()}
            result = set_peft_model_state_dict(peft_model, renamed)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"LoRA weights do not fit the model: unexpected {sorted(result.unexpected_keys)[:5]}")
            peft_model.peft_config["default"].base_model_name_or_path = str(self.folder)
            peft_model.save_pretrained(folder / ADAPTER_FOLDER, safe_serialization=True)
            merged = peft_model.merge_and_unload()
        self.write_folder(merged, folder)


def read_voice(path, sample_rate: int) -> np.ndarray:
    """A reference clip, mono at `sample_rate`; FamilyError naming it when it cannot be read."""
    import soundfile

    try:
        wave, rate = soundfile.read(str(Path(path).expanduser()), dtype="float32", always_2d=True)
    except (OSError, RuntimeError) as err:
        raise FamilyError(f"sample.voice_prompts: {path} cannot be read ({first_line(err)})") from None
    return resample(wave.mean(axis=1), rate, sample_rate)


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of token rows right-padded with `pad_id` to the longest."""
    ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), 1
    return ids, mask
