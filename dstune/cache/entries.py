"""The latent / text-embedding cache: what an entry is, its key, and how it is written and checked.

An entry is one safetensors file holding what the frozen encoders make of one thing: the VAE posterior (mean, std)
of one sample in one orientation, or the text encoder's hidden states of one caption. Its file name is its key, a
sha256 over everything that decides its content (see `latent_key` / `text_key`); nothing is looked up by position,
so a reordered, grown or edited dataset can never pair a latent with the wrong caption, and changing the
resolution, the flip, the dtype or an encoder's weights simply misses the cache.

Files are written to a temporary name beside the final one and renamed into place (`write_entry`), so a reader sees
either no file or a complete one; a killed build leaves at most stray `.tmp-*` files, which are never read.
The sharded build, the barrier and the summary are in dstune.cache.latents and dstune.cache.share.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CACHE_FORMAT = "1"  # bump when the entry layout changes: every key changes with it
_READ_CHUNK_BYTES = 1 << 20
_KEY_META, _CHECKSUM_META, _NAME_META = "dstune_cache_key", "dstune_checksum", "dstune_name"
LATENT_TENSORS = ("latent_mean", "latent_std")
TEXT_TENSORS = ("encoder_hidden_states",)


@dataclass(frozen=True)
class Entry:
    kind: str  # "latent" or "text"
    key: str  # sha256 hex of the key fields
    name: str  # for people: "shapes/000003", "shapes/000003 (flipped)", or the caption
    sample_id: str | None = None  # latent entries
    flip: bool = False  # latent entries
    size: tuple[int, int] | None = None  # latent entries with data.buckets: the bucket's (width, height)
    caption: str | None = None  # text entries
    # text entries: the family's TEXT_CACHE_TENSORS (empty: TEXT_TENSORS); latent entries: the family's latent
    # extras stored after LATENT_TENSORS (dstune.families.base.LatentExtras)
    tensors: tuple[str, ...] = ()

    @property
    def relpath(self) -> str:
        return f"{self.kind}/{self.key[:2]}/{self.key}.safetensors"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return LATENT_TENSORS + self.tensors if self.kind == "latent" else (self.tensors or TEXT_TENSORS)


# ------------------------------------------------------------------------------------------------------ keys


def bytes_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_READ_CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_fingerprint(folder: str | os.PathLike) -> str:
    """sha256 over every file of a model component folder (relative name + content): weights and config alike.

    Content, not (path, size, mtime): nodes holding their own copy of a model must agree on the key, and a copy or
    re-download (new mtime, same bytes) must not invalidate a cache that is still right. Hashing reads the weights
    once per run (about 1 s per GB)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder).as_posix()}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def key_of(fields: dict) -> str:
    return bytes_sha256(json.dumps({"format": CACHE_FORMAT, **fields}, sort_keys=True).encode())


def latent_key(
    sample_id: str,
    content_sha256: str,
    vae_fingerprint: str,
    resolution: int,
    flip: bool,
    dtype: str,
    size: tuple[int, int] | None = None,
) -> str:
    """The key of one sample's latent: identity, image content, VAE weights, and the preprocessing (resolution,
    the bucket's (width, height) with data.buckets, the centre crop that is the only one cached, the flip, the
    dtype the VAE runs in). Without a bucket the key is what it was before buckets existed."""
    fields = {
        "kind": "latent",
        "sample_id": sample_id,
        "content": content_sha256,
        "vae": vae_fingerprint,
        "resolution": int(resolution),
        "crop": "center",
        "flip": bool(flip),
        "dtype": dtype,
    }
    if size is not None:
        fields["size"] = [int(size[0]), int(size[1])]
    return key_of(fields)


def text_key(caption: str, text_fingerprint: str, dtype: str, tensors: tuple[str, ...] = TEXT_TENSORS) -> str:
    """The key of one caption's embedding: the text itself (so an edited caption misses), the tokenizers and text
    encoders (config and weights), the dtype, and which tensors the family stores (its TEXT_CACHE_TENSORS; with
    the default ones the key is what it was before families chose them)."""
    fields = {"kind": "text", "caption": caption, "text_encoder": text_fingerprint, "dtype": dtype}
    if tuple(tensors) != TEXT_TENSORS:
        fields["tensors"] = list(tensors)
    return key_of(fields)


def plan_entries(
    records,
    content_hashes: dict[str, str],
    fingerprints: dict[str, str],
    resolution: int,
    random_flip: bool,
    caption_dropout: float,
    dtype: str,
    latents: bool,
    text: bool,
    sizes: dict[str, tuple[int, int]] | None = None,
    text_tensors: tuple[str, ...] = TEXT_TENSORS,
    latent_tensors: tuple[str, ...] = (),
    extra_captions: tuple[str, ...] = (),
) -> list[Entry]:
    """Every entry a run reads, in a fixed order (records in index order, then captions sorted): the same list on
    every rank and for every world size, which is what makes the split and the chunks deterministic.
    `sizes`: sample_id -> bucket (width, height) with data.buckets (dstune.data.buckets.sample_buckets);
    `extra_captions`: text entries beside the records' captions (the sample prompts, dstune.text_once)."""
    entries: list[Entry] = []
    if latents:
        for record in records:
            if record.sample_id not in content_hashes:
                continue  # unreadable file (data.skip_bad_files): reported by the caller
            for flip in (False, True) if random_flip else (False,):
                size = sizes.get(record.sample_id) if sizes else None
                key = latent_key(
                    record.sample_id,
                    content_hashes[record.sample_id],
                    fingerprints["vae"],
                    resolution,
                    flip,
                    dtype,
                    size,
                )
                name = f"{record.sample_id} (flipped)" if flip else record.sample_id
                entries.append(
                    Entry(
                        "latent",
                        key,
                        name,
                        sample_id=record.sample_id,
                        flip=flip,
                        size=size,
                        tensors=tuple(latent_tensors),
                    )
                )
    if text:
        captions = {record.caption for record in records} | set(extra_captions)
        if caption_dropout > 0:
            captions.add("")
        for caption in sorted(captions):
            entries.append(
                Entry(
                    "text",
                    text_key(caption, fingerprints["text"], dtype, text_tensors),
                    repr(caption),
                    caption=caption,
                    tensors=tuple(text_tensors),
                )
            )
    return entries


# -------------------------------------------------------------------------------------------- write and check


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_entry(path: str | os.PathLike, entry: Entry, tensors: dict[str, torch.Tensor]) -> None:
    """Write atomically: a temporary file in the same folder, flushed to disk, then renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensors[name].detach().cpu().contiguous() for name in entry.tensor_names}
    metadata = {_KEY_META: entry.key, _CHECKSUM_META: _checksum(tensors), _NAME_META: entry.name[:200]}
    temporary = path.parent / f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        save_file(tensors, str(temporary), metadata=metadata)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def entry_problem(path: str | os.PathLike, entry: Entry, full: bool) -> str | None:
    """None when the file at `path` is a complete entry for `entry`, else why not.

    Quick (full=False): it exists, its header parses, its size is exactly what the header promises (catches
    truncation) and it carries this key and tensor names. Full: also loads the tensors and compares their checksum
    (catches flipped bytes)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return f"cannot stat ({err.strerror or err})"
    try:
        with open(path, "rb") as handle:
            header_bytes = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(header_bytes)) if header_bytes < size else None
        if not isinstance(header, dict):
            return "truncated header"
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        if size != 8 + header_bytes + max(ends, default=0):
            return f"truncated or padded ({size} bytes, header promises {8 + header_bytes + max(ends, default=0)})"
        metadata = header.get("__metadata__") or {}
        if metadata.get(_KEY_META) != entry.key or sorted(k for k in header if k != "__metadata__") != sorted(
            entry.tensor_names
        ):
            return "written for another key"
        if full:
            tensors = load_file(str(path))
            if _checksum(tensors) != metadata.get(_CHECKSUM_META):
                return "checksum mismatch (corrupt data)"
    except (OSError, ValueError, KeyError, TypeError, struct.error, RuntimeError) as err:
        return f"unreadable ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    return None


def read_entry(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return load_file(str(path))
