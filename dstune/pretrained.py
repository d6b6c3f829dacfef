"""`model.pretrained` (and a family's other folder keys, such as `model.codec_pretrained`) -> local folders.

A `builtin:` name is built into the cache if needed (dstune.builtin), an existing folder is used as it is, and
anything else is looked up as a hub id in the local Hugging Face cache only: dstune never downloads. Models
receive the resolved folders and never build a built-in model themselves.

A single checkpoint file (`model.pretrained: x.safetensors` / `.ckpt`, in the original non-diffusers key layout) is
converted once into a diffusers pipeline folder in the cache, by diffusers' `from_single_file` with
`config=` the `model.base_pipeline` folder (so nothing is downloaded); the components the file does not hold are
taken from that folder. The model then loads from the converted folder like from any other.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Optional

import torch

from dstune import registry
from dstune.builtin import ensure_builtin_model
from dstune.card import SingleFileLayout
from dstune.families import card_of, family_cards, load_model
from dstune.families.base import FamilyError
from dstune.families.folders import read_model_index
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries
from dstune.model_folders import builtin_name_problem, locate
from dstune.spec.models import FAMILIES, is_single_file

SINGLE_FILE_CACHE = "single-file"  # under output.cache_dir: one converted pipeline folder per (file, base) pair
SINGLE_FILE_INFO = "dstune_single_file.json"
# Key prefixes of original checkpoints -> (the family that reads them, what they are), to say what a file is when it
# is not the family's: each model's own (its card's checkpoint_layouts), and diffusers' layout.
KNOWN_LAYOUTS = {
    **registry.checkpoint_layouts(),
    "unet.": ("", "a diffusers-layout file (give its pipeline folder instead)"),
}


def resolve_pretrained(pretrained: str, cache_dir: str | os.PathLike, key: str = "model.pretrained") -> Path:
    """One folder reference -> a local folder; FamilyError (a ValueError) naming `key` and what to do. Where the
    reference points is dstune.model_folders.locate's answer, the one `dstune validate` checked offline."""
    location = locate(pretrained)
    if location.kind == "unknown-builtin":
        raise FamilyError(f"{builtin_name_problem(pretrained)} ({key})")
    if location.kind == "builtin":
        try:
            return ensure_builtin_model(pretrained, cache_dir)
        except ValueError as err:
            raise FamilyError(str(err)) from None
    if location.kind == "file":
        raise FamilyError(
            f"{location.path} is a file; {key} must be a folder here (a diffusers pipeline or "
            f"transformers folder). Single .safetensors/.ckpt checkpoints load as model.pretrained of "
            f"model.family {' or '.join(single_file_families())}, with model.base_pipeline."
        )
    if location.kind == "missing":
        raise FamilyError(f"folder {location.path} does not exist ({key})")
    if location.kind == "hub-missing":
        raise FamilyError(f"{location.problem} ({key})")
    return location.path


def folder_keys(model_spec) -> tuple[str, ...]:
    """The folder keys of the model section (model.pretrained and its companions' keys, e.g. a codec's)."""
    return ("pretrained", *type(model_spec).COMPANION_FOLDERS)


def resolve_folders(model_spec, cache_dir: str | os.PathLike) -> dict[str, Path | None]:
    """Every folder key of the model section -> its folder, None where unset."""
    folders: dict[str, Path | None] = {}
    for field in folder_keys(model_spec):
        value = getattr(model_spec, field, None)
        if field == "pretrained" and value and is_single_file(value):
            folders[field] = single_file_folder(Path(value).expanduser(), model_spec, cache_dir)
        else:
            folders[field] = resolve_pretrained(value, cache_dir, f"model.{field}") if value else None
    return folders


def single_file_layout(family: str) -> Optional[SingleFileLayout]:
    """How `family`'s single checkpoint files are laid out (its model's card), None where it reads none."""
    return next((card.single_file_layout() for card in family_cards(family) if card.single_file_layout()), None)


def single_file_families() -> list[str]:
    return [name for name in FAMILIES if single_file_layout(name) is not None]


def single_file_folder(path: Path, model_spec, cache_dir) -> Path:
    """The diffusers pipeline folder converted from the checkpoint file `path` (once; then from the cache)."""
    able = " or ".join(single_file_families())
    family, layout = model_spec.family, single_file_layout(model_spec.family)
    if layout is None:
        raise FamilyError(
            f"model.pretrained {path}: model.family {family} cannot load a single checkpoint file; "
            f"give its folder (or hub id, or built-in). Single files load for model.family {able}."
        )
    if not path.is_file():
        raise FamilyError(
            f"model.pretrained {path}: no such file. Give an existing .safetensors/.ckpt checkpoint "
            "(original key layout, with model.base_pipeline), a diffusers pipeline folder, a hub id "
            f"already downloaded, or a built-in model (builtin:tiny-{family})."
        )
    base = resolve_pretrained(model_spec.base_pipeline, cache_dir, "model.base_pipeline")
    keys = checkpoint_keys(path)
    _check_layout(path, keys, family, layout)
    stat = path.resolve().stat()
    identity = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, str(base)])
    out = (
        Path(cache_dir)
        / SINGLE_FILE_CACHE
        / f"{path.stem}-{hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()}"
    )
    if not (out / SINGLE_FILE_INFO).is_file():
        _convert_single_file(path, base, keys, family, layout, out)
    return out


def checkpoint_keys(path: Path) -> list[str]:
    """The tensor names of a .safetensors (from its header) or .ckpt (weights-only unpickling) checkpoint."""
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as handle:
                return list(handle.keys())
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        if not isinstance(state, dict):
            raise ValueError(f"it holds a {type(state).__name__}, not a dict of tensors")
        return [str(key) for key in state]
    except Exception as err:  # noqa: BLE001 - safetensors and torch raise their own types for a damaged file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise FamilyError(f"model.pretrained {path}: cannot read it as a {path.suffix} checkpoint ({first})") from None


def _check_layout(path: Path, keys: list[str], family: str, layout: SingleFileLayout) -> None:
    hints = sorted(
        {
            what
            for prefix, (owner, what) in KNOWN_LAYOUTS.items()
            if owner != family
            for key in keys
            if key.startswith(prefix)
        }
    )
    if any(key.startswith(layout.denoiser_prefixes) for key in keys) and not hints:
        return
    seen = ", ".join(keys[:3]) or "no tensors"
    what = f"it looks like {hints[0]}" if hints else f"its keys are not in that layout (e.g. {seen})"
    raise FamilyError(
        f"model.pretrained {path}: model.family {family} reads a single file in the original key layout, the "
        f"{layout.denoiser} under {' / '.join(layout.denoiser_prefixes)} (plus, optionally, "
        f"{', '.join(f'{c} under {p[0]}' for c, p in layout.companions.items())}); {what}."
    )


def _convert_single_file(path: Path, base: Path, keys: list[str], family: str, layout: SingleFileLayout, out: Path):
    """diffusers' from_single_file with the base folder as config; components the file lacks come from the base."""
    index = read_model_index(base)
    with quiet_hf_libraries():
        import diffusers

        pipeline_class = getattr(diffusers, str(index.get("_class_name")), None)
        if pipeline_class is None or not hasattr(pipeline_class, "from_single_file"):
            raise FamilyError(f"model.base_pipeline {base}: {index.get('_class_name')} cannot load single files")
        components = {}
        for name, prefixes in layout.companions.items():
            if not any(key.startswith(prefixes) for key in keys):
                library, class_name = index[name]
                loader = getattr(importlib.import_module(library), class_name)
                components[name] = loader.from_pretrained(base, subfolder=name)
        try:
            pipeline = pipeline_class.from_single_file(str(path), config=str(base), local_files_only=True, **components)
        except Exception as err:  # noqa: BLE001 - diffusers raises ValueError, KeyError, RuntimeError, its own ...
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise FamilyError(
                f"model.pretrained {path}: diffusers could not load it with the configs of "
                f"model.base_pipeline {base} ({first}). Is it a {family} checkpoint of the same "
                "architecture as the base pipeline?"
            ) from None
        with folder_written_atomically(out, "converting") as work:
            pipeline.save_pretrained(work, safe_serialization=True)
            info = {
                "file": str(path.resolve()),
                "base_pipeline": str(base),
                "from_file": sorted({layout.denoiser, *layout.companions} - set(components)),
                "from_base": sorted(components),
            }
            (work / SINGLE_FILE_INFO).write_text(json.dumps(info, indent=2) + "\n")


def build_model(
    model_spec,
    cache_dir: str | os.PathLike,
    device,
    dtype_for_frozen: torch.dtype = torch.float32,
    zero3_config: Optional[dict] = None,
    folders: Optional[dict] = None,
    text_encoders: bool = True,
):
    """The model of this model spec, loaded: its folders resolved (unless given), the folder's model told by its
    card (dstune.families.card_of), then its class's `load` (one process; training goes through
    dstune.startup.build_model, which orders the ranks). `zero3_config` (a ZeRO-3 DeepSpeed JSON) is passed to
    models that build partitioned (their card's builds_partitioned); that load is then collective. Without
    `text_encoders` (a rank that reads only cached text: dstune.text_once) the text encoders are not loaded."""
    folders = folders if folders is not None else resolve_folders(model_spec, cache_dir)
    card = card_of(model_spec.family, folders["pretrained"])
    options = {} if text_encoders else {"text_encoders": False}
    if zero3_config is None or not card.builds_partitioned:
        zero3_config = None
    return load_model(card, model_spec, folders, device, dtype_for_frozen, zero3_config, **options)


def partitioned_build_config(model_spec, ds_config: Optional[dict]) -> Optional[dict]:
    """The DeepSpeed JSON to build the trainable module partitioned with (ZeRO-3, a family that can, no quantized
    base: a base is quantized whole in host memory first; an int8 one is partitioned from there afterwards,
    dstune.engine.place_trainable), else None: loaded whole, one copy per process."""
    stage = (ds_config or {}).get("zero_optimization", {}).get("stage", 0)
    if stage != 3 or not all(card.builds_partitioned for card in family_cards(model_spec.family)):
        return None
    quantized = getattr(model_spec, "base_precision", None) or getattr(model_spec, "transformer_file", None)
    return None if quantized else ds_config
