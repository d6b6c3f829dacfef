"""The Hugging Face libraries as dstune uses them: quiet while loading and saving, and never downloading."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")  # "name" or "owner/name"


class NotAvailableLocally(ValueError):
    """A hub id that is not in the local Hugging Face cache (dstune never downloads)."""


def hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as err:  # noqa: BLE001 - hub raises many types (not cached, bad id); all mean "not usable here"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise NotAvailableLocally(
            f"'{repo_id}' is not a local folder and not in the local Hugging Face cache ({reason}). dstune never "
            f"downloads: run `hf download {repo_id}` (or `huggingface-cli download {repo_id}`) first, or set "
            "model.pretrained to a local folder."
        ) from None


@contextmanager
def quiet_hf_libraries():
    """Silence transformers/diffusers warnings and progress bars for the duration: importing the diffusers
    pipelines warns about torchvision's absence (irrelevant here), and save_pretrained draws progress bars into
    training logs. Errors still show."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    saved = [
        (lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in (transformers_logging, diffusers_logging)
    ]
    for lib, _, _ in saved:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, verbosity, bars in saved:
            lib.set_verbosity(verbosity)
            if bars:
                lib.enable_progress_bar()
