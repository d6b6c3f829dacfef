"""The card of a multi-codebook TTS model (`model.family tts_codebooks`, CodebooksCard): one transformers class that
predicts several codec codebooks per audio frame, trained through its own loss (the core: dstune.families.codebooks),
told apart by the folder's config.json `architectures`. What validate and the memory plan know of it without torch:
the parameters DeepSpeed trains (the class without its codec, counted here on the meta device for every model), and
what each model counts itself (its codec, one clip's activations, the codec cache: `count_model`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

from dstune.card import ModelCard
from dstune.families.base import FamilyError
from dstune.families.denoiser_facts import lora_settings
from dstune.families.pipeline_card import SpecIssues
from dstune.hf import quiet_hf_libraries
from dstune.memory.counts import SizesUnknown, config_folder, module_small_tensors, read_config
from dstune.memory.plan import ModelCounts
from dstune.spec.section import LM_LORA_TARGET_MODULES


@dataclass(frozen=True, kw_only=True)
class CodebooksCard(ModelCard):
    """A multi-codebook TTS model's card (see the module docstring)."""

    architecture: str  # the transformers class its folder's config.json names
    takes_voice_prompts: bool = False  # its samples continue sample.voice_prompts (a reference clip + transcript)

    def codec_inside(self) -> Optional[str]:
        """The attribute of the class that holds its codec (None: the codec is outside the class)."""
        return None

    def config_problem(self, config: dict) -> Optional[str]:
        """Why the class cannot train a folder of this config.json (None: it can); validate says it at
        model.pretrained."""
        return None

    def frozen_parts(self) -> tuple[str, ...]:
        """Parts of the class (dotted names) its trained module holds frozen: a full export takes them from the
        pretrained folder, since the trained weights DeepSpeed consolidates leave them out."""
        return ()

    def count_model(self, spec, num_samples: int, folder: Path, origin: str, config: dict, counted: tuple):
        """ModelCounts of a run: `counted` is (parameters, largest layer, LoRA parameters, default-target LoRA
        parameters, the parameters of a codec inside the class) of the class without its codec; the model adds its
        codec, one clip's activations and the codec cache."""
        raise NotImplementedError(f"{self.name}'s card counts nothing")

    def count(self, spec, num_samples: int, clips: Sequence = ()) -> ModelCounts:
        folder, origin = config_folder(spec.model.pretrained)
        config = read_config(folder / "config.json")
        targets, rank = lora_settings(spec)
        params, largest, lora, codec, small = _meta_counts(_config_text(config), self.codec_inside(), targets, rank)
        default_lora = _meta_counts(_config_text(config), self.codec_inside(), LM_LORA_TARGET_MODULES, 16)[2]
        counted = (params, largest, lora, default_lora, codec)
        counts = self.count_model(spec, num_samples, folder, origin, config, counted)
        return counts if counts.small_tensors else replace(counts, small_tensors=small)

    def spec_issues(self, spec) -> SpecIssues:
        """A folder the class cannot train, and sample.voice_prompts only for a model that continues a voice, each
        clip there with its transcript beside it."""
        try:
            config = read_config(config_folder(spec.model.pretrained)[0] / "config.json")
        except SizesUnknown:
            return []
        problem = self.config_problem(config)
        if problem:
            return [("model.pretrained", f"{spec.model.pretrained}: {problem}")]
        return self._voice_prompt_issues(spec.sample.voice_prompts)

    def _voice_prompt_issues(self, paths: list[str]) -> SpecIssues:
        if not paths:
            return []
        if not self.takes_voice_prompts:
            return [
                (
                    "sample.voice_prompts",
                    f"{self.architecture} is not given a reference voice here: remove sample.voice_prompts (docs/tts.md "
                    "lists the models that take one)",
                )
            ]
        issues = []
        for number, path in enumerate(paths):
            clip = Path(path).expanduser()
            if not clip.is_file():
                issues.append((f"sample.voice_prompts.{number}", f"{path}: no such file"))
            elif not clip.with_suffix(".txt").is_file():
                issues.append(
                    (
                        f"sample.voice_prompts.{number}",
                        f"{path}: its transcript {clip.with_suffix('.txt')} is missing (the text the clip says, with "
                        "its speaker tags)",
                    )
                )
        return issues


@lru_cache(maxsize=16)
def _meta_counts(config_text: str, codec_inside: Optional[str], targets: tuple, rank: int) -> tuple:
    """(trained parameters, largest trained layer, LoRA parameters, codec parameters, small tensors) of the class on
    the meta device; a codec inside the class is not trained and gets no adapters. The small tensors (with the adapters') are what
    ZeRO-3 keeps whole on every rank (dstune.memory.counts.count_small_tensors)."""
    import torch
    import transformers

    config = json.loads(config_text)
    with quiet_hf_libraries(), torch.device("meta"):
        model = getattr(transformers, config["architectures"][0])(transformers.AutoConfig.for_model(**config))
    codec = 0
    if codec_inside:
        codec = sum(p.numel() for p in getattr(model, codec_inside).parameters())
        setattr(model, codec_inside, None)
    params = sum(dict((id(p), p.numel()) for p in model.parameters()).values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    lora = sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    )
    return params, largest, lora, codec, module_small_tensors(model, targets, rank)


def _config_text(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


# ----------------------------------------------------------------------------------------- which model


def _by_architecture(cards: Sequence[CodebooksCard], config: dict) -> Optional[CodebooksCard]:
    names = config.get("architectures") or []
    return next((card for name in names for card in cards if card.architecture == name), None)


def _trained_text(cards: Sequence[CodebooksCard]) -> str:
    return ", ".join(card.architecture for card in cards)


def card_of_folder(cards: Sequence[CodebooksCard], folder: Path) -> CodebooksCard:
    """The card of the class a transformers folder's config.json names; FamilyError naming the trained ones."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FamilyError(f"{path}: cannot read it ({err}); a tts_codebooks model is a transformers folder") from None
    card = _by_architecture(cards, config)
    if card is None:
        raise FamilyError(
            f"{folder}: its config.json names {config.get('architectures')}, none of the classes model.family "
            f"tts_codebooks trains ({_trained_text(cards)})"
        )
    return card


def card_of_reference(cards: Sequence[CodebooksCard], pretrained: str) -> Optional[CodebooksCard]:
    """The card of the class `pretrained`'s config.json names (None: none of the family's); SizesUnknown when its
    config is not here."""
    return _by_architecture(cards, read_config(config_folder(pretrained)[0] / "config.json"))


def unknown_model(cards: Sequence[CodebooksCard], spec, raising: bool) -> SpecIssues:
    """A folder whose config.json names no class of the family is named before any download or launch; one whose
    config is not here is left to start-up. The plan counts neither: SizesUnknown with the reason."""
    try:
        config = read_config(config_folder(spec.model.pretrained)[0] / "config.json")
    except SizesUnknown:
        if raising:
            raise
        return []
    why = f"its config.json names {config.get('architectures')}, not one of {_trained_text(cards)}"
    if raising:
        raise SizesUnknown(why)
    return [
        (
            "model.pretrained",
            f"{spec.model.pretrained}: {why}. model.family tts_codebooks trains {_trained_text(cards)} folders.",
        )
    ]


def processor_codec_config(folder, subfolder: str, config_origin: str, what: str) -> Path:
    """The config.json of the codec a speech folder's processor loads: `subfolder` (dstune's stored and built-in
    folders keep it there), else what processor_config.json names (a folder, or a hub id found by config_folder).
    SizesUnknown naming `what` (the codec, as the message calls it) when neither is there."""
    own = folder / subfolder / "config.json"
    if own.is_file():
        return own
    processor = folder / "processor_config.json"
    named = (
        (read_config(processor).get("audio_tokenizer") or {}).get("audio_tokenizer_name_or_path")
        if processor.is_file()
        else None
    )
    if not named:
        raise SizesUnknown(
            f"{config_origin}: no {subfolder}/config.json and no audio tokenizer named in "
            f"processor_config.json, so {what} cannot be counted"
        )
    return config_folder(named)[0] / "config.json"
