"""Distilled checkpoints in the flow core: train on one transformer, sample with another.

    fuse_training_adapter(transformer, path)        model.training_adapter: a LoRA file fused into the frozen base
    attach_sampling_denoiser(model, folder, spec)   sample.pretrained (or, with a training adapter, the clean base):
                                                    the transformer samples render with the trained LoRA on it

A LoRA trained naively on a distilled (few-step) model breaks its few-step behaviour, so users
train on the base ("Raw") weights and sample with the distilled ones, or train through the distilled model with a
"training adapter" fused for training and left out of inference. Both need the samples to come from another
transformer than the trained one, with the trained adapters copied onto it before each render (SamplingDenoiser).
The trained module keeps only the run's own adapters, so the exported LoRA never holds the training adapter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component
from dstune.families.folders import read_model_index
from dstune.families.flow_card import sampling_folder_problems
from dstune.families.folders import read_component_config
from dstune.families.lora import add_lora_adapter, is_lora_key, lora_config
from dstune.hf import quiet_hf_libraries

TRAINING_ADAPTER = "dstune_training_adapter"  # the adapter name the file is loaded under, then fused and removed


@dataclass
class SamplingDenoiser:
    """The transformer the samples use (frozen, with adapters named as the trained ones), and its folder's pipeline
    settings and scheduler."""

    folder: Path
    module: torch.nn.Module
    model_index: dict
    scheduler: object


def fuse_training_adapter(transformer: torch.nn.Module, path) -> int:
    """Fuse the LoRA file at `path` into `transformer`'s weights and remove its layers; returns the number of layers
    it changed. FamilyError naming the file when it cannot be read or matches no layer of the transformer."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        state = load_file(str(path / "pytorch_lora_weights.safetensors" if path.is_dir() else path))
    except (OSError, ValueError, RuntimeError) as err:
        raise FamilyError(f"model.training_adapter {path}: cannot read it as a safetensors LoRA file ({err})") from None
    prefixed = {key: value for key, value in state.items() if key.startswith("transformer.")}
    layers = {key.split(".lora_A.")[0] for key in (prefixed or state) if ".lora_A." in key}
    if not layers:
        raise FamilyError(
            f"model.training_adapter {path}: no LoRA layers in it (keys like transformer.<layer>."
            f"lora_A.weight; found e.g. {sorted(state)[:3]})"
        )
    before = {name: p.detach().clone() for name, p in transformer.named_parameters()}
    try:
        with quiet_hf_libraries():
            transformer.load_lora_adapter(
                state, prefix="transformer" if prefixed else None, adapter_name=TRAINING_ADAPTER
            )
            transformer.fuse_lora(adapter_names=[TRAINING_ADAPTER])
            transformer.unload_lora()
    except (ValueError, KeyError, RuntimeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise FamilyError(
            f"model.training_adapter {path}: it does not fit {type(transformer).__name__} ({first}); "
            "it must be a LoRA of this model's transformer"
        ) from None
    changed = sum(not torch.equal(p, before[name]) for name, p in transformer.named_parameters() if name in before)
    if changed == 0 or any(is_lora_key(name) for name, _ in transformer.named_parameters()):
        raise FamilyError(
            f"model.training_adapter {path}: fusing it changed no weight of the transformer; is it a "
            "LoRA of this model with non-zero lora_B?"
        )
    return changed


def attach_sampling_denoiser(model, folder: Path, model_spec, key: str = "sample.pretrained") -> None:
    """Load `folder`'s transformer (frozen, the run's frozen dtype, on the device) with the run's LoRA layers, as
    the denoiser of the model's samples. FamilyError listing why the folder cannot take the trained LoRA."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    folder = Path(folder)
    problems = sampling_folder_problems(
        read_model_index(model.folder),
        read_component_config(model.folder, "transformer"),
        read_model_index(folder),
        read_component_config(folder, "transformer"),
    )
    if problems:
        raise FamilyError(
            f"{key} {folder} cannot render the LoRA trained on {model.folder}:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    with quiet_hf_libraries():
        import diffusers

        cls = getattr(diffusers, model.card.transformer_class)
        module = load_component(folder, "transformer", cls.from_pretrained, torch_dtype=model.frozen_dtype)
        add_lora_adapter(module, lora_config(model_spec.lora_settings))
    module = module.to(model.device).eval().requires_grad_(False)
    scheduler = load_component(folder, "scheduler", FlowMatchEulerDiscreteScheduler.from_pretrained)
    model.sampling_denoiser = SamplingDenoiser(folder, module, read_model_index(folder), scheduler)


@contextlib.contextmanager
def gathered(module: torch.nn.Module, names: list[str]):
    """`module`'s parameters `names` whole on every rank (ZeRO-3 partitions them; otherwise nothing to do)."""
    params = dict(module.named_parameters())
    chosen = [params[name] for name in names]
    if not any(hasattr(p, "ds_id") for p in chosen):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(chosen):
        yield


def with_trained_lora(sampling: SamplingDenoiser, trained: torch.nn.Module) -> torch.nn.Module:
    """The sampling transformer carrying the trained adapters' current values (collective under ZeRO-3)."""
    names = [name for name, _ in trained.named_parameters() if is_lora_key(name)]
    targets = dict(sampling.module.named_parameters())
    missing = [name for name in names if name not in targets]
    if missing:
        raise FamilyError(
            f"the sampling transformer of {sampling.folder} has no layer for the trained adapters {missing[:3]}"
        )
    params = dict(trained.named_parameters())
    with gathered(trained, names), torch.no_grad():
        for name in names:
            targets[name].copy_(params[name].detach().to(targets[name].device, targets[name].dtype))
    return sampling.module
