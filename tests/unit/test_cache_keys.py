"""Cache keys, atomic entry files and their checks (no process group)."""

from __future__ import annotations

import os

import pytest
import torch
from pydantic import ValidationError

from dstune.cache.entries import (
    Entry,
    entry_problem,
    folder_fingerprint,
    latent_key,
    plan_entries,
    read_entry,
    text_key,
    write_entry,
)
from dstune.cache.share import cache_folder as resolve_cache_dir
from dstune.data.index import SampleRecord
from dstune.spec.models import DataSpec

BASE = dict(
    sample_id="a/1.png", content_sha256="c" * 64, vae_fingerprint="v" * 64, resolution=32, flip=False, dtype="float32"
)


@pytest.mark.parametrize(
    "field,value",
    [
        ("sample_id", "a/2.png"),
        ("content_sha256", "d" * 64),
        ("vae_fingerprint", "w" * 64),
        ("resolution", 64),
        ("flip", True),
        ("dtype", "bfloat16"),
    ],
)
def test_latent_key_changes_with_everything_that_decides_the_content(field, value):
    assert latent_key(**BASE) == latent_key(**BASE)
    assert latent_key(**{**BASE, field: value}) != latent_key(**BASE)


def test_text_key_covers_caption_encoder_and_dtype():
    key = text_key("a red circle", "t" * 64, "float32")
    assert key != text_key("a red square", "t" * 64, "float32")
    assert key != text_key("a red circle", "u" * 64, "float32")
    assert key != text_key("a red circle", "t" * 64, "bfloat16")


def test_plan_entries_flip_dropout_and_order_do_not_depend_on_position():
    records = [SampleRecord(f"s/{i}", None, f"cap {i % 2}", 1) for i in range(3)]
    hashes = {r.sample_id: f"h{i}" for i, r in enumerate(records)}
    fps = {"vae": "v", "text": "t"}
    entries = plan_entries(records, hashes, fps, 32, True, 0.1, "float32", latents=True, text=True)
    assert [(e.sample_id, e.flip) for e in entries if e.kind == "latent"] == [
        (f"s/{i}", flip) for i in range(3) for flip in (False, True)
    ]
    assert sorted(e.caption for e in entries if e.kind == "text") == ["", "cap 0", "cap 1"]  # "" for dropout
    reordered = plan_entries(records[::-1], hashes, fps, 32, True, 0.1, "float32", latents=True, text=True)
    key_of = {(e.sample_id, e.flip, e.caption): e.key for e in entries}
    assert all(key_of[(e.sample_id, e.flip, e.caption)] == e.key for e in reordered)
    no_dropout = plan_entries(records, hashes, fps, 32, False, 0.0, "float32", latents=True, text=True)
    assert "" not in {e.caption for e in no_dropout} and not any(e.flip for e in no_dropout)


def test_folder_fingerprint_follows_content_not_mtime(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "w.safetensors").write_bytes(b"1234")
    first = folder_fingerprint(tmp_path)
    os.utime(tmp_path / "w.safetensors", (1, 1))
    assert folder_fingerprint(tmp_path) == first
    (tmp_path / "w.safetensors").write_bytes(b"1235")
    assert folder_fingerprint(tmp_path) != first


def _entry() -> tuple[Entry, dict]:
    entry = Entry("latent", "ab" + "0" * 62, "s/1", sample_id="s/1")
    return entry, {"latent_mean": torch.randn(4, 4, 4), "latent_std": torch.rand(4, 4, 4)}


def test_write_entry_is_atomic_and_round_trips(tmp_path):
    entry, tensors = _entry()
    path = tmp_path / entry.relpath
    write_entry(path, entry, tensors)
    assert entry_problem(path, entry, full=True) is None
    assert all(torch.equal(read_entry(path)[k], tensors[k]) for k in tensors)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_failed_write_leaves_no_file(tmp_path):
    entry, tensors = _entry()
    with pytest.raises(KeyError):
        write_entry(tmp_path / entry.relpath, entry, {"latent_mean": tensors["latent_mean"]})
    assert not list(tmp_path.rglob("*.safetensors")) and not list(tmp_path.rglob(".tmp-*"))


def test_entry_problem_detects_missing_truncated_corrupt_and_foreign(tmp_path):
    entry, tensors = _entry()
    path = tmp_path / entry.relpath
    assert entry_problem(path, entry, full=False) == "missing"
    write_entry(path, entry, tensors)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    assert "truncated" in entry_problem(path, entry, full=False)
    path.write_bytes(data[:5])
    assert entry_problem(path, entry, full=False) is not None
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    path.write_bytes(bytes(flipped))
    assert entry_problem(path, entry, full=False) is None  # the quick check cannot see flipped bytes...
    assert "checksum" in entry_problem(path, entry, full=True)  # ...the full one does
    other = Entry("latent", "ab" + "1" * 62, "s/2", sample_id="s/2")
    write_entry(path, other, tensors)
    assert entry_problem(path, entry, full=False) == "written for another key"


def test_cache_dir_placeholders_and_default():
    assert resolve_cache_dir("/c/{node}/{rank}", ".x", 3, 1) == resolve_cache_dir("/c/1/3", ".x", 0, 0)
    assert str(resolve_cache_dir(None, "/cache", 0, 0)) == "/cache/encoded"


def test_latent_cache_with_random_crop_is_a_clear_spec_error():
    with pytest.raises(ValidationError, match="center_crop: true"):
        DataSpec(center_crop=False, cache={"latents": True})
    DataSpec(center_crop=False, cache={"text_embeddings": True})  # captions do not depend on the crop
