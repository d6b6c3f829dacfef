"""LoRA for every diffusion family: adapters on the denoiser, and the diffusers LoRA file the export writes.

One code path for sd, sdxl and flow. A family tells only which module is the denoiser (`built.trainable`, as for
full training) and how its pipeline saves LoRA weights (its declared `Family.save_lora_weights`):

    save_lora_weights(built, lora_layers, adapter_metadata, folder)
        e.g. StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=lora_layers,
                                                        unet_lora_adapter_metadata=adapter_metadata)

What happens with `model.train: lora`:
  1. `apply_train_mode` (after family.build, before DeepSpeed sees the module) freezes the denoiser and adds peft
     LoRA layers through diffusers' `add_adapter`; only the adapters require grad, so `wrap_model` hands only them
     to the optimizer and ZeRO partitions optimizer state for them alone.
  2. Checkpoints leave the frozen weights out (`exclude_frozen_parameters`): they are the pretrained folder's,
     rebuilt on resume, so a LoRA checkpoint is the size of the adapters, not of the model.
  3. The export takes the adapter tensors from the consolidated checkpoint (ZeRO-3 shards are gathered offline by
     DeepSpeed's zero_to_fp32, the same path `dstune export` takes), renames them the way diffusers'
     training examples do (peft names -> `convert_state_dict_to_diffusers`) and lets the family's pipeline class
     write `pytorch_lora_weights.safetensors`, which `pipe.load_lora_weights(folder)` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstune.families.base import Family, FamilyError, sample_generator
from dstune.families.quantized_base import quantize_linear_weights, stored_weight_bytes
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries

ADAPTER_NAME = "default"  # peft's name for the one adapter add_adapter creates; it appears in parameter names
LORA_WEIGHT_FILE = "pytorch_lora_weights.safetensors"  # the name load_lora_weights looks for in a folder
LORA_INFO_FILE = "dstune_lora.json"


def lora_config(settings):
    """The peft LoraConfig for a spec's LoraSpec. Gaussian A and zero B: the untrained adapter changes nothing."""
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.resolved_alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), init_lora_weights="gaussian")


def is_lora_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def apply_train_mode(denoiser: torch.nn.Module, model_spec, seed: int, family: Family) -> str:
    """Make `denoiser` trainable as `model_spec.train` says; returns a one-line summary for the log. A family
    that cannot write a LoRA file is refused here, before training, not at the export.

    For LoRA the A matrices are re-drawn from a CPU generator seeded by train.seed: peft draws them from the global
    (and, on GPUs, the CUDA) RNG, which would make them differ between ranks, devices and runs."""
    settings = getattr(model_spec, "lora_settings", None)
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in denoiser.parameters())  # ZeRO-3 built: partitioned
    if settings is None:
        return f"training: full, {total:,} parameters"
    if not family.supports_lora:
        raise FamilyError(f"model.train: lora is not supported by model.family {model_spec.family!r} yet (it "
                          "cannot write a LoRA file, so the adapters could not be exported). Use train: full.")
    denoiser.requires_grad_(False)
    base = quantized_base(denoiser, getattr(model_spec, "base_precision", None))
    try:
        with quiet_hf_libraries():
            denoiser.add_adapter(lora_config(settings))
    except ValueError as err:  # peft: no module matched target_modules
        first = (str(err).strip().splitlines() or ["no module matched"])[0]
        raise FamilyError(f"model.lora.target_modules {list(settings.target_modules)}: {first}. Name layers of "
                          f"{type(denoiser).__name__} (e.g. to_q, to_k, to_v, to_out.0).") from None
    adapters = [(name, p) for name, p in denoiser.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for number, (name, param) in enumerate(adapters):
            if ".lora_A." in name:
                draw = torch.randn(tuple(param.shape), generator=sample_generator(seed, 0, number, "lora_A"))
                param.copy_(draw / settings.rank)  # peft's gaussian init: std 1 / r
    trained = sum(p.numel() for _, p in adapters)
    layers = len([name for name, _ in adapters if ".lora_A." in name])
    return (f"training: LoRA rank {settings.rank}, alpha {settings.resolved_alpha:g} on {layers} layers "
            f"({', '.join(settings.target_modules)}): {trained:,} trainable of {total + trained:,} parameters{base}")


def quantized_base(denoiser: torch.nn.Module, precision) -> str:
    """Quantize the frozen denoiser's linear weights as model.base_precision says (before the adapters exist, so
    they stay full precision); returns the summary's suffix ("" for an unquantized base)."""
    if precision is None:
        return ""
    before = stored_weight_bytes(denoiser)
    layers = quantize_linear_weights(denoiser, precision)
    after = stored_weight_bytes(denoiser)
    mib = 1024 * 1024
    return (f"; frozen base {precision}: {layers} linear layers quantized, weights {before / mib:.1f} MiB -> "
            f"{after / mib:.1f} MiB")


def adapter_state_dict(state: dict) -> dict:
    """The LoRA tensors of a (consolidated) denoiser state dict, named as peft's get_peft_model_state_dict names
    them: `<layer>.lora_A.weight`, without the adapter name. FamilyError when there are none."""
    marker = f".{ADAPTER_NAME}."
    adapters = {name.replace(marker, "."): tensor for name, tensor in state.items() if is_lora_key(name)}
    if not adapters:
        some = ", ".join(sorted(state)[:3]) or "none"
        raise FamilyError(f"the checkpoint holds no LoRA adapter weights (keys like ...to_q.lora_A.{ADAPTER_NAME}."
                          f"weight; found e.g. {some}): was it trained with model.train: lora?")
    return adapters


def diffusers_lora_layers(state: dict) -> dict:
    """Adapter tensors in diffusers' LoRA naming (`<layer>.lora.down.weight` / `.lora.up.weight`), the form
    `<Pipeline>.save_lora_weights` expects, as diffusers' train_*_lora.py examples produce it."""
    from diffusers.utils import convert_state_dict_to_diffusers

    peft_named = adapter_state_dict(state)
    return {name: tensor.detach().float().contiguous().cpu()
            for name, tensor in convert_state_dict_to_diffusers(peft_named).items()}


def export_lora(family: Family, built, state: dict, out_dir, model_spec, weights: str = "raw") -> Path:
    """Write `out_dir/pytorch_lora_weights.safetensors` (+ dstune_lora.json naming the base model), atomically.
    `weights` says which weights these are ("ema" or "raw"); it is recorded, not applied."""
    settings = model_spec.lora_settings
    layers = diffusers_lora_layers(state)
    metadata = lora_config(settings).to_dict()
    out = Path(out_dir)
    if not family.supports_lora:
        raise FamilyError(f"model.family {model_spec.family!r} cannot write a LoRA file")
    with folder_written_atomically(out, "exporting") as work:
        with quiet_hf_libraries():
            family.save_lora_weights(built, layers, metadata, work)
        if not (work / LORA_WEIGHT_FILE).is_file():
            raise FamilyError(f"model.family {family.name}: save_lora_weights wrote no {LORA_WEIGHT_FILE}")
        info = {"base_model": model_spec.pretrained, "base_folder": str(built.folder), "family": model_spec.family,
                "rank": settings.rank, "alpha": settings.resolved_alpha,
                "target_modules": list(settings.target_modules), "weights": weights,
                "tensors": len(layers)}
        (work / LORA_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out
