"""Parameter counts of a model's components without reading a weight: each component's class is built from its
config file on torch's meta device (no memory, no data), then counted. What a family's run holds (which components,
activations, caches) is the family's own (its card, through `dstune.families.get_facts(family).count(spec, ...)`);
this module knows no family.

    config_folder(reference) -> (folder of config files, where they came from), or raises SizesUnknown
    count_component(config path, lora targets, lora rank) -> (parameters, largest layer, adapter parameters)

Where the config files come from, first match wins: a `builtin:` model's stored configs (dstune/model_configs/
builtin/<folder>, copies of what the builder writes; a test keeps them equal); a local folder; a hub id in the
local Hugging Face cache; the stored configs of the example specs' hub models (dstune/model_configs/hub/<id>: only
their config.json files, so that `validate` plans them on a machine that has not downloaded them).
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

from dstune.hf import HUB_ID, NotAvailableLocally, hub_snapshot, quiet_hf_libraries
from dstune.memory.plan import SMALL_TENSOR_NUMEL
from dstune.spec.model_sections import DEFAULT_LORA_TARGET_MODULES
from dstune.spec.section import BUILTIN_PREFIX

STORE = Path(__file__).resolve().parents[1] / "model_configs"
BUILTIN_MARKER = "dstune_builtin.json"  # written last into a built-in's folder: the build is complete
# builtin name -> its versioned folder: the stored config folders are named as the built-in's folder
# (dstune.builtin's BuiltinModel.folder_name, "tiny-sd-v3"); tests/unit/test_memory_plan.py checks they are exactly
# the built-ins' folders, without this module importing the builders of layer 3
BUILTIN_FOLDERS = {
    re.sub(r"-v\d+$", "", folder.name): folder.name
    for folder in sorted((STORE / "builtin").iterdir())
    if folder.is_dir()
}


class SizesUnknown(ValueError):
    """The model's config files are not on this machine (nor stored with dstune)."""


def config_folder(reference: str) -> tuple[Path, str]:
    """A model reference (builtin:, folder, hub id) -> (folder holding its config files, where they came from)."""
    if reference.startswith(BUILTIN_PREFIX):
        name = reference[len(BUILTIN_PREFIX) :]
        if name in BUILTIN_FOLDERS:
            return STORE / "builtin" / BUILTIN_FOLDERS[name], f"{reference} (its stored configs)"
        raise SizesUnknown(f"{reference} is not a built-in model")
    path = Path(reference).expanduser()
    if path.is_dir():
        return path, str(path)
    if HUB_ID.fullmatch(reference):
        try:
            return hub_snapshot(reference), f"{reference} (local Hugging Face cache)"
        except NotAvailableLocally:
            stored = STORE / "hub" / reference
            listed = ("config.json", "model_index.json", "modular_model_index.json")
            if any((stored / name).exists() for name in listed):
                return stored, f"{reference} (configs stored with dstune; not downloaded here)"
    named = [folder for folder in (STORE / "hub").glob(f"*/{path.name}") if path.name]
    if len(named) == 1:  # e.g. /models/stable-diffusion-xl-base-1.0 on a machine that does not have it
        hub_id = f"{named[0].parent.name}/{named[0].name}"
        return named[0], f"{reference} is not here: configs of {hub_id} (stored with dstune), matched by its name"
    raise SizesUnknown(
        f"{reference}: no config files here (not a folder, not in the local Hugging Face cache, "
        "not stored with dstune), so its parameters cannot be counted"
    )


def read_config(path: Path) -> dict:
    """A JSON config file; SizesUnknown naming it when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SizesUnknown(f"{path}: cannot read it ({err})") from None


STORED_COUNTS = STORE / "counts.json"  # the stored configs' counts, so that validate need not import diffusers


@lru_cache(maxsize=64)
def count_component(config_path: str, lora_targets: tuple = (), lora_rank: int = 0) -> tuple[int, int, int]:
    """(parameters, largest layer's parameters, LoRA adapter parameters for those targets) of the class the config
    names. A stored config (dstune/model_configs) with the default LoRA targets is looked up in counts.json (made
    from the same meta-device count by write_stored_counts, checked by tests/unit/test_memory_plan.py); anything
    else is built on the meta device here. Cached per process."""
    stored = _stored_count(Path(config_path), lora_targets)
    if stored is not None:
        return stored["params"], stored["largest_layer_params"], stored["lora_params_per_rank"] * lora_rank
    return meta_count(config_path, lora_targets, lora_rank)


def _stored_count(path: Path, lora_targets: tuple) -> Optional[dict]:
    if lora_targets not in ((), DEFAULT_LORA_TARGET_MODULES) or not path.resolve().is_relative_to(STORE):
        return None
    try:
        table = json.loads(STORED_COUNTS.read_text())
        entry = table[str(path.resolve().relative_to(STORE))]
    except (OSError, ValueError, KeyError):
        return None
    return entry if entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() else None


def meta_count(config_path: str, lora_targets: tuple = (), lora_rank: int = 0) -> tuple[int, int, int]:
    """count_component, always on the meta device."""
    module = _meta_module(config_path)
    params = sum(dict((id(p), p.numel()) for p in module.parameters()).values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    lora = sum(_adapter_params(m, lora_rank) for name, m in _targets(module, lora_targets))
    return params, largest, lora


@lru_cache(maxsize=64)
def count_small_tensors(config_path: str, lora_targets: tuple = (), lora_rank: int = 0) -> tuple:
    """The parameter tensors of up to SMALL_TENSOR_NUMEL elements of the class the config names, with the LoRA
    adapters' (rank x in, out x rank on every target), as sorted (numel, count) pairs: what ZeRO-3's persistence
    threshold selects (dstune.memory.plan.persistent_params). Stored configs with the default targets from
    counts.json, others on the meta device."""
    stored = _stored_count(Path(config_path), lora_targets)
    if stored is not None and "small_tensors" in stored:
        module, dims = [tuple(pair) for pair in stored["small_tensors"]], stored["lora_dims"]
    else:
        module, dims = meta_small_tensors(config_path, lora_targets)
    return _with_adapters(module, dims, lora_rank)


def module_small_tensors(module, lora_targets: tuple = (), lora_rank: int = 0) -> tuple:
    """count_small_tensors of a module already built on the meta device (a family that removes a part it does not
    train first, as a codec inside the class)."""
    return _with_adapters(*_small_sizes_and_dims(module, lora_targets), lora_rank)


def _with_adapters(module: list, dims: list, lora_rank: int) -> tuple:
    sizes: dict = dict(module)
    for dim, count in dims if lora_rank else ():
        if lora_rank * dim <= SMALL_TENSOR_NUMEL:
            sizes[lora_rank * dim] = sizes.get(lora_rank * dim, 0) + count
    return tuple(sorted(sizes.items()))


def meta_small_tensors(config_path: str, lora_targets: tuple = ()) -> tuple[list, list]:
    """([(numel, count)] of the module's tensors up to SMALL_TENSOR_NUMEL, [(dim, count)] of the LoRA adapters'
    dimensions at rank 1 on those targets: each adapted layer's input (x kernel) and output width)."""
    return _small_sizes_and_dims(_meta_module(config_path), lora_targets)


def _small_sizes_and_dims(module, lora_targets: tuple) -> tuple[list, list]:
    sizes: dict = {}
    for tensor in dict((id(p), p) for p in module.parameters()).values():
        if tensor.numel() <= SMALL_TENSOR_NUMEL:
            sizes[tensor.numel()] = sizes.get(tensor.numel(), 0) + 1
    dims: dict = {}
    for _, layer in _targets(module, lora_targets):
        for dim in _adapter_dims(layer):
            dims[dim] = dims.get(dim, 0) + 1
    return sorted(sizes.items()), sorted(dims.items())


@lru_cache(maxsize=64)
def count_linear_weights(config_path: str) -> tuple[int, int]:
    """(weights, output rows) of the nn.Linear layers (exactly nn.Linear: what model.base_precision quantizes) of the
    class the config names: a quantized base's int8 codes and its scales, one per row. counts.json for a stored
    config, else on the meta device."""
    stored = _stored_count(Path(config_path), ())
    if stored is not None and "linear_weights" in stored:
        weights, rows = stored["linear_weights"]
        return weights, rows
    return meta_linear_weights(config_path)


def meta_linear_weights(config_path: str) -> tuple[int, int]:
    import torch

    layers = {id(m.weight): m for m in _meta_module(config_path).modules() if type(m) is torch.nn.Linear}
    return sum(m.weight.numel() for m in layers.values()), sum(m.out_features for m in layers.values())


def _meta_module(config_path: str):
    import torch

    config = read_config(Path(config_path))
    try:
        try:
            with torch.device("meta"):
                return _instantiate(config, Path(config_path))
        except RuntimeError:  # a constructor computing tensors that the meta device refused (MMAudio's filter bank
            return _instantiate(config, Path(config_path))  # in some processes): built on the CPU, counted alike
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # a config its class does not accept
        raise SizesUnknown(f"{config_path}: cannot build its class from it ({type(err).__name__}: {err})") from None


def _targets(module, lora_targets: tuple) -> list:
    """The (name, layer) pairs peft adapts for these target names."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if lora_targets and any(name == t or name.endswith("." + t) for t in lora_targets)
    ]


def stored_counts() -> dict:
    """counts.json as it should be: every stored component config counted on the meta device."""
    table = {}
    for path in sorted(STORE.rglob("config.json")):
        try:
            params, largest, per_rank = meta_count(str(path), DEFAULT_LORA_TARGET_MODULES, 1)
        except SizesUnknown:  # a config that names no class (SNAC's, kept for its frame rate): nothing to count
            continue
        small, dims = meta_small_tensors(str(path), DEFAULT_LORA_TARGET_MODULES)
        table[str(path.relative_to(STORE))] = {
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "params": params,
            "largest_layer_params": largest,
            "lora_params_per_rank": per_rank,
            "small_tensors": [list(pair) for pair in small],
            "lora_dims": [list(pair) for pair in dims],
            "linear_weights": list(meta_linear_weights(str(path))),
        }
    return table


def write_stored_counts() -> None:
    """Regenerate dstune/model_configs/counts.json after adding or changing a stored config."""
    table = stored_counts()  # one line per config: the size lists would take thousands of lines indented
    lines = [f" {json.dumps(name)}: {json.dumps(table[name], sort_keys=True)}" for name in sorted(table)]
    STORED_COUNTS.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def _instantiate(config: dict, path: Path):
    """The diffusers class of `_class_name`, or the transformers class of `architectures[0]`."""
    with quiet_hf_libraries():
        if "_class_name" in config:
            import diffusers

            cls = getattr(diffusers, config["_class_name"], None) or _pipeline_module_class(config["_class_name"], path)
            if cls is None:
                raise SizesUnknown(f"{path}: diffusers has no class {config['_class_name']}")
            return cls.from_config(config)
        import transformers

        names = config.get("architectures") or []
        cls = getattr(transformers, names[0], None) if names else None
        if cls is None:
            raise SizesUnknown(f"{path}: no transformers class named in `architectures`")
        return cls(transformers.AutoConfig.for_model(**config))


def _pipeline_module_class(name: str, path: Path):
    """A component class diffusers keeps in its pipeline's module rather than at its top level: model_index.json
    beside the component's folder lists it as [pipeline module, class] (e.g. a pipeline's text connectors)."""
    import importlib

    index = path.parent.parent / "model_index.json"
    listed = json.loads(index.read_text()) if index.is_file() else {}
    modules = {
        entry[0]
        for entry in listed.values()
        if isinstance(entry, list)
        and len(entry) == 2
        and entry[1] == name
        and entry[0] not in (None, "diffusers", "transformers")
    }
    for module in sorted(modules):
        try:
            found = getattr(importlib.import_module(f"diffusers.pipelines.{module}"), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def import_model_classes(spec) -> None:
    """Import, without building, the class of every component config of the spec's model: a memory baseline taken
    afterwards (dstune.memory.record) then holds the libraries' code, so that what grows after it is the model."""
    try:
        folder, _ = config_folder(spec.model.pretrained)
    except SizesUnknown:
        return
    with quiet_hf_libraries():
        for path in sorted(folder.glob("config.json")) + sorted(folder.glob("*/config.json")):
            config = json.loads(path.read_text())
            if "_class_name" in config:
                import diffusers

                getattr(diffusers, config["_class_name"], None)
            elif config.get("architectures"):
                import transformers

                getattr(transformers, config["architectures"][0], None)


def _adapter_dims(module) -> tuple:
    """The two widths of a LoRA adapter at rank 1 on this layer: A's input (x kernel), B's output; () elsewhere."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        kernel = 1
        for side in module.kernel_size:
            kernel *= side
        return module.in_channels * kernel, module.out_channels
    return ()


def _adapter_params(module, rank: int) -> int:
    """A peft LoRA adapter on a Linear (A: r x in, B: out x r) or a Conv (A: r x in x kernel, B: out x r)."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return rank * (module.in_features + module.out_features)
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        kernel = 1
        for side in module.kernel_size:
            kernel *= side
        return rank * (module.in_channels * kernel + module.out_channels)
    return 0


def vae_factor(vae_config: dict) -> int:
    """The spatial factor of a VAE from its config."""
    if "temperal_downsample" in vae_config:  # a video-style VAE: one spatial halving per stage, times the
        # VAE's own pixel patches where it has them (2x2: 16x in all)
        return 2 ** len(vae_config["temperal_downsample"]) * (vae_config.get("patch_size") or 1)
    return 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1)
