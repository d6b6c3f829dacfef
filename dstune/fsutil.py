"""Atomic writes of files and folders: a reader (or a crash) sees the old content or the new, never half of it."""

from __future__ import annotations

import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path


def temporary_sibling(final: Path, label: str) -> Path:
    """A fresh hidden folder beside `final` (same filesystem, so os.rename into place is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        path = final.parent / f".{final.name}.{label}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            path.mkdir()  # honours the umask, unlike tempfile.mkdtemp's private 0700
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary folder beside {final}")


def publish_folder(finished: Path, final: Path) -> None:
    """Move a completely written folder to `final`. An older `final` is first renamed aside and deleted only once
    the new one is in place, so a crash leaves either the old folder or the new one, never a half-written one."""
    if final.exists():
        old = temporary_sibling(final, "replaced")
        old.rmdir()
        os.rename(final, old)
        os.rename(finished, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(finished, final)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def folder_written_atomically(final: Path, label: str = "writing"):
    """Yield a fresh folder beside `final` to write into; when the block completes it becomes `final`
    (publish_folder). On an error `final` is left as it was and the partial folder is removed."""
    work = temporary_sibling(final, label)
    try:
        yield work
        publish_folder(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
