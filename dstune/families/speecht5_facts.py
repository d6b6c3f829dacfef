"""The torch-free facts of the speecht5 family (SpeechT5 text-to-speech with its HiFi-GAN vocoder): parameters and
one clip's activations; dstune.families.facts describes the contract."""

from __future__ import annotations

from dstune.memory.activations import speecht5_sample_bytes
from dstune.families.facts import ModelFacts
from dstune.memory.plan import ModelCounts
from dstune.memory.counts import config_folder, count_component, read_config

DEFAULT_CLIP_SECONDS = 10.0  # the clip length the plan assumes without data.max_clip_seconds


def _count(spec, num_samples: int, clips=()) -> ModelCounts:
    folder, origin = config_folder(spec.model.pretrained)
    params, largest, _ = count_component(str(folder / "config.json"))
    companions = {}
    vocoder = spec.model.vocoder or (str(folder / "vocoder") if (folder / "vocoder" / "config.json").exists() else None)
    if vocoder:
        companions["vocoder"] = count_component(str(config_folder(vocoder)[0] / "config.json"))[0]
    full, checkpointed = speecht5_sample_bytes(read_config(folder / "config.json"),
                                               spec.data.max_clip_seconds or DEFAULT_CLIP_SECONDS)
    return ModelCounts("speecht5", params, params, largest, companions, (), int(full), int(checkpointed), 0, 0, origin)


FACTS = ModelFacts(family="speecht5", modality="audio", count=_count)
