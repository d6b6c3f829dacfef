"""Built-in models are built in one pinned child per process (dstune.builtin.build --serve), kept for the next
build: a fresh clone builds its 35 built-ins in seconds instead of paying a child's imports for each. What a user
relies on: the same bytes as a build in a process of its own, and a failed build reported as the model's own error,
the next build unaffected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import dstune.builtin as builtin
from dstune.builtin import BUILD_FACTS, BuiltinError, ensure_builtin_model, pinned_child_env

MODELS = ("tiny-dia", "tiny-wan")  # a transformers build, then a diffusers one in the same child; both cheap


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix in (".safetensors", ".bin", ".model")
    }


def test_builds_in_one_child_equal_builds_in_their_own(tmp_path):
    folders = [ensure_builtin_model(name, tmp_path / "kept") for name in MODELS]
    builder = builtin._Builder.get()
    assert builder.process.poll() is None  # kept for the next build
    name, folder = MODELS[-1], folders[-1]  # built after another one in the same child
    own = tmp_path / "own" / name
    own.mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "dstune.builtin.build", name, str(own), "{}"],
        env=pinned_child_env(),
        check=True,
        capture_output=True,
    )
    marker = json.loads((folder / builtin.BUILTIN_MARKER).read_text())
    facts = json.loads((own / BUILD_FACTS).read_text())
    assert facts and facts.items() <= marker.items()  # the same build facts (parameter counts)
    weights = _files(folder)
    assert weights and weights == _files(own)


def test_a_failed_build_names_the_model_and_the_next_build_works(tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the build writes its folder")
    builder = builtin._Builder.get()
    with pytest.raises(BuiltinError, match=r"(?s)building builtin:tiny-dia failed:\n.*NotADirectoryError"):
        builtin._build_in_pinned_process("tiny-dia", blocked / "work", {})
    assert builtin._Builder.get() is builder  # the child answered: it is kept
    assert (ensure_builtin_model("tiny-dia", tmp_path / "cache") / builtin.BUILTIN_MARKER).is_file()


def test_an_idle_builder_exits_and_a_request_it_missed_goes_to_a_new_one(tmp_path, monkeypatch):
    idle = subprocess.Popen(
        [sys.executable, "-c", "from dstune.builtin.build import serve; serve(idle_s=0.5)"],
        env=pinned_child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert idle.wait(timeout=60) == 0  # nothing asked: it left by itself, its stdin still open
    idle.stdin.close()

    # a builder that reads the request and ends without an answer, as one ending idle at that moment does
    ending = builtin._Builder.__new__(builtin._Builder)
    ending.owner, ending.output = builtin.os.getpid(), None
    ending.process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    monkeypatch.setattr(builtin._Builder, "_running", ending)
    folder = ensure_builtin_model("tiny-dia", tmp_path)
    assert (folder / builtin.BUILTIN_MARKER).is_file() and builtin._Builder._running is not ending
