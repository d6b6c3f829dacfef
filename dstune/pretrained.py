"""`model.pretrained` (and a family's other folder keys, such as `model.codec_pretrained`) -> local folders.

A `builtin:` name is built into the cache if needed (dstune.builtin), an existing folder is used as it is, and
anything else is looked up as a hub id in the local Hugging Face cache only: dstune never downloads. Families
receive the resolved folders and never build a built-in model themselves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from dstune.builtin import ensure_builtin_model
from dstune.families import get_family
from dstune.families.base import Family, FamilyError
from dstune.hf import HUB_ID, NotAvailableLocally, hub_snapshot
from dstune.spec.section import BUILTIN_PREFIX


def resolve_pretrained(pretrained: str, cache_dir: str | os.PathLike, key: str = "model.pretrained") -> Path:
    """One folder reference -> a local folder; FamilyError (a ValueError) naming `key` and what to do."""
    if pretrained.startswith(BUILTIN_PREFIX):
        try:
            return ensure_builtin_model(pretrained, cache_dir)
        except ValueError as err:
            raise FamilyError(str(err)) from None
    path = Path(pretrained).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FamilyError(f"{path} is a file; {key} must be a folder (a diffusers pipeline or transformers "
                              "folder; single-file .safetensors/.ckpt checkpoints are not supported: convert them "
                              "first)")
        return path.resolve()
    if not HUB_ID.fullmatch(pretrained):
        raise FamilyError(f"folder {path} does not exist ({key})")
    try:
        return hub_snapshot(pretrained)
    except NotAvailableLocally as err:
        raise FamilyError(f"{err} ({key})") from None


def resolve_folders(model_spec, family: Family, cache_dir: str | os.PathLike) -> dict[str, Path | None]:
    """Every folder key the family declares (`Family.pretrained_fields`) -> its folder, None where unset."""
    folders: dict[str, Path | None] = {}
    for field in family.pretrained_fields:
        value = getattr(model_spec, field, None)
        folders[field] = resolve_pretrained(value, cache_dir, f"model.{field}") if value else None
    return folders


def build_model(model_spec, cache_dir: str | os.PathLike, device, dtype_for_frozen: torch.dtype = torch.float32,
                zero3_config: Optional[dict] = None, folders: Optional[dict] = None):
    """The family's Built for this model spec: its folders resolved (unless given), then `family.build` (one
    process; training goes through dstune.startup.build_family, which orders the ranks). `zero3_config` (a ZeRO-3
    DeepSpeed JSON) is passed to families that build partitioned (`Family.builds_partitioned`); that build is then
    collective."""
    family = get_family(model_spec.family)
    folders = folders if folders is not None else resolve_folders(model_spec, family, cache_dir)
    if zero3_config is not None and family.builds_partitioned:
        return family.build(model_spec, folders, device, dtype_for_frozen, zero3_config=zero3_config)
    return family.build(model_spec, folders, device, dtype_for_frozen)


def partitioned_build_config(model_spec, ds_config: Optional[dict]) -> Optional[dict]:
    """The DeepSpeed JSON to build the trainable module partitioned with (ZeRO-3, a family that can, no quantized
    base: bitsandbytes weights cannot be partitioned), else None: loaded whole, one copy per process."""
    stage = (ds_config or {}).get("zero_optimization", {}).get("stage", 0)
    if stage != 3 or not get_family(model_spec.family).builds_partitioned:
        return None
    return None if getattr(model_spec, "base_precision", None) else ds_config
