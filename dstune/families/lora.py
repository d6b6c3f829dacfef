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
  5. A video model's `comfyui` format (key scheme "original") names the layers as the model's original checkpoints
     do (`diffusion_model.blocks.N.self_attn.q`), from its card's `original_lora_names`: ComfyUI's loader maps
     them, and diffusers converts them back itself.
  6. tts_lm (key scheme "peft") writes no diffusers file: its save_lora_weights writes a peft adapter folder
     (`adapter/`) and the merged transformers folder beside it (docs/tts.md).
"""

from __future__ import annotations

import contextlib

import json
from pathlib import Path

import torch

from dstune.families.base import FamilyError, TrainedModel
from dstune.families.randomness import sample_generator
from dstune.families.int8_partitioned import quantize_linear_weights_int8
from dstune.families.quantized_base import quantize_linear_weights, scaled_layers, stored_weight_bytes
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import lora_file_scheme

ADAPTER_NAME = "default"  # peft's name for the one adapter add_adapter creates; it appears in parameter names
LORA_WEIGHT_FILE = "pytorch_lora_weights.safetensors"  # the name load_lora_weights looks for in a folder
LORA_INFO_FILE = "dstune_lora.json"
PEFT_ADAPTER_FILE = "adapter/adapter_model.safetensors"  # the "peft" scheme (tts_lm): a peft adapter folder


# model.lora.type -> how the log names it; lokr and loha have no diffusers loader, so their "diffusers" export is a
# peft adapter folder (PEFT_ADAPTER_FILE)
ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}
PEFT_FOLDER_TYPES = ("lokr", "loha")
# the parts of a parameter name that mark an adapter tensor, for every model.lora.type
ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_magnitude_vector", ".lokr_", ".hada_")


def adapter_type(settings) -> str:
    return getattr(settings, "type", "lora")


def lora_config(settings):
    """The peft config for a spec's LoraSpec. LoRA and DoRA: gaussian A and zero B; LoKr and LoHa: peft's own
    initialisation, one factor zero. In every case the untrained adapter changes nothing."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    targets, kind = list(settings.target_modules), adapter_type(settings)
    if kind == "lokr":
        return LoKrConfig(r=settings.rank, alpha=settings.resolved_alpha, target_modules=targets)
    if kind == "loha":
        return LoHaConfig(r=settings.rank, alpha=settings.resolved_alpha, target_modules=targets)
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.resolved_alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        init_lora_weights="gaussian",
        use_dora=kind == "dora",
    )


def is_lora_key(name: str) -> bool:
    """An adapter tensor of any model.lora.type (LoRA's A and B, DoRA's magnitude, LoKr's and LoHa's factors)."""
    return any(part in name for part in ADAPTER_PARTS)


def apply_train_mode(
    model: TrainedModel, model_spec, seed: int, lora_format=None, device=None, partitioned_dtype=None
) -> str:
    """Make the model's trainable module trainable as `model_spec.train` says; returns a one-line summary for the
    log. A quantized base's layers are placed on `device` as they are quantized (None: where they are); under ZeRO-3
    (`partitioned_dtype`: the training dtype) an int8 base is made of Int8Linear layers kept in host memory, for
    ZeRO-3 to partition (dstune.families.int8_partitioned). A model
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
    base = quantized_base(denoiser, getattr(model_spec, "base_precision", None), device, partitioned_dtype)
    try:
        # LoKr and LoHa draw their first factors from the global RNG: seeded here so that every rank draws the same
        # (LoRA's and DoRA's A are re-drawn below from their own generator)
        with quiet_hf_libraries(), torch.random.fork_rng():
            torch.manual_seed(seed)
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
    _check_file_names(model_spec.family, lora_format, [name for name, _ in adapters], model.card.original_lora_names)
    _check_adapter_format(model_spec.family, lora_format, adapter_type(settings))
    with torch.no_grad():
        for number, (name, param) in enumerate(adapters):
            if ".lora_A." in name:
                draw = torch.randn(tuple(param.shape), generator=sample_generator(seed, 0, number, "lora_A"))
                param.copy_(draw / settings.rank)  # peft's gaussian init: std 1 / r
    trained = sum(p.numel() for _, p in adapters)
    layers = len({adapted_layer(name) for name, _ in adapters})
    return (
        f"training: {ADAPTER_NAMES[adapter_type(settings)]} rank {settings.rank}, alpha "
        f"{settings.resolved_alpha:g} on {layers} layers "
        f"({', '.join(settings.target_modules)}): {trained:,} trainable of {total + trained:,} parameters{base}"
    )


@contextlib.contextmanager
def adapters_off(module: torch.nn.Module):
    """Inside: `module` computes as its base model, every peft adapter layer (LoRA, LoKr, LoHa, DoRA) passing its
    base layer's output through untouched; no copy of the weights. Each adapter parameter's requires_grad is put
    back afterwards (peft's switch clears it)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [layer for layer in module.modules() if isinstance(layer, BaseTunerLayer)]
    if not layers:
        raise FamilyError("no adapter layers to switch off: differential output preservation needs model.train: lora")
    wanted = {name: param.requires_grad for name, param in module.named_parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for name, param in module.named_parameters():
            param.requires_grad_(wanted[name])


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


def quantized_base(denoiser: torch.nn.Module, precision, device=None, partitioned_dtype=None) -> str:
    """Quantize the frozen denoiser's linear weights as model.base_precision says (before the adapters exist, so
    they stay full precision); returns the summary's suffix ("" for an unquantized base). Under ZeRO-3
    (`partitioned_dtype`) int8 is dstune's own Int8Linear, whose weight and scales ZeRO-3 partitions."""
    if precision is None:
        read = scaled_layers(denoiser)  # model.transformer_file: quantized as the file stores it
        if not read:
            return ""
        stored = sorted({layer.storage for layer in read})
        mib = sum(layer.weight.numel() + 4 * layer.scale_bits.numel() for layer in read) / (1024 * 1024)
        return f"; frozen base from model.transformer_file: {len(read)} linear layers {'/'.join(stored)}, {mib:.1f} MiB"
    before = stored_weight_bytes(denoiser)
    if partitioned_dtype is not None and precision == "int8":
        layers = quantize_linear_weights_int8(denoiser, partitioned_dtype)
    else:
        layers = quantize_linear_weights(denoiser, precision, device)
    after = stored_weight_bytes(denoiser)
    mib = 1024 * 1024
    return (
        f"; frozen base {precision}: {layers} linear layers quantized, weights {before / mib:.1f} MiB -> "
        f"{after / mib:.1f} MiB"
    )


def adapted_layer(name: str) -> str:
    """The layer path of an adapter tensor's name (`...attn1.to_q.lora_A.default.weight` -> `...attn1.to_q`)."""
    for part in ADAPTER_PARTS:
        if part in name:
            return name.split(part, 1)[0]
    return name


def peft_name(name: str) -> str:
    """An adapter parameter's name as peft's get_peft_model_state_dict writes it: without the adapter's name, and
    DoRA's magnitude without its `.weight` (`<layer>.lora_magnitude_vector`)."""
    name = name.replace(f".{ADAPTER_NAME}.", ".").removesuffix(f".{ADAPTER_NAME}")
    return name.removesuffix(".weight") if name.endswith(".lora_magnitude_vector.weight") else name


def adapter_state_dict(state: dict) -> dict:
    """The adapter tensors of a (consolidated) denoiser state dict, named as peft's get_peft_model_state_dict names
    them: `<layer>.lora_A.weight`, `<layer>.lokr_w1`, ..., without the adapter name. FamilyError when there are
    none."""
    adapters = {peft_name(name): tensor for name, tensor in state.items() if is_lora_key(name)}
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


# peft's adapter tensor names -> kohya's / LyCORIS's (what ComfyUI reads); LoKr's and LoHa's keep their names
KOHYA_PARTS = {
    "lora_A.weight": "lora_down.weight",
    "lora_B.weight": "lora_up.weight",
    "lora_magnitude_vector": "dora_scale",
}


def kohya_lora_tensors(state: dict, alpha: float, rank: int | None = None) -> dict:
    """Adapter tensors in kohya's naming: `lora_unet_<layer path with . as _>.lora_down.weight` (A),
    `.lora_up.weight` (B) and `.alpha` (a 0-dim tensor; the layer's output is scaled by alpha / rank, as peft's).
    LoKr and LoHa keep
    LyCORIS's names (`.lokr_w1`, `.lokr_w2` or `.lokr_w2_a`/`_b`, `.hada_w1_a`, ...), which are peft's: readers scale
    a factor pair by alpha / its inner size, so a LoKr layer with neither factor split (no inner size, read at scale 1)
    has peft's alpha / rank folded into `lokr_w2`."""
    tensors = {}
    adapters = adapter_state_dict(state)
    for name, tensor in adapters.items():
        layer = adapted_layer(name)
        part = name[len(layer) + 1 :]
        key = KOHYA_PREFIX + layer.replace(".", "_")
        value = tensor.detach().float().contiguous().cpu()
        if part == "lokr_w2" and rank is not None and f"{layer}.lokr_w1_b" not in adapters:
            value = value * (alpha / rank)
        tensors[f"{key}.{KOHYA_PARTS.get(part, part)}"] = value
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


ORIGINAL_PREFIX = "diffusion_model."  # the "original" scheme: a model's original checkpoint names (ComfyUI's)
NO_ORIGINAL_NAMES = (
    "output.lora_format comfyui: dstune has no ComfyUI format for this model (no map of its original layer names); "
    "set output.lora_format: diffusers, which its pipeline's load_lora_weights loads"
)


def original_lora_tensors(state: dict, alpha: float, names) -> dict:
    """Adapter tensors under the layer names of the model's original checkpoints: `diffusion_model.blocks.N.<name>`
    with `.lora_A.weight`, `.lora_B.weight` and `.alpha` (ComfyUI and diffusers scale by alpha / rank, as peft does).
    `names`: diffusers' name of a block's layer -> the original one (its card's original_lora_names). FamilyError
    for a layer it does not name, or an adapter that is not LoRA's A and B."""
    if not names:
        raise FamilyError(NO_ORIGINAL_NAMES)
    tensors = {}
    for name, tensor in adapter_state_dict(state).items():
        layer = adapted_layer(name)
        part = name[len(layer) + 1 :]
        original = _original_layer(layer, names)
        if original is None:
            raise FamilyError(f"output.lora_format comfyui: no original name for the adapted layer {layer}")
        if part not in ("lora_A.weight", "lora_B.weight"):
            raise FamilyError(
                f"output.lora_format comfyui writes LoRA's A and B only, not {part} (model.lora.type lora)"
            )
        tensors[f"{ORIGINAL_PREFIX}{original}.{part}"] = tensor.detach().float().contiguous().cpu()
        tensors[f"{ORIGINAL_PREFIX}{original}.alpha"] = torch.tensor(float(alpha))
    return tensors


def _original_layer(layer: str, names) -> str | None:
    """`blocks.3.attn1.to_q` -> `blocks.3.self_attn.q` (None for a layer outside the blocks, or not in `names`)."""
    head, number, rest = (layer.split(".", 2) + ["", ""])[:3]
    if head != "blocks" or not number.isdigit() or rest not in names:
        return None
    return f"blocks.{number}.{names[rest]}"


def _check_file_names(family_name: str, lora_format, adapter_names: list[str], original_names) -> None:
    chosen, scheme = lora_file_scheme(family_name, lora_format)
    if scheme == "original":
        if not original_names:
            raise FamilyError(NO_ORIGINAL_NAMES)
        layers = sorted({adapted_layer(name) for name in adapter_names})
        unnamed = [layer for layer in layers if _original_layer(layer, original_names) is None]
        if unnamed:
            raise FamilyError(
                f"output.lora_format {chosen}: {len(unnamed)} adapted layer(s) have no name in the model's original "
                f"checkpoints, which ComfyUI's loader maps (e.g. {', '.join(unnamed[:3])}): ComfyUI would skip them. "
                "Leave them out of model.lora.target_modules (the attention projections and the feed-forward "
                "layers have names), or set output.lora_format: diffusers."
            )
        return
    if scheme != "kohya":
        return
    layers = sorted({adapted_layer(name) for name in adapter_names})
    lost = {layer: back for layer in layers if (back := kohya_read_back(layer)) != layer}
    if lost:  # e.g. a UNet's add_embedding.linear_1 comes back as add.embedding.linear: skipped when loaded
        examples = ", ".join(f"{layer} (read back as {back})" for layer, back in list(lost.items())[:3])
        raise FamilyError(
            f"output.lora_format {chosen}: kohya's key scheme cannot name {len(lost)} adapted layer(s) "
            f"so that LoRA loaders read them back: {examples}. Leave them out of "
            "model.lora.target_modules, or set output.lora_format: diffusers."
        )


def _check_adapter_format(family_name: str, lora_format, kind: str) -> None:
    """LoKr and LoHa have no diffusers key scheme: their diffusers export is a peft adapter folder, which ComfyUI
    does not read; ComfyUI reads them in kohya's (LyCORIS) keys, which only the UNet families write."""
    chosen, scheme = lora_file_scheme(family_name, lora_format)
    if kind == "dora" and (scheme == "kohya" or chosen == "comfyui"):
        raise FamilyError(
            f"output.lora_format {chosen} with model.lora.type dora: peft's DoRA scales each output row of W + BA to "
            "its learned magnitude, while ComfyUI's dora_scale divides by the base weight's row norms (or by column "
            "norms), and diffusers' kohya reader drops dora_scale: no file in those keys gives the trained model. "
            "Set output.lora_format: diffusers (pipe.load_lora_weights reads DoRA there), or model.lora.type lora."
        )
    if kind in PEFT_FOLDER_TYPES and chosen == "comfyui" and scheme != "kohya":
        raise FamilyError(
            f"output.lora_format comfyui with model.lora.type {kind}: ComfyUI reads {ADAPTER_NAMES[kind]} files in "
            f"kohya's (LyCORIS) keys, which model.family {family_name} does not write (its comfyui format is "
            f"diffusers' keys, which have no {ADAPTER_NAMES[kind]}). Set output.lora_format: diffusers (a peft "
            "adapter folder), or model.lora.type lora or dora."
        )


def save_kohya_file(tensors: dict, settings, folder: Path) -> None:
    """The kohya file, with the settings kohya's tools record in the safetensors metadata (LyCORIS's module and
    algorithm for LoKr and LoHa)."""
    from safetensors.torch import save_file

    kind = adapter_type(settings)
    lycoris = kind in PEFT_FOLDER_TYPES
    metadata = {
        "ss_network_module": "lycoris.kohya" if lycoris else "networks.lora",
        **({"ss_network_args": json.dumps({"algo": kind})} if lycoris else {}),
        "ss_network_dim": str(settings.rank),
        "ss_network_alpha": f"{settings.resolved_alpha:g}",
        "ss_network_dropout": f"{settings.dropout:g}",
    }
    save_file(tensors, str(folder / LORA_WEIGHT_FILE), metadata=metadata)


def save_peft_folder(layers: dict, config, folder: Path) -> None:
    """`folder/adapter/`: adapter_config.json and adapter_model.safetensors as peft's save_pretrained writes them
    for a model wrapped in PeftModel, so that `PeftModel.from_pretrained(denoiser, folder / "adapter")` loads it."""
    from safetensors.torch import save_file

    adapter = folder / Path(PEFT_ADAPTER_FILE).parent
    adapter.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(adapter))
    save_file({f"base_model.model.{name}": tensor for name, tensor in layers.items()}, str(folder / PEFT_ADAPTER_FILE))


def save_original_file(tensors: dict, settings, folder: Path) -> None:
    """The file of the "original" scheme, with its rank and alpha in the safetensors metadata."""
    from safetensors.torch import save_file

    metadata = {
        "format": "original layer names (ComfyUI)",
        "rank": str(settings.rank),
        "alpha": f"{settings.resolved_alpha:g}",
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
            layers = kohya_lora_tensors(state, settings.resolved_alpha, settings.rank)
            save_kohya_file(layers, settings, work)
        elif scheme == "original":
            layers = original_lora_tensors(state, settings.resolved_alpha, model.card.original_lora_names)
            save_original_file(layers, settings, work)
        elif adapter_type(settings) in PEFT_FOLDER_TYPES:  # no diffusers loader: peft's own adapter folder
            layers = diffusers_lora_layers(state)
            save_peft_folder(layers, lora_config(settings), work)
            scheme = "peft"
        else:
            layers = diffusers_lora_layers(state)
            with quiet_hf_libraries():
                model.save_lora_weights(layers, lora_config(settings).to_dict(), work)
        written = PEFT_ADAPTER_FILE if scheme == "peft" else LORA_WEIGHT_FILE
        if not (work / written).is_file():
            raise FamilyError(f"{model.card.name}: save_lora_weights wrote no {written}")
        info = {
            "base_model": model_spec.pretrained,
            "base_folder": str(Path(model.folder).absolute()),  # wherever the run was started from
            "family": model_spec.family,
            "format": chosen,
            "key_scheme": scheme,
            "adapter": adapter_type(settings),
            "rank": settings.rank,
            "alpha": settings.resolved_alpha,
            "target_modules": list(settings.target_modules),
            "weights": weights,
            "tensors": len(layers),
        }
        (work / LORA_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out
