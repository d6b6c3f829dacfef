"""What a dataset folder holds besides what the layout looked for, so that a message can say what to change:
captions saved under another extension (data.caption_extension), and the files of a folder that holds no usable
sample (video files given to an image model, audio files given to a video model, ...). Torch-free; lists names only.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

CAPTION_EXTENSIONS = (".txt", ".caption", ".captions", ".cap", ".text", ".prompt", ".json", ".tags")
SURVEY_LIMIT = 100_000  # files looked at, at most: a survey must stay quick on a huge wrong folder


def caption_extensions_beside(paths: list[str], looked_for: str) -> Counter:
    """For images without a `looked_for` caption: how many have a caption file under another known extension
    beside them, by extension (one folder listing per folder)."""
    by_folder: dict[str, list[str]] = {}
    for path in paths:
        folder, name = os.path.split(path)
        by_folder.setdefault(folder, []).append(os.path.splitext(name)[0])
    found: Counter = Counter()
    for folder, stems in by_folder.items():
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        beside: dict[str, set[str]] = {}
        for name in names:
            stem, extension = os.path.splitext(name)
            if extension.lower() in CAPTION_EXTENSIONS and extension.lower() != looked_for.lower():
                beside.setdefault(stem, set()).add(extension)
        for stem in stems:
            for extension in beside.get(stem, ()):
                found[extension] += 1
    return found


def caption_hint(paths: list[str], looked_for: str) -> str:
    """' ; N of them have a .caption file beside them: set data.caption_extension: .caption' or ''."""
    found = caption_extensions_beside(paths, looked_for)
    if not found:
        return ""
    extension, count = found.most_common(1)[0]
    return (
        f"; {count} of them have a {extension} file beside them: if those are the captions, set "
        f"data.caption_extension: {extension}"
    )


def extensions_under(root: Path) -> Counter:
    """File extensions (lower case, '' for none) of the files under `root`, hidden ones left out."""
    found: Counter = Counter()
    for _, folders, files in os.walk(root):
        folders[:] = [f for f in folders if not f.startswith(".")]
        for name in files:
            if not name.startswith("."):
                found[os.path.splitext(name)[1].lower()] += 1
        if sum(found.values()) >= SURVEY_LIMIT:
            break
    return found


def found_text(found: Counter) -> str:
    """'12 files: 10 .mp4, 2 .txt' or 'no files at all'."""
    total = sum(found.values())
    if not total:
        return "no files at all"
    ranked = sorted(found.items(), key=lambda item: (-item[1], item[0]))[:6]
    kinds = ", ".join(f"{count} {extension or '(no extension)'}" for extension, count in ranked)
    more = ", ..." if len(found) > 6 else ""
    return f"{total} file{'s' if total != 1 else ''}: {kinds}{more}"
