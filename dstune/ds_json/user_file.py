"""The user's own DeepSpeed JSON (`deepspeed.config`): where it is and reading it strictly (plain JSON, no duplicate
keys, as DeepSpeed loads it), with errors that name the file and line. dstune.ds_json.fill_spec fills unset spec keys
from it before the plan; dstune.ds_json.merge merges it into the compiled JSON after it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dstune.spec.load import SpecError, SpecIssue, SpecSource


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)  # DeepSpeed loads files with dict_raise_error_on_duplicate_keys too
        seen[key] = value
    return seen


def user_config_path(config: str, source: SpecSource) -> Path:
    """`deepspeed.config` is relative to the spec file's folder (so a spec and its JSON can move together)."""
    path = Path(config).expanduser()
    return path if path.is_absolute() else Path(source.path).parent / path


def load_user_ds_config(path: Path, source: SpecSource) -> tuple[dict, str]:
    """Read the JSON object; raise SpecError naming the file (and line) when it is missing or not JSON."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(
            [
                source.issue(
                    "deepspeed.config",
                    f"DeepSpeed config file not found: {path} (a relative path is taken from the spec file's folder)",
                )
            ]
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError([source.issue("deepspeed.config", f"cannot read the DeepSpeed config {path}: {err}")]) from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        raise SpecError(
            [
                SpecIssue(
                    "",
                    f"not valid JSON: {err.msg} (column {err.colno}); DeepSpeed configs for dstune "
                    "are plain JSON, without comments",
                    f"{path}:{err.lineno}",
                )
            ]
        ) from None
    except _DuplicateKey as err:
        line = _last_line_of_key(text, err.key)
        raise SpecError(
            [
                SpecIssue(
                    err.key,
                    "appears twice in the same object; DeepSpeed refuses duplicate keys",
                    f"{path}:{line}" if line else str(path),
                )
            ]
        ) from None
    if not isinstance(data, dict):
        raise SpecError([SpecIssue("", "a DeepSpeed config must be a JSON object ({...})", str(path))])
    return data, text


def _last_line_of_key(text: str, key: str) -> int | None:
    found = list(re.finditer(rf'"{re.escape(key)}"\s*:', text))
    return text.count("\n", 0, found[-1].start()) + 1 if found else None
