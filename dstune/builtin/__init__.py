"""Built-in tiny models (`model.pretrained: builtin:NAME`), built offline from fixed configs and a fixed seed.

    ensure_builtin_model(name, cache_dir) -> Path

returns `cache_dir/builtin/<folder_name>/`, a normal diffusers pipeline folder that the family then loads through
the same `from_pretrained(folder, subfolder=...)` path as a user's checkpoint. The first call builds it; later
calls (any process, any run sharing the cache) reuse it. Building is safe under concurrency: one process builds
while the others wait on a file lock, the folder is written beside its final name and renamed into place, and only
a folder holding the completion marker (`dstune_builtin.json`, written last) is ever used; a leftover without it
is deleted and rebuilt. Change a build and you must bump its `folder_name` version, or old caches are reused; the
tiny-sd VAE trains on dstune.data.synthetic, so a change to how shapes are drawn is such a change too.

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

import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from dstune.builtin.common import BuiltinError, BuiltinModel  # noqa: F401 - BuiltinError is part of the API
from dstune.builtin.csm import TINY_CSM
from dstune.builtin.dia import TINY_DIA
from dstune.builtin.flow import TINY_FLOW, TINY_FLUX
from dstune.builtin.flux2 import TINY_FLUX2, TINY_FLUX2_DEV
from dstune.builtin.hunyuan_video15 import TINY_HUNYUAN_VIDEO15, TINY_HUNYUAN_VIDEO15_I2V
from dstune.builtin.ideogram4 import TINY_IDEOGRAM4
from dstune.builtin.krea2 import TINY_KREA2, TINY_KREA2_TURBO
from dstune.builtin.orpheus import TINY_ORPHEUS
from dstune.builtin.qwen_image import TINY_QWEN_IMAGE
from dstune.builtin.qwen_image_edit import TINY_QWEN_IMAGE_EDIT
from dstune.builtin.qwen_image_21 import TINY_QWEN_IMAGE_21
from dstune.builtin.sd import TINY_SD
from dstune.builtin.sdxl import TINY_SDXL
from dstune.builtin.tts import TINY_SPEECHT5, TINY_TTS_LM
from dstune.builtin.wan import TINY_WAN, TINY_WAN_A14B, TINY_WAN22_TI2V, TINY_WAN_I2V
from dstune.builtin.zimage import TINY_Z_IMAGE
from dstune.fsutil import temporary_sibling
from dstune.spec.section import BUILTIN_PREFIX

BUILTIN_MARKER = "dstune_builtin.json"


# ----------------------------------------------------------------------------------------- the cache protocol


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + name for name in sorted(BUILTIN_MODELS)]


def ensure_builtin_model(name: str, cache_dir: str | os.PathLike) -> Path:
    """The folder of built-in model `name` ("tiny-sd" or "builtin:tiny-sd") under `cache_dir`, built if needed."""
    key = name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else name
    if key not in BUILTIN_MODELS:
        raise BuiltinError(f"unknown built-in model '{BUILTIN_PREFIX}{key}'. Known built-in models: "
                           f"{', '.join(builtin_names())}.")
    model = BUILTIN_MODELS[key]
    root = Path(cache_dir).expanduser() / "builtin"
    final = root / model.folder_name
    if _is_complete(final, key):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BuiltinError(f"cannot create the model cache {root} ({err.strerror or err}); set output.cache_dir "
                           "to a writable folder") from None
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
        facts = model.build(work, needs=needs)
        marker = {"name": model.name, "folder": model.folder_name, "family": model.family,
                  "build_seconds": round(time.perf_counter() - started, 2), **facts}
        (work / BUILTIN_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(work, final)
        except OSError:
            if not _is_complete(final, model.name):  # lost a race only a lock-less filesystem allows: use theirs
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


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


BUILTIN_MODELS: dict[str, BuiltinModel] = {m.name: m for m in (
    TINY_SD, TINY_FLOW, TINY_FLUX, TINY_SDXL, TINY_TTS_LM, TINY_SPEECHT5, TINY_ORPHEUS, TINY_CSM, TINY_DIA, TINY_QWEN_IMAGE,
    TINY_QWEN_IMAGE_EDIT, TINY_Z_IMAGE, TINY_FLUX2, TINY_FLUX2_DEV, TINY_WAN, TINY_WAN_A14B,
    TINY_WAN_I2V, TINY_WAN22_TI2V,
    TINY_HUNYUAN_VIDEO15, TINY_HUNYUAN_VIDEO15_I2V, TINY_IDEOGRAM4, TINY_KREA2, TINY_KREA2_TURBO,
    TINY_QWEN_IMAGE_21)}
