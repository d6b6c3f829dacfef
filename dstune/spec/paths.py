"""One rule for relative paths in a spec, applied once, when the spec is loaded (dstune.spec.load):

  - a relative path written in the spec file is relative to the spec file's folder (a spec, its DeepSpeed JSON and
    its data can move together, and the run does not depend on where it is launched from);
  - a relative path given on the command line (`--set KEY=PATH`) is relative to the current directory, like any
    other command-line path;
  - data.control_dir is relative to data.path (`../source`: the folder beside the targets), wherever data.path is;
  - output.dir's default `runs/dstune` is relative to the current directory; output.cache_dir's default is the
    user's cache folder (absolute: dstune.spec.models.user_cache_dir).

Keys that may also name a Hugging Face hub id (model.pretrained and the other model folders) follow the rule when
the spec's folder holds that path; otherwise they are left as written (a hub id, or a folder under the current
directory, with a warning). Absolute paths, `~/...` and `builtin:` names are never changed.

A relative path that names something under the current directory but not under the spec's folder, or different
things under both, gets a warning saying which one is used and how to write it so that nothing is left to guess.
Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from dstune.spec.section import BUILTIN_PREFIX

# Keys that always name a local file or folder ("*": every item of a list).
LOCAL_PATH_KEYS = (
    "data.path",
    "data.sets.*.path",
    "data.eval.path",
    "data.cache.dir",
    "output.dir",
    "output.cache_dir",
    "deepspeed.config",
    "deepspeed.offload_optimizer.nvme_path",
    "deepspeed.offload_param.nvme_path",
    "sample.control_images.*",
    "sample.control_images.*.*",  # a prompt's several references (the multi-image edit models)
    "sample.voice_prompts.*",
    "model.training_adapter",
    "model.transformer_file",
)
# Keys that name a local folder or file, or a Hugging Face hub id ("org/name" reads as a relative path too).
MODEL_PATH_KEYS = (
    "model.pretrained",
    "model.base_pipeline",
    "model.codec_pretrained",
    "model.vocoder",
    "model.speaker_embeddings",
    "sample.pretrained",
)


def _is_relative_path(value: Any) -> bool:
    return (
        isinstance(value, str)
        and value.strip() != ""
        and not value.startswith(BUILTIN_PREFIX)
        and not value.startswith("~")
        and not Path(value).is_absolute()
    )


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _entries(data: dict, pattern: str) -> list[tuple[str, dict | list, Any]]:
    """(dotted key, its container, key or index in it) for each place the pattern names in the raw spec data."""
    found = []

    def walk(node: Any, parts: list[str], prefix: str) -> None:
        head, rest = parts[0], parts[1:]
        if head == "*":
            items = list(enumerate(node)) if isinstance(node, list) else []
        else:
            items = [(head, node[head])] if isinstance(node, dict) and head in node else []
        for key, child in items:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if rest:
                walk(child, rest, dotted)
            else:
                found.append((dotted, node, key))

    walk(data, pattern.split("."), "")
    return found


def rebase_relative_paths(
    data: dict,
    spec_path: str,
    from_command_line: Callable[[str], bool],
    warn: Callable[[str, str], None],
    cwd: Path | None = None,
) -> None:
    """Rewrite, in place, each relative path written in the spec file to the path from the spec's folder (absolute),
    and each `--set deepspeed.config` to the path from the current directory. `from_command_line(key)`: whether
    --set gave that key (or a section above it); `warn(key, message)` reports an ambiguity."""
    cwd = Path.cwd() if cwd is None else cwd
    spec_dir = (cwd / Path(spec_path).parent).resolve()
    for pattern in LOCAL_PATH_KEYS + MODEL_PATH_KEYS:
        for key, container, slot in _entries(data, pattern):
            value = container[slot]
            if not _is_relative_path(value):
                continue
            if from_command_line(key):
                if pattern == "deepspeed.config":  # the one key dstune itself used to take from the spec's folder
                    container[slot] = os.path.normpath(cwd / value)
                continue
            if spec_dir == cwd.resolve():
                continue  # both rules name the same place: the value stays as written
            container[slot] = _from_spec_folder(key, value, spec_dir, cwd, pattern in MODEL_PATH_KEYS, warn)


def _from_spec_folder(
    key: str, value: str, spec_dir: Path, cwd: Path, may_be_hub_id: bool, warn: Callable[[str, str], None]
) -> str:
    in_spec_dir, in_cwd = spec_dir / value, cwd / value
    rebased = os.path.normpath(in_spec_dir)
    if in_spec_dir.exists():
        if in_cwd.exists() and not _same(in_spec_dir, in_cwd):
            warn(
                key,
                f"{value!r} names {rebased} (from the spec file's folder, which is what is used) and also "
                f"{os.path.normpath(in_cwd)} under the current directory; a relative path in a spec is taken "
                "from the spec's folder. Write the path you mean as an absolute path to make it explicit.",
            )
        return rebased
    if in_cwd.exists():
        if may_be_hub_id:
            warn(
                key,
                f"{value!r} is not under the spec file's folder ({spec_dir}), so it is taken from the current "
                f"directory: {os.path.normpath(in_cwd)}. Write it relative to the spec's folder or as an "
                "absolute path, so the spec means the same from any directory.",
            )
            return value
        warn(
            key,
            f"{value!r} is taken from the spec file's folder: {rebased}, which does not exist; the current "
            f"directory has {os.path.normpath(in_cwd)}. To use that one, write its absolute path (or "
            f"{os.path.relpath(in_cwd, spec_dir)!r}, relative to the spec's folder).",
        )
    return value if may_be_hub_id else rebased
