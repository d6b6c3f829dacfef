"""Built-in tiny models (`model.pretrained: builtin:NAME`), built offline from fixed configs and a fixed seed.

    ensure_builtin_model(name, cache_dir) -> Path

returns `cache_dir/builtin/<folder_name>/`, a normal diffusers pipeline folder that the family then loads through
the same `from_pretrained(folder, subfolder=...)` path as a user's checkpoint. The first call builds it; later
calls (any process, any run sharing the cache) reuse it. Each model's card names its own built-ins (built by
dstune/models/<unit>/builtin*.py; dstune.registry lists the cards). Building is safe under concurrency: one process builds
while the others wait on a file lock, the folder is written beside its final name and renamed into place, and only
a folder holding the completion marker (`dstune_builtin.json`, written last) is ever used; a leftover without it
is deleted and rebuilt. Change a build and you must bump its `folder_name` version, or old caches are reused. What a
build trains (tiny-sd's VAE, on dstune.data.synthetic's shapes) is stored with dstune (dstune.builtin.trained): a
change to its training, or to how the shapes are drawn, is such a change once the stored part is regenerated.

builtin:tiny-sd (~0.8 M-parameter UNet, 32 px images, 16x16x4 latents) comes with a VAE that is actually trained
(a few hundred steps on coloured shapes, deterministic), because a random VAE decodes any latent to noise and a
demo run could never visibly learn. Its latents are nudged to look like a half-size image (the first three
channels follow the 2x2-averaged RGB), which makes them easy for a tiny UNet, and `scaling_factor` is 1/std of
the latents over the shapes set so the diffusion sees unit variance (each channel is also centred on 0). The
noise schedule has zero terminal SNR with v-prediction (see TINY_SD_SCHEDULER), which is what lets the colour
follow the prompt after a few hundred steps. The text encoder stays random: distinct captions still give
distinct embeddings, which is all a conditional demo needs.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from dstune.builtin.common import BuiltinError, BuiltinModel  # noqa: F401 - BuiltinError is part of the API
from dstune.fsutil import temporary_sibling
from dstune.memory.counts import BUILTIN_MARKER
from dstune import registry
from dstune.card import load
from dstune.spec.section import BUILTIN_PREFIX

BUILD_FACTS = ".build_facts.json"  # what a build in the builder process returns, beside the folder it wrote

# Every built-in model is built in a child process with ATen's kernels pinned to their AVX2 code path: a build
# initialises its modules with torch's random draws, and ATen's vectorised normal_ gives other values on its
# default path than on its AVX2 one (its AVX2 and AVX-512 paths agree). ATen is torch's own code, so the pin picks
# the same instructions on every x86 CPU with AVX2, Intel or AMD. What a build trains (a VAE, a codec's codebooks)
# depends on MKL's and oneDNN's kernels, which no pin makes the same across processors: those parts are stored with
# dstune (dstune.builtin.trained). So a built-in's bytes do not depend on the CPU, and neither do the losses and
# configs pinned to it (tests/unit/test_golden_losses.py runs its float64 trajectories under the same pin).
PINNED_ISA_ENV = {"ATEN_CPU_CAPABILITY": "avx2"}


# ----------------------------------------------------------------------------------------- the cache protocol


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + name for name in sorted(registry.builtin_names())]


def ensure_builtin_model(name: str, cache_dir: str | os.PathLike) -> Path:
    """The folder of built-in model `name` ("tiny-sd" or "builtin:tiny-sd") under `cache_dir`, built if needed."""
    key = name[len(BUILTIN_PREFIX) :] if name.startswith(BUILTIN_PREFIX) else name
    models = _builtin_models()
    if key not in models:
        raise BuiltinError(
            f"unknown built-in model '{BUILTIN_PREFIX}{key}'. Known built-in models: {', '.join(builtin_names())}."
        )
    model = models[key]
    # absolute: a built folder may name its own files by path (a processor's audio tokenizer), which must not depend
    # on the directory the build ran from
    root = Path(cache_dir).expanduser().resolve() / "builtin"
    final = root / model.folder_name
    if _is_complete(final, key):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BuiltinError(
            f"cannot create the model cache {root} ({err.strerror or err}); set output.cache_dir to a writable folder"
        ) from None
    with _exclusive(root / f".{model.folder_name}.lock"):
        if _is_complete(final, key):  # another process finished it while we waited for the lock
            return final
        if final.exists():  # no marker: a leftover we cannot trust; never used, replaced by a fresh build
            stale = temporary_sibling(final, "incomplete")
            os.rename(final, stale / "folder")
            shutil.rmtree(stale, ignore_errors=True)
        needs = {name: ensure_builtin_model(name, cache_dir) for name in model.needs}  # built first, once each
        _build_into(model, final, needs)
    return final


def _is_complete(folder: Path, key: str) -> bool:
    try:
        return json.loads((folder / BUILTIN_MARKER).read_text()).get("name") == key
    except (OSError, ValueError, AttributeError):
        return False


def _build_into(model: BuiltinModel, final: Path, needs: dict[str, Path]) -> None:
    work = temporary_sibling(final, "building")
    try:
        started = time.perf_counter()
        facts = (
            _build_in_pinned_process(model.name, work, needs)
            if model.pinned_process
            else model.build(work, needs=needs)
        )
        marker = {
            "name": model.name,
            "folder": model.folder_name,
            "family": model.family,
            "build_seconds": round(time.perf_counter() - started, 2),
            **facts,
        }
        (work / BUILTIN_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(work, final)
        except OSError:
            if not _is_complete(final, model.name):  # lost a race only a lock-less filesystem allows: use theirs
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pinned_child_env() -> dict[str, str]:
    """The environment of a child process under PINNED_ISA_ENV that imports this very dstune, however this process
    found it (installed, PYTHONPATH or a checkout): its package root first on PYTHONPATH."""
    here = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(part for part in (here, os.environ.get("PYTHONPATH", "")) if part)
    return {**os.environ, **PINNED_ISA_ENV, "PYTHONPATH": path}


def _build_in_pinned_process(name: str, work: Path, needs: dict[str, Path]) -> dict:
    """Build `name` into `work` in this process's pinned builder child (dstune.builtin.build --serve); its facts for
    the marker. BuiltinError with the child's last output when it fails."""
    request = {"name": name, "folder": str(work), "needs": {k: str(v) for k, v in needs.items()}}
    builder = _Builder.get()
    answer = builder.ask(request)
    if answer is None and builder.process.wait() == 0:  # it had just ended, idle: a fresh one takes the request
        builder = _Builder.get()
        answer = builder.ask(request)
    if answer is None or "built" not in answer:
        said = answer["error"] if answer else builder.last_output()
        if answer is None:
            _Builder.forget()  # it died: the next build starts a fresh one
        raise BuiltinError(f"building {BUILTIN_PREFIX}{name} failed:\n" + said)
    facts_file = work / BUILD_FACTS
    facts = json.loads(facts_file.read_text())
    facts_file.unlink()
    return facts


class _Builder:
    """The child process (python -m dstune.builtin.build --serve, under PINNED_ISA_ENV) that builds this process's
    built-ins, one request at a time, started on the first build and kept: a child's imports cost more than most
    tiny builds. It ends when this process closes its stdin (at exit, or with the process however it ends), or by
    itself when idle (dstune.builtin.build.IDLE_S)."""

    _running: Optional["_Builder"] = None
    _lock = threading.Lock()

    def __init__(self):
        self.owner = os.getpid()
        self.output = tempfile.TemporaryFile()  # what builds print: read back only when one fails
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dstune.builtin.build", "--serve"],
            env=pinned_child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.output,
            text=True,
        )

    @classmethod
    def get(cls) -> "_Builder":
        with cls._lock:
            running = cls._running
            # a forked child of this process (a data loader's worker) must not share the pipes; a dead builder
            # (stopped with its process group) is replaced
            if running is None or running.owner != os.getpid() or running.process.poll() is not None:
                cls._running = running = cls()
                atexit.register(running.close)
            return running

    @classmethod
    def forget(cls) -> None:
        with cls._lock:
            cls._running = None

    def ask(self, request: dict) -> Optional[dict]:
        """The child's answer to one request, None when it ended without one."""
        with self._lock:
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                line = self.process.stdout.readline()
            except (BrokenPipeError, OSError):
                return None
            except BaseException:  # a stop (Ctrl-C) mid-build: the build must not go on writing after we left
                self.process.kill()
                self.process.wait()
                raise
            return json.loads(line) if line else None

    def last_output(self) -> str:
        self.process.wait()
        self.output.seek(0)
        text = self.output.read().decode(errors="replace")[-3000:]
        return f"(the builder process ended, exit {self.process.returncode})\n{text}"

    def close(self) -> None:
        if self.owner != os.getpid() or self.process.poll() is not None:
            return
        try:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()


@contextmanager
def _exclusive(lock_path: Path):
    """An exclusive advisory lock (released by the OS if the holder dies). Without fcntl the atomic rename still
    keeps the cache correct; processes may then just build the same thing twice."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def __getattr__(name: str):
    """BUILTIN_MODELS, {name: BuiltinModel}: every card's (dstune.registry), loaded on first use, so that a unit's
    builtin module can import dstune.builtin's helpers without a cycle (loading them imports torch, as building
    does)."""
    if name != "BUILTIN_MODELS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    models = {model.name: model for model in map(load, registry.builtins().values())}
    globals()["BUILTIN_MODELS"] = models
    return models


def _builtin_models() -> dict[str, BuiltinModel]:
    return globals().get("BUILTIN_MODELS") or __getattr__("BUILTIN_MODELS")
