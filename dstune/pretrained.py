"""`model.pretrained` (and a family's other folder keys, such as `model.codec_pretrained`) -> local folders.

A `builtin:` name is built into the cache if needed (dstune.builtin), an existing folder is used as it is, and
anything else is looked up as a hub id in the local Hugging Face cache only: dstune never downloads. Families
receive the resolved folders and never build a built-in model themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def build_model(model_spec, cache_dir: str | os.PathLike, device, dtype_for_frozen: torch.dtype = torch.float32):
    """The family's Built for this model spec: its folders resolved, then `family.build` (one process; training
    goes through dstune.startup.build_family, which orders the ranks)."""
    family = get_family(model_spec.family)
    return family.build(model_spec, resolve_folders(model_spec, family, cache_dir), device, dtype_for_frozen)
