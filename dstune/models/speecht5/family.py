"""The `speecht5` family: SpeechT5ForTextToSpeech (text -> log-mel frames; transformers' own L1 + stop-token +
guided-attention loss), a frozen SpeechT5HifiGan vocoder for samples.

    build(model: SpeechT5ModelSpec, folders, device, dtype_for_frozen) -> SpeechT5Built
    encode_batch(built, batch, dtype) -> {"input_ids", "attention_mask", "labels", "speaker_embeddings", "indices"}
    loss(built, trainable_forward, encoded, seed, step) -> scalar tensor
    sample(built, module, prompts, sample_spec, resolution) -> list[Clip]   (every rank calls it: ZeRO-3)
    save_samples(clips, prompts, path) (dstune.families.speech.save_wavs) / export(built, state_dict, out_dir)

Its pitfalls, handled here (FIELD_NOTES / recipes section 2.7):
  - labels are the feature extractor's log-mels, padded with -100 (the loss ignores exactly -100) up to a multiple
    of config.reduction_factor, and attention_mask is always passed (the guided-attention loss needs it);
  - layerdrop is forced to 0: a tiny model could drop its only decoder layer, and under ZeRO-3 ranks skipping
    different layers would wait for each other's parameter gathers forever;
  - 0-dim parameters (encode_positions.alpha) crash DeepSpeed's broadcast: dstune.engine.promote_scalar_params makes
    them shape (1,) before initialize and dstune.export.consolidated_state_dict squeezes them back;
  - with bf16, the model's floating buffers are cast to bf16 too (DeepSpeed casts parameters only);
  - the speech-decoder prenet applies dropout even in eval (Tacotron-style), from the global RNG: sampling forks the
    RNG and seeds it identically on every rank, so all ranks generate the same length (ZeRO-3 gathers agree); the
    loss forks it too and seeds it from (seed, step, first sample), so a resumed run draws what the first run drew.
"""

from __future__ import annotations

from dataclasses import dataclass
import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from dstune.families.base import Family, FamilyError, Speaker
from dstune.families.precision import at_least_float32
from dstune.families.randomness import sample_seed
from dstune.families.speech import Clip, save_wavs
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import SampleSpec
from dstune.models.speecht5.spec import SpeechT5ModelSpec

__all__ = ["SpeechT5Built", "FAMILY", "build", "encode_batch", "loss", "sample", "export", "synthesize"]

SPEAKERS_FILE = "speaker_embeddings.safetensors"


@dataclass
class SpeechT5Built:
    folder: Path
    device: torch.device
    trainable: torch.nn.Module  # SpeechT5ForTextToSpeech
    vocoder: torch.nn.Module  # frozen
    processor: object  # SpeechT5Processor (tokenizer + feature extractor)
    speakers: dict[str, torch.Tensor]  # name -> (D,) float32; "default" for clips without a speaker
    max_sample_seconds: float = 3.0

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"vocoder": self.vocoder}

    @property
    def sample_rate(self) -> int:
        return int(self.processor.feature_extractor.sampling_rate)


def _load(loader: Callable, source, what: str, **kwargs):
    try:
        with quiet_hf_libraries():
            return loader(source, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, ImportError) as err:
        raise FamilyError(
            f"{source}: cannot load it as {what} ({(str(err).strip().splitlines() or [type(err).__name__])[0]})"
        ) from None


def _speakers(model: SpeechT5ModelSpec, folder: Path, dim: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(model.speaker_embeddings).expanduser() if model.speaker_embeddings else folder / SPEAKERS_FILE
    speakers = {}
    if path.is_file():
        speakers = {name: t.float().reshape(-1) for name, t in load_file(str(path)).items()}
    elif model.speaker_embeddings:
        raise FamilyError(f"model.speaker_embeddings {path} does not exist")
    wrong = [f"{name} {tuple(t.shape)}" for name, t in speakers.items() if t.numel() != dim]
    if wrong:
        raise FamilyError(f"{path}: speaker vectors must have {dim} values (speaker_embedding_dim): {', '.join(wrong)}")
    if "default" not in speakers:  # a fixed unit vector, the same in every run (x-vectors are unit length too)
        vector = torch.randn(dim, generator=torch.Generator().manual_seed(0))
        speakers["default"] = vector / vector.norm()
    return speakers


def build(
    model: SpeechT5ModelSpec, folders: dict, device, dtype_for_frozen: torch.dtype = torch.float32
) -> SpeechT5Built:
    from transformers import SpeechT5ForTextToSpeech, SpeechT5HifiGan, SpeechT5Processor

    folder = folders["pretrained"]
    processor = _load(SpeechT5Processor.from_pretrained, folder, "SpeechT5Processor (needs sentencepiece)")
    tts = _load(
        SpeechT5ForTextToSpeech.from_pretrained,
        folder,
        "SpeechT5ForTextToSpeech",
        torch_dtype=torch.float32,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
    )
    vocoder_source = folders["vocoder"] if folders.get("vocoder") is not None else folder / "vocoder"
    vocoder = _load(SpeechT5HifiGan.from_pretrained, vocoder_source, "SpeechT5HifiGan (model.vocoder)")
    if dtype_for_frozen == torch.bfloat16:
        # DeepSpeed's bf16 casts parameters only; SpeechT5's fp32 positional-encoding buffers would then make the
        # activations fp32 and LayerNorm fails on mixed dtypes (FIELD_NOTES: data_types.buffer_dtype).
        for module in tts.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = buffer.to(torch.bfloat16)
    device = torch.device(device)
    return SpeechT5Built(
        folder=folder,
        device=device,
        trainable=tts.train().requires_grad_(True),
        vocoder=vocoder.to(device).eval().requires_grad_(False),
        processor=processor,
        speakers=_speakers(model, folder, tts.config.speaker_embedding_dim),
        max_sample_seconds=model.max_sample_seconds,
    )


def _speaker_rows(built: SpeechT5Built, speakers: list[str]) -> torch.Tensor:
    unknown = sorted({s for s in speakers if s and s not in built.speakers})
    if unknown:
        raise FamilyError(
            f"speakers {unknown[:5]} have no vector in the speaker embeddings (known: "
            f"{sorted(built.speakers)[:10]}); add them to model.speaker_embeddings"
        )
    return torch.stack([built.speakers[s or "default"] for s in speakers])


def encode_batch(built: SpeechT5Built, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
    """Token ids and log-mel labels (-100 padding, length a multiple of the reduction factor)."""
    waves = [w.numpy() for w in batch["audio"]]
    features = built.processor(
        text=list(batch["texts"]),
        audio_target=waves,
        sampling_rate=built.sample_rate,
        padding=True,
        return_tensors="pt",
    )
    labels = features["labels"].masked_fill(features["decoder_attention_mask"].unsqueeze(-1).ne(1), -100.0)
    factor = built.trainable.config.reduction_factor
    if labels.shape[1] % factor:
        labels = F.pad(labels, (0, 0, 0, factor - labels.shape[1] % factor), value=-100.0)
    device = built.device
    return {
        "input_ids": features["input_ids"].to(device),
        "attention_mask": features["attention_mask"].to(device),
        "labels": labels.to(device, dtype),
        "speaker_embeddings": _speaker_rows(built, list(batch["speakers"])).to(device, dtype),
        "indices": torch.as_tensor(batch["index"], dtype=torch.long),
    }


def loss(built: SpeechT5Built, trainable_forward: Callable, encoded: dict, seed: int, step: int) -> torch.Tensor:
    """transformers' own loss. Its dropout (the prenet's and the layers') draws from the global RNG, so the draws are
    seeded from (train.seed, step, the micro-batch's first sample) in a forked RNG: a resumed run makes the same
    draws as the uninterrupted one, and the rest of the process's random state is left as it was."""
    devices = [built.device] if built.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(sample_seed(seed, step, int(encoded["indices"][0]), "dropout"))
        out = trainable_forward(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            labels=encoded["labels"],
            speaker_embeddings=encoded["speaker_embeddings"],
        )
    return at_least_float32(out.loss)


def sample(
    built: SpeechT5Built, module: torch.nn.Module, prompts: list[str], sample_spec: SampleSpec, resolution=None
) -> list[Clip]:
    hop_seconds = built.processor.feature_extractor.hop_length / 1000.0
    was_training = module.training
    module.eval()
    clips = []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_spec.seed)  # the prenet's always-on dropout: the same draws on every rank
            dtype = next(module.parameters()).dtype
            for prompt in prompts:
                ids = built.processor(text=prompt, return_tensors="pt")["input_ids"].to(built.device)
                max_frames = built.max_sample_seconds / hop_seconds
                mel = module.generate_speech(
                    ids,
                    speaker_embeddings=built.speakers["default"][None].to(built.device, dtype),
                    maxlenratio=max(1.0, max_frames / ids.shape[1]),
                    minlenratio=0.0,
                )
                wave = built.vocoder(mel.float().to(built.device)).reshape(-1)
                clips.append(Clip(wave.float().cpu().numpy(), built.sample_rate))
    finally:
        module.train(was_training)
    return clips


def export(built: SpeechT5Built, state_dict: dict, out_dir, pretrained_folder: Optional[Path] = None) -> Path:
    """SpeechT5ForTextToSpeech folder + processor + vocoder/ + the speaker vectors used in training."""
    from safetensors.torch import save_file
    from transformers import SpeechT5ForTextToSpeech

    out_dir = Path(out_dir)
    with folder_written_atomically(out_dir, "export") as work:
        with quiet_hf_libraries():
            model = SpeechT5ForTextToSpeech(built.trainable.config)
            model.load_state_dict(state_dict, strict=True)
            model.save_pretrained(work, safe_serialization=True)
            built.processor.save_pretrained(work)
            built.vocoder.save_pretrained(work / "vocoder")
        save_file({k: v.contiguous() for k, v in built.speakers.items()}, str(work / SPEAKERS_FILE))
    return out_dir


def synthesize(folder, text: str, seconds: float = 3.0, temperature: float = 0.0, seed: int = 0) -> Clip:
    """Speech for `text` from an exported folder with transformers only (greedy: `temperature` is unused)."""
    from safetensors.torch import load_file
    from transformers import SpeechT5ForTextToSpeech, SpeechT5HifiGan, SpeechT5Processor

    folder = Path(folder)
    with quiet_hf_libraries():
        processor = SpeechT5Processor.from_pretrained(folder)
        model = SpeechT5ForTextToSpeech.from_pretrained(folder).eval()
        vocoder = SpeechT5HifiGan.from_pretrained(folder / "vocoder").eval()
    speaker = load_file(str(folder / SPEAKERS_FILE))["default"][None]
    ids = processor(text=text, return_tensors="pt")["input_ids"]
    frames = seconds / (processor.feature_extractor.hop_length / 1000.0)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wave = model.generate_speech(
            ids,
            speaker_embeddings=speaker,
            vocoder=vocoder,
            maxlenratio=max(1.0, frames / ids.shape[1]),
            minlenratio=0.0,
        )
    return Clip(
        np.asarray(wave.reshape(-1).float().numpy(), dtype=np.float32), processor.feature_extractor.sampling_rate
    )


def is_speecht5_export(folder) -> bool:
    """Whether `folder` holds a SpeechT5 text-to-speech model (its config.json's architecture)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "SpeechT5ForTextToSpeech" in (config.get("architectures") or [])


FAMILY = Family(
    name="speecht5",
    modality="audio",
    pretrained_fields=("pretrained", "vocoder"),
    build=build,
    encode_batch=encode_batch,
    loss=loss,
    sample=sample,
    save_samples=save_wavs,
    export=export,
    speaker=Speaker(is_speecht5_export, synthesize),
)
