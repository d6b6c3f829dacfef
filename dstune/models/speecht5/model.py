"""SpeechT5's class (`model.family speecht5`): SpeechT5ForTextToSpeech (text -> log-mel frames; transformers' own
L1 + stop-token + guided-attention loss), a frozen SpeechT5HifiGan vocoder for samples.

Its pitfalls, handled here:
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

import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from dstune.families.base import FamilyError
from dstune.families.precision import at_least_float32
from dstune.families.randomness import sample_seed
from dstune.families.speakers import write_voices
from dstune.families.speech import Clip, SpeechModel
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries
from dstune.models.speecht5.card import DEFAULT_VECTOR, SPEECHT5_CARD, SpeechT5Card
from dstune.models.speecht5.spec import SpeechT5ModelSpec

VOCODER = SpeechT5ModelSpec.COMPANION_FOLDERS["vocoder"]  # the vocoder's subfolder in a model folder and an export


def load_part(loader: Callable, source, what: str, **kwargs):
    try:
        with quiet_hf_libraries():
            return loader(source, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, ImportError) as err:
        raise FamilyError(
            f"{source}: cannot load it as {what} ({(str(err).strip().splitlines() or [type(err).__name__])[0]})"
        ) from None


class SpeechT5(SpeechModel):
    """`trainable` is the SpeechT5ForTextToSpeech; `vocoder` frozen beside it; `speakers` name -> (D,) float32
    vector ("default" for clips without a speaker)."""

    card: SpeechT5Card
    supports_lora = False  # model.train: lora is refused for it

    @classmethod
    def load(cls, card, model_spec, folders: dict, device, frozen_dtype=torch.float32, zero3_config=None, **_):
        from transformers import SpeechT5ForTextToSpeech, SpeechT5HifiGan, SpeechT5Processor

        folder = folders["pretrained"]
        model = cls(card, model_spec, folder, device)
        model.processor = load_part(
            SpeechT5Processor.from_pretrained, folder, "SpeechT5Processor (needs sentencepiece)"
        )
        tts = load_part(
            SpeechT5ForTextToSpeech.from_pretrained,
            folder,
            SpeechT5ForTextToSpeech.__name__,
            torch_dtype=torch.float32,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
        )
        vocoder = folders["vocoder"] if folders.get("vocoder") is not None else folder / VOCODER
        model.vocoder = load_part(SpeechT5HifiGan.from_pretrained, vocoder, "SpeechT5HifiGan (model.vocoder)")
        if frozen_dtype == torch.bfloat16:
            # DeepSpeed's bf16 casts parameters only; SpeechT5's fp32 positional-encoding buffers would then make
            # the activations fp32 and LayerNorm fails on mixed dtypes
            for module in tts.modules():
                for name, buffer in list(module._buffers.items()):
                    if buffer is not None and buffer.is_floating_point():
                        module._buffers[name] = buffer.to(torch.bfloat16)
        model.trainable = tts.train().requires_grad_(True)
        model.vocoder = model.vocoder.to(model.device).eval().requires_grad_(False)
        model.speakers = model.speaker_vectors(tts.config.speaker_embedding_dim)
        return model

    def speaker_vectors(self, dim: int) -> dict[str, torch.Tensor]:
        """model.speaker_embeddings, else the folder's speakers file, plus a fixed "default" where neither has one."""
        from safetensors.torch import load_file

        given = self.model_spec.speaker_embeddings
        path = Path(given).expanduser() if given else self.folder / self.card.speakers_file
        speakers = {}
        if path.is_file():
            speakers = {name: t.float().reshape(-1) for name, t in load_file(str(path)).items()}
        elif given:
            raise FamilyError(f"model.speaker_embeddings {path} does not exist")
        wrong = [f"{name} {tuple(t.shape)}" for name, t in speakers.items() if t.numel() != dim]
        if wrong:
            raise FamilyError(
                f"{path}: speaker vectors must have {dim} values (speaker_embedding_dim): {', '.join(wrong)}"
            )
        if DEFAULT_VECTOR not in speakers:  # a fixed unit vector, the same in every run (x-vectors are unit length too)
            vector = torch.randn(dim, generator=torch.Generator().manual_seed(0))
            speakers[DEFAULT_VECTOR] = vector / vector.norm()
        return speakers

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"vocoder": self.vocoder}

    @property
    def sample_rate(self) -> int:
        return int(self.processor.feature_extractor.sampling_rate)

    # ------------------------------------------------------------------------------------------ the train step

    def speaker_rows(self, batch: dict) -> torch.Tensor:
        """Each clip's speaker vector (validate has checked that every speaker of the data has one)."""
        names = [voice or DEFAULT_VECTOR for voice in self.clip_voices(batch)]
        unknown = sorted({name for name in names if name not in self.speakers})
        if unknown:
            raise FamilyError(
                f"speakers {unknown[:5]} have no vector in the speaker embeddings (known: "
                f"{sorted(self.speakers)[:10]}); add them to model.speaker_embeddings"
            )
        return torch.stack([self.speakers[name] for name in names])

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """Token ids and log-mel labels (-100 padding, length a multiple of the reduction factor)."""
        features = self.processor(
            text=list(batch["texts"]),
            audio_target=[w.numpy() for w in batch["audio"]],
            sampling_rate=self.sample_rate,
            padding=True,
            return_tensors="pt",
        )
        labels = features["labels"].masked_fill(features["decoder_attention_mask"].unsqueeze(-1).ne(1), -100.0)
        factor = self.trainable.config.reduction_factor
        if labels.shape[1] % factor:
            labels = F.pad(labels, (0, 0, 0, factor - labels.shape[1] % factor), value=-100.0)
        device = self.device
        return {
            "input_ids": features["input_ids"].to(device),
            "attention_mask": features["attention_mask"].to(device),
            "labels": labels.to(device, dtype),
            "speaker_embeddings": self.speaker_rows(batch).to(device, dtype),
            "indices": torch.as_tensor(batch["index"], dtype=torch.long),
        }

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """transformers' own loss. Its dropout (the prenet's and the layers') draws from the global RNG, so the draws
        are seeded from (train.seed, step, the micro-batch's first sample) in a forked RNG: a resumed run makes the
        same draws as the uninterrupted one, and the rest of the process's random state is left as it was."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(sample_seed(seed, step, int(encoded["indices"][0]), "dropout"))
            out = forward(
                input_ids=encoded["input_ids"],
                attention_mask=encoded["attention_mask"],
                labels=encoded["labels"],
                speaker_embeddings=encoded["speaker_embeddings"],
            )
        return at_least_float32(out.loss)

    # ------------------------------------------------------------------------------------------------ samples

    def sample(self, trainable_module, prompts: list[str], sample_spec, resolution=None) -> list[Clip]:
        """One clip per prompt in the default voice; the prenet's always-on dropout draws from one seed for all the
        prompts, the same on every rank."""
        hop_seconds = self.processor.feature_extractor.hop_length / 1000.0
        module = trainable_module
        was_training = module.training
        module.eval()
        clips = []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(sample_spec.seed)
                dtype = next(module.parameters()).dtype
                for prompt in prompts:
                    ids = self.processor(text=prompt, return_tensors="pt")["input_ids"].to(self.device)
                    max_frames = self.max_sample_seconds / hop_seconds
                    mel = module.generate_speech(
                        ids,
                        speaker_embeddings=self.speakers[DEFAULT_VECTOR][None].to(self.device, dtype),
                        maxlenratio=max(1.0, max_frames / ids.shape[1]),
                        minlenratio=0.0,
                    )
                    wave = self.vocoder(mel.float().to(self.device)).reshape(-1)
                    clips.append(Clip(wave.float().cpu().numpy(), self.sample_rate))
        finally:
            module.train(was_training)
        return clips

    # ------------------------------------------------------------------------------------------------- export

    def export(self, state_dict: dict, out_dir, pretrained_folder: Optional[Path] = None) -> Path:
        """SpeechT5ForTextToSpeech folder + processor + the vocoder + the speaker vectors used in training."""
        from safetensors.torch import save_file
        from transformers import SpeechT5ForTextToSpeech

        out_dir = Path(out_dir)
        with folder_written_atomically(out_dir, "export") as work:
            with quiet_hf_libraries():
                model = SpeechT5ForTextToSpeech(self.trainable.config)
                model.load_state_dict(state_dict, strict=True)
                model.save_pretrained(work, safe_serialization=True)
                self.processor.save_pretrained(work)
                self.vocoder.save_pretrained(work / VOCODER)
            save_file({k: v.contiguous() for k, v in self.speakers.items()}, str(work / self.card.speakers_file))
            write_voices(self.voices, work)
        return out_dir

    @classmethod
    def speaks_from(cls, card, folder: Path) -> bool:
        """Whether `folder` holds a SpeechT5 text-to-speech model (its config.json's architecture)."""
        try:
            config = json.loads((Path(folder) / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return any(name in card.folder_classes for name in config.get("architectures") or [])

    @classmethod
    def synthesize(
        cls, folder, text: str, seconds: float, temperature: float, seed: int, speaker: Optional[str] = None
    ) -> Clip:
        """Speech for `text` from an exported folder with transformers only (greedy: `temperature` is unused), with
        the vector named `speaker` in its speakers file (the default vector when None)."""
        from safetensors.torch import load_file
        from transformers import SpeechT5ForTextToSpeech, SpeechT5HifiGan, SpeechT5Processor

        folder = Path(folder)
        with quiet_hf_libraries():
            processor = SpeechT5Processor.from_pretrained(folder)
            model = SpeechT5ForTextToSpeech.from_pretrained(folder).eval()
            vocoder = SpeechT5HifiGan.from_pretrained(folder / VOCODER).eval()
        vector = load_file(str(folder / SPEECHT5_CARD.speakers_file))[speaker or DEFAULT_VECTOR][None]
        ids = processor(text=text, return_tensors="pt")["input_ids"]
        frames = seconds / (processor.feature_extractor.hop_length / 1000.0)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wave = model.generate_speech(
                ids,
                speaker_embeddings=vector,
                vocoder=vocoder,
                maxlenratio=max(1.0, frames / ids.shape[1]),
                minlenratio=0.0,
            )
        wave = np.asarray(wave.reshape(-1).float().numpy(), dtype=np.float32)
        return Clip(wave, processor.feature_extractor.sampling_rate)
