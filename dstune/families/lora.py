"""LoRA for every diffusion family and tts_lm: adapters on the trained module, and the LoRA file the export writes.

One code path for the diffusers models. A model tells only which module is the denoiser (`model.trainable`, as for
full training) and how its pipeline saves LoRA weights (its class's `save_lora_weights`):

    model.save_lora_weights(lora_layers, adapter_metadata, folder)
        e.g. StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=lora_layers,
                                                        unet_lora_adapter_metadata=adapter_metadata)

What happens with `model.train: lora`:
  1. `apply_train_mode` (after the model loads, before DeepSpeed sees the module) freezes the denoiser and adds peft
     LoRA layers (diffusers' `add_adapter`; peft's `inject_adapter_in_model` for tts_lm's LM); only the adapters
     require grad, so `wrap_model` hands only them to the optimizer and ZeRO partitions optimizer state for them alone.
  2. Checkpoints leave the frozen weights out (`exclude_frozen_parameters`): they are the pretrained folder's,
     rebuilt on resume, so a LoRA checkpoint is the size of the adapters, not of the model.
  3. The export takes the adapter tensors from the consolidated checkpoint (ZeRO-3 shards are gathered offline by
     DeepSpeed's zero_to_fp32, the same path `dstune export` takes), names them as peft does (the naming diffusers'
     loaders read for every family) and lets the family's pipeline class write `pytorch_lora_weights.safetensors`,
     which `pipe.load_lora_weights(folder)` loads.
  4. `output.lora_format` picks the key scheme of that file (dstune.spec.model_sections.LORA_FORMATS): the
     diffusers scheme above, or kohya's (`lora_unet_<layer path, dots as underscores>.lora_down.weight` /
     `.lora_up.weight` / `.alpha`), which ComfyUI, A1111/Forge and diffusers' own kohya conversion all read. The file
     keeps its name either way, so `pipe.load_lora_weights(folder)` loads every format.
  5. tts_lm (key scheme "peft") writes no diffusers file: its save_lora_weights writes a peft adapter folder
     (`adapter/`) and the merged transformers folder beside it (docs/tts.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstune.families.base import FamilyError, TrainedModel
from dstune.families.randomness import sample_generator
from dstune.families.quantized_base import quantize_linear_weights, stored_weight_bytes
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import lora_file_scheme

ADAPTER_NAME = "default"  # peft's name for the one adapter add_adapter creates; it appears in parameter names
LORA_WEIGHT_FILE = "pytorch_lora_weights.safetensors"  # the name load_lora_weights looks for in a folder
LORA_INFO_FILE = "dstune_lora.json"
PEFT_ADAPTER_FILE = "adapter/adapter_model.safetensors"  # the "peft" scheme (tts_lm): a peft adapter folder


def lora_config(settings):
    """The peft LoraConfig for a spec's LoraSpec. Gaussian A and zero B: the untrained adapter changes nothing."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.resolved_alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        init_lora_weights="gaussian",
    )


def is_lora_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def apply_train_mode(model: TrainedModel, model_spec, seed: int, lora_format=None, device=None) -> str:
    """Make the model's trainable module trainable as `model_spec.train` says; returns a one-line summary for the
    log. A quantized base's layers are placed on `device` as they are quantized (None: where they are). A model
    that cannot write a LoRA file, or adapters the LoRA file's key scheme (`lora_format`, output.lora_format)
    cannot name, are refused here, before training, not at the export.

    For LoRA the A matrices are re-drawn from a CPU generator seeded by train.seed: peft draws them from the global
    (and, on GPUs, the CUDA) RNG, which would make them differ between ranks, devices and runs."""
    denoiser, settings = model.trainable, getattr(model_spec, "lora_settings", None)
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in denoiser.parameters())  # ZeRO-3 built: partitioned
    if settings is None:
        return f"training: full, {total:,} parameters"
    if not model.supports_lora:
        raise FamilyError(
            f"model.train: lora is not supported by model.family {model_spec.family!r} yet (it "
            "cannot write a LoRA file, so the adapters could not be exported). Use train: full."
        )
    denoiser.requires_grad_(False)
    base = quantized_base(denoiser, getattr(model_spec, "base_precision", None), device)
    try:
        with quiet_hf_libraries():
            add_lora_adapter(denoiser, lora_config(settings))
    except ValueError as err:
        first = (str(err).strip().splitlines() or ["no module matched"])[0]
        if "target modules" not in first.lower():  # not about the names: say what peft said, and nothing more
            raise FamilyError(f"model.train: lora: adding the LoRA adapters failed: {first}") from None
        raise FamilyError(
            f"model.lora.target_modules {list(settings.target_modules)}: {first}. Name layers of "
            f"{type(denoiser).__name__} (e.g. to_q, to_k, to_v, to_out.0)."
        ) from None
    adapters = [(name, p) for name, p in denoiser.named_parameters() if p.requires_grad]
    _check_file_names(model_spec.family, lora_format, [name for name, _ in adapters])
    with torch.no_grad():
        for number, (name, param) in enumerate(adapters):
            if ".lora_A." in name:
                draw = torch.randn(tuple(param.shape), generator=sample_generator(seed, 0, number, "lora_A"))
                param.copy_(draw / settings.rank)  # peft's gaussian init: std 1 / r
    trained = sum(p.numel() for _, p in adapters)
    layers = len([name for name, _ in adapters if ".lora_A." in name])
    return (
        f"training: LoRA rank {settings.rank}, alpha {settings.resolved_alpha:g} on {layers} layers "
        f"({', '.join(settings.target_modules)}): {trained:,} trainable of {total + trained:,} parameters{base}"
    )


def add_lora_adapter(module: torch.nn.Module, config) -> None:
    """peft LoRA layers named ADAPTER_NAME on `module`. A diffusers model adds them through its own add_adapter; a
    transformers model (tts_lm's LM) through peft's inject_adapter_in_model, which is what transformers' add_adapter
    calls too: transformers >= 5.24's add_adapter refuses every peft older than 0.22 first, and the peft releases
    dstune installs with (0.17-0.21) add the same layers."""
    from peft import inject_adapter_in_model

    if type(module).__module__.startswith("diffusers."):
        module.add_adapter(config)
    else:
        inject_adapter_in_model(config, module, adapter_name=ADAPTER_NAME)


def quantized_base(denoiser: torch.nn.Module, precision, device=None) -> str:
    """Quantize the frozen denoiser's linear weights as model.base_precision says (before the adapters exist, so
    they stay full precision); returns the summary's suffix ("" for an unquantized base)."""
    if precision is None:
        return ""
    before = stored_weight_bytes(denoiser)
    layers = quantize_linear_weights(denoiser, precision, device)
    after = stored_weight_bytes(denoiser)
    mib = 1024 * 1024
    return (
        f"; frozen base {precision}: {layers} linear layers quantized, weights {before / mib:.1f} MiB -> "
        f"{after / mib:.1f} MiB"
    )


def adapter_state_dict(state: dict) -> dict:
    """The LoRA tensors of a (consolidated) denoiser state dict, named as peft's get_peft_model_state_dict names
    them: `<layer>.lora_A.weight`, without the adapter name. FamilyError when there are none."""
    marker = f".{ADAPTER_NAME}."
    adapters = {name.replace(marker, "."): tensor for name, tensor in state.items() if is_lora_key(name)}
    if not adapters:
        some = ", ".join(sorted(state)[:3]) or "none"
        raise FamilyError(
            f"the checkpoint holds no LoRA adapter weights (keys like ...to_q.lora_A.{ADAPTER_NAME}."
            f"weight; found e.g. {some}): was it trained with model.train: lora?"
        )
    return adapters


def diffusers_lora_layers(state: dict) -> dict:
    """Adapter tensors as `<Pipeline>.save_lora_weights` takes them: peft's names (`<layer>.lora_A.weight` /
    `.lora_B.weight`), which diffusers' loaders read as they are for every family. Not diffusers'
    `convert_state_dict_to_diffusers`, which renames only attention projections (`to_q.lora.down.weight`): with any
    other target (conv1, proj_in, ...) the file mixes both namings, and diffusers' loader, which picks one naming by
    the first key, then silently drops every adapter of the other."""
    return {name: tensor.detach().float().contiguous().cpu() for name, tensor in adapter_state_dict(state).items()}


KOHYA_PREFIX = "lora_unet_"  # kohya's prefix of the denoiser's LoRA layers (text encoders: lora_te_)


def kohya_lora_tensors(state: dict, alpha: float) -> dict:
    """Adapter tensors in kohya's LoRA naming: `lora_unet_<layer path with . as _>.lora_down.weight` (A),
    `.lora_up.weight` (B) and `.alpha` (a 0-dim tensor; the layer's output is scaled by alpha / rank, as peft's)."""
    tensors = {}
    for name, tensor in adapter_state_dict(state).items():
        layer, part = name.rsplit(".lora_", 1)
        key = KOHYA_PREFIX + layer.replace(".", "_")
        tensors[f"{key}.lora_down.weight" if part == "A.weight" else f"{key}.lora_up.weight"] = (
            tensor.detach().float().contiguous().cpu()
        )
        tensors[f"{key}.alpha"] = torch.tensor(float(alpha))
    return tensors


def kohya_read_back(layer: str) -> str:
    """The layer name diffusers' kohya reader makes of `layer`'s kohya key (nothing read: "nothing"). kohya's
    scheme turns the layer path's dots into underscores, and readers guess them back from known UNet part names."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_unet_state_dict_to_peft

    key = KOHYA_PREFIX + layer.replace(".", "_")
    placeholders = {f"{key}.lora_down.weight": torch.zeros(1, 1), f"{key}.lora_up.weight": torch.zeros(1, 1)}
    with quiet_hf_libraries():
        state, _ = StableDiffusionPipeline.lora_state_dict(placeholders)
        read = {name.removeprefix("unet.").rsplit(".lora_", 1)[0] for name in convert_unet_state_dict_to_peft(state)}
    return next(iter(read), "nothing")


def _check_file_names(family_name: str, lora_format, adapter_names: list[str]) -> None:
    chosen, scheme = lora_file_scheme(family_name, lora_format)
    if scheme != "kohya":
        return
    layers = sorted({name.split(".lora_")[0] for name in adapter_names if ".lora_A." in name})
    lost = {layer: back for layer in layers if (back := kohya_read_back(layer)) != layer}
    if lost:  # e.g. a UNet's add_embedding.linear_1 comes back as add.embedding.linear: skipped when loaded
        examples = ", ".join(f"{layer} (read back as {back})" for layer, back in list(lost.items())[:3])
        raise FamilyError(
            f"output.lora_format {chosen}: kohya's key scheme cannot name {len(lost)} adapted layer(s) "
            f"so that LoRA loaders read them back: {examples}. Leave them out of "
            "model.lora.target_modules, or set output.lora_format: diffusers."
        )


def save_kohya_file(tensors: dict, settings, folder: Path) -> None:
    """The kohya file, with the settings kohya's tools record in the safetensors metadata."""
    from safetensors.torch import save_file

    metadata = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(settings.rank),
        "ss_network_alpha": f"{settings.resolved_alpha:g}",
        "ss_network_dropout": f"{settings.dropout:g}",
    }
    save_file(tensors, str(folder / LORA_WEIGHT_FILE), metadata=metadata)


def export_lora(model: TrainedModel, state: dict, out_dir, model_spec, weights: str = "raw", lora_format=None) -> Path:
    """Write `out_dir/pytorch_lora_weights.safetensors` in the scheme of `lora_format` (output.lora_format; None:
    the family's default) + dstune_lora.json naming the base model and the format, atomically.
    `weights` says which weights these are ("ema" or "raw"); it is recorded, not applied."""
    settings = model_spec.lora_settings
    if not model.supports_lora:
        raise FamilyError(f"model.family {model_spec.family!r} cannot write a LoRA file")
    chosen, scheme = lora_file_scheme(model_spec.family, lora_format)
    out = Path(out_dir)
    with folder_written_atomically(out, "exporting") as work:
        if scheme == "kohya":
            layers = kohya_lora_tensors(state, settings.resolved_alpha)
            save_kohya_file(layers, settings, work)
        else:
            layers = diffusers_lora_layers(state)
            with quiet_hf_libraries():
                model.save_lora_weights(layers, lora_config(settings).to_dict(), work)
        written = PEFT_ADAPTER_FILE if scheme == "peft" else LORA_WEIGHT_FILE
        if not (work / written).is_file():
            raise FamilyError(f"{model.card.name}: save_lora_weights wrote no {written}")
        info = {
            "base_model": model_spec.pretrained,
            "base_folder": str(model.folder),
            "family": model_spec.family,
            "format": chosen,
            "key_scheme": scheme,
            "rank": settings.rank,
            "alpha": settings.resolved_alpha,
            "target_modules": list(settings.target_modules),
            "weights": weights,
            "tensors": len(layers),
        }
        (work / LORA_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out
