"""What every model class is: `TrainedModel`, the contract between the stages and a model's torch side.

    card = dstune.families.card_of(spec.model.family, folder)          # torch-free: which model the folder holds
    model = dstune.families.load_model(card, spec.model, folders, device, frozen_dtype)
    encoded = model.encode_batch(batch, compute_dtype)
    loss = model.loss(engine, encoded, train_seed, optimizer_step)
    outputs = model.sample(engine.module, prompts, spec.sample, resolution)
    path = model.save_samples(outputs, prompts, path)               # an image grid, or a folder of WAVs
    model.export(consolidated_state_dict, out_dir)

load(card, model_spec, folders, device, frozen_dtype, zero3_config=None, text_encoders=True) -> the model
    `folders` maps each folder key of the spec's model section (dstune.spec: MODEL_FOLDER_FIELDS and
    COMPANION_FOLDERS, e.g. "pretrained", "codec_pretrained") to a local folder, or None where the spec leaves the
    key unset; dstune.pretrained resolves them (built-in models, hub cache) before any model code runs. Load every
    component with `from_pretrained(folder, subfolder=...)`. Raises FamilyError (a ValueError) naming the folder and
    what is wrong. Never downloads anything.
encode_batch(batch, dtype) -> dict
    Everything the loss needs from a collated batch, computed by the frozen parts under torch.no_grad.
    Deterministic (no random draws), so the result could be cached.
loss(forward, encoded, seed, step) -> scalar tensor
    The training loss, the mean over the micro batch. `forward` is the DeepSpeed engine in training (a bare module
    in tests). Every random draw comes from `sample_generator(seed, step, index, purpose)`.
export(state_dict, out_dir, pretrained_folder=None)
    Write a complete folder the ecosystem loads (diffusers pipeline, transformers folder) with the trained weights,
    atomically (dstune.fsutil.publish_folder).

A model holds at least `card`, `trainable` (the one nn.Module DeepSpeed wraps: train mode, requires_grad on),
`folder` (the resolved pretrained folder) and `device`; its frozen companions are built outside any zero.Init, are
in eval mode with requires_grad off, and never reach deepspeed.initialize. `frozen` maps each companion's name to
the module: "vae" for the VAE, "image_encoder" for an image encoder, every other entry a text encoder (or a codec).
`modality` ("image", "video" or "audio") says which data path and cache kinds apply; a video model's batches hold
clips (B, 3, frames, H, W), dstune.data.video.

Capabilities are the class's, declared here and never probed: `supports_lora` (False: model.train: lora is refused
before training), `samples_with_another_denoiser` (sample.pretrained, model.training_adapter). What the stages ask
before a model is loaded (whether it builds partitioned under ZeRO-3, its text cache's folders, what the latent
cache stores, whether samples read cached text) is its card's.

Randomness. A sample's noise, timestep and the like depend only on (run seed, optimizer step, dataset index,
purpose; dstune.families.randomness): never on the global RNG, the rank, the micro-batch split or the device. So 1
rank x 4 accumulation steps and 2 ranks x 2 draw the same noise for the same sample at the same step, and CPU and GPU
runs agree. Torch-free (the classes import torch; this contract does not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Optional


class FamilyError(ValueError):
    """A model that cannot be used: the message names the folder or model, what is wrong and how to fix it."""


class TrainedModel:
    """The base of every core's model class (see the module docstring); its methods here raise, or give the
    answer of a model that has nothing to say."""

    card: Any  # its card (dstune.card.ModelCard): every constant the class reads
    trainable: Any  # the one torch.nn.Module DeepSpeed wraps
    folder: Path
    device: Any
    supports_lora: ClassVar[bool] = False
    samples_with_another_denoiser: ClassVar[bool] = False
    # a speech model's reference clips per speaker, which it conditions its training utterances on (take_voices)
    voice_references: ClassVar[int] = 0

    @classmethod
    def load(cls, card, model_spec, folders: dict, device, frozen_dtype, zero3_config=None, text_encoders=True):
        raise NotImplementedError(f"{cls.__name__} has no load")

    @property
    def modality(self) -> str:
        raise NotImplementedError

    @property
    def frozen(self) -> dict:
        return {}

    def latent_parts(self) -> tuple[str, ...]:
        """Its frozen parts whose outputs the latent cache stores (moved off the accelerator while cached latents
        stand in for them); every other frozen part's outputs are the text cache's."""
        return ("vae", "image_encoder")

    def take_voices(self, voices: dict) -> None:
        """The data's first `voice_references` clips of each speaker, from start-up before the caches: speaker ->
        [(sample id, wave at the model's rate)]."""

    def encode_batch(self, batch: dict, dtype) -> dict:
        raise NotImplementedError

    def loss(self, forward, encoded: dict, seed: int, step: int):
        raise NotImplementedError

    def loss_parts(self) -> dict[str, float]:
        """The named parts of the last `loss` call (they add up to it), which training logs beside the loss as
        loss_<name>: a model that learns two things at once (video and sound) records them in `last_loss_parts`
        (dstune.families.loss_terms.parted_loss makes both); none otherwise."""
        return getattr(self, "last_loss_parts", {})

    def sample(self, trainable_module, prompts: list[str], sample_spec, resolution: int) -> list:
        raise NotImplementedError

    def save_samples(self, outputs: list, prompts: list[str], path) -> Path:
        raise NotImplementedError

    def export(self, state_dict: dict, out_dir, pretrained_folder=None) -> Path:
        raise NotImplementedError

    def save_lora_weights(self, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} writes no LoRA file")

    def split_plan(self, size: int) -> Optional[dict]:
        raise NotImplementedError(f"{type(self).__name__} has no sequence-parallel split")

    def attach_sampling_denoiser(self, folder: Path, model_spec, key: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} samples with the trained module only")
