"""What every model family shares: the contract the engine, loop and export call, and the helpers behind it.

The contract. A family is a module (registered in `dstune.families.FAMILY_BUILDERS`) with these functions:

    build(model_spec, cache_dir, device, dtype_for_frozen) -> Built
        Resolve `model_spec.pretrained` (folder, hub id already in the local cache, or `builtin:NAME`), load every
        component with `from_pretrained(folder, subfolder=...)`, and return a Built. Raises FamilyError (a
        ValueError) naming the folder and what is wrong. Never downloads anything.
    encode_batch(built, batch, dtype) -> dict
        Everything the loss needs from a collated batch, computed by the frozen parts under torch.no_grad.
        Deterministic (no random draws), so the result could be cached.
    loss(built, trainable_forward, encoded, seed, step) -> scalar tensor
        The training loss, the mean over the micro batch. `trainable_forward` is the DeepSpeed engine in training
        (a bare module in tests). Every random draw comes from `sample_generator(seed, step, index, purpose)`.
    sample(built, trainable_module, prompts, sample_spec, resolution) -> list[PIL.Image]
    save_grid(images, prompts, path)
    export(built, state_dict, out_dir, pretrained_folder=None)
        Write a complete folder the ecosystem loads (for diffusion: a diffusers pipeline) with the trained weights;
        atomically (see `publish_folder`).

A Built holds at least `trainable` (the one nn.Module DeepSpeed wraps: train mode, requires_grad on), `folder`
(the resolved pretrained folder) and `device`; its frozen companions are built outside any zero.Init, are in
eval mode with requires_grad off, and must never be passed to deepspeed.initialize. `frozen` (a property) maps
each companion's attribute name to the module: "vae" for the VAE, every other entry a text encoder.

The cache hooks (dstune.cache_build; for data.cache.text_embeddings). A family module defines

    TEXT_CACHE_FOLDERS: tuple[str, ...]   the pipeline subfolders that decide a caption's embedding (encoders and
                                          tokenizers); their content fingerprint is part of every text entry's key
    TEXT_CACHE_TENSORS: tuple[str, ...]   the tensor names stored per caption, which are the batch keys encode_batch
                                          reads as they are when present (sd: encoder_hidden_states; sdxl: also
                                          text_embeds, the pooled embedding)
    cache_text_tensors(built, captions) -> dict[str, Tensor]   exactly those names, each (len(captions), ...),
                                          deterministic, computed by the frozen text encoders

Latents need no hook: every family's VAE posterior is stored as latent_mean / latent_std. With cached text the
encoders in `frozen` other than "vae" are moved off the accelerator (and back for sampling). A family without the
hooks cannot cache text (sd, which predates them, gets its own: text_encoder + tokenizer, encoder_hidden_states).
Batches also carry each sample's `original_size` and `crop_top_left` (dstune.data.images.crop_fields), from the
image loader and from the cache alike, for families that condition on them (sdxl).

Randomness. A sample's noise, timestep and the like depend only on (run seed, optimizer step, dataset index,
purpose): never on the global RNG, the rank, the micro-batch split or the device. So 1 rank x 4 accumulation
steps and 2 ranks x 2 draw the same noise for the same sample at the same step, and CPU and GPU runs agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Sequence

import torch


class FamilyError(ValueError):
    """A model that cannot be used: the message names the folder or model, what is wrong and how to fix it."""


# ------------------------------------------------------------------------------------------------ per-sample RNG


def sample_seed(seed: int, step: int, index: int, purpose: str) -> int:
    """A 63-bit seed that is a pure function of its arguments (blake2b, not Python's salted hash())."""
    text = f"dstune/{purpose}/{int(seed)}/{int(step)}/{int(index)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)


def sample_generator(seed: int, step: int, index: int, purpose: str) -> torch.Generator:
    """The CPU generator for one random draw of one sample: `seed` is the run's train.seed, `step` the optimizer
    step (shared by all micro batches of that step), `index` the sample's dataset index, `purpose` names the draw
    ("noise", "timestep", ...) so that adding a draw never shifts the others. Draws are made on the CPU and then
    moved, because CUDA generators give different streams than CPU ones."""
    return torch.Generator(device="cpu").manual_seed(sample_seed(seed, step, index, purpose))


def per_sample_randn(shape: Sequence[int], seed: int, step: int, indices: Iterable[int], purpose: str) -> torch.Tensor:
    """Standard normal float32 tensor (len(indices), *shape) on the CPU; row i from sample indices[i]'s generator."""
    rows = [torch.randn(tuple(shape), generator=sample_generator(seed, step, i, purpose)) for i in indices]
    return torch.stack(rows)


def per_sample_randint(high: int, seed: int, step: int, indices: Iterable[int], purpose: str) -> torch.Tensor:
    """LongTensor (len(indices),) on the CPU, uniform in [0, high), one draw per sample's own generator."""
    draws = [torch.randint(0, high, (1,), generator=sample_generator(seed, step, i, purpose)) for i in indices]
    return torch.cat(draws)


# -------------------------------------------------------------------------------------------- pipeline folders

MODEL_INDEX = "model_index.json"
_HUB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")  # "name" or "owner/name"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pt", ".pth", ".msgpack", ".h5", ".onnx", ".pb", ".gguf")


def read_model_index(folder: Path) -> dict:
    """The parsed model_index.json of a diffusers pipeline folder, or FamilyError saying why not."""
    path = folder / MODEL_INDEX
    if not path.is_file():
        raise FamilyError(
            f"{folder}: no {MODEL_INDEX}, so this is not a diffusers pipeline folder. Give a folder written by "
            "`pipeline.save_pretrained(...)` (model_index.json plus one subfolder per component), a hub id that is "
            "already downloaded, or a built-in model (builtin:tiny-sd).")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FamilyError(f"{path}: cannot read it as JSON ({err})") from None
    if not isinstance(index, dict):
        raise FamilyError(f"{path}: expected a JSON object, found {type(index).__name__}")
    return index


def resolve_pretrained(pretrained: str, cache_dir: str | os.PathLike) -> Path:
    """`model.pretrained` -> a local folder: a `builtin:` name is built into the cache if needed, an existing path
    is used as is, anything else is looked up as a hub id in the local Hugging Face cache only (never downloaded)."""
    if pretrained.startswith("builtin:"):
        from dstune.families.tiny import ensure_builtin_model

        return ensure_builtin_model(pretrained, cache_dir)
    path = Path(pretrained).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FamilyError(f"{path} is a file; model.pretrained must be a diffusers pipeline folder "
                              "(single-file .safetensors/.ckpt checkpoints are not supported: convert them first)")
        return path.resolve()
    if not _HUB_ID.fullmatch(pretrained):
        raise FamilyError(f"folder {path} does not exist (model.pretrained)")
    return _hub_snapshot(pretrained)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as err:  # noqa: BLE001 - hub raises many types (not cached, bad id); all mean "not usable here"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise FamilyError(
            f"'{repo_id}' is not a local folder and not in the local Hugging Face cache ({reason}). dstune never "
            f"downloads: run `hf download {repo_id}` (or `huggingface-cli download {repo_id}`) first, or set "
            "model.pretrained to a local diffusers pipeline folder.") from None


def copy_component(source: Path, target: Path) -> None:
    """Copy one component subfolder, following symlinks (hub cache snapshots are symlinks into blobs).

    Only the weights `from_pretrained` loads by default are copied: files without a variant infix
    (`model.safetensors`, `model-00001-of-00002.safetensors`, not `model.fp16.safetensors`), and of those only the
    safetensors when there are any. A component holding only variant files is copied whole."""
    files = [p for p in sorted(source.iterdir()) if p.is_file()]
    weights = [p for p in files if p.name.endswith(WEIGHT_SUFFIXES)]
    default = [p for p in weights if len(p.name.split(".")) == 2]
    if any(p.suffix == ".safetensors" for p in default):
        default = [p for p in default if p.suffix == ".safetensors"]
    keep = [p for p in files if p not in weights] + (default or weights)
    target.mkdir(parents=True, exist_ok=True)
    for path in keep:
        shutil.copy2(path, target / path.name)
    for sub in sorted(p for p in source.iterdir() if p.is_dir()):
        shutil.copytree(sub, target / sub.name, dirs_exist_ok=True)


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



def read_component_config(folder: Path, name: str) -> dict:
    """`folder/name/config.json` of a pipeline component; FamilyError naming the file when it is not JSON."""
    path = folder / name / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FamilyError(f"{path}: cannot read it as JSON ({err})") from None


def export_pipeline_folder(source: Path, out_dir, trained_name: str, trained, finish=None) -> Path:
    """Write a complete diffusers pipeline folder at `out_dir`: the trained component `trained_name` (a module,
    saved as safetensors) plus every other component `source`'s model_index.json lists, copied unchanged.
    `finish(work_folder)` may adjust the copy before it is published (sd: the scheduler's prediction type).
    Written beside `out_dir` and renamed into place, replacing an older export only once complete."""
    index = read_model_index(source)
    out = Path(out_dir)
    work = temporary_sibling(out, "exporting")
    try:
        for name, entry in index.items():
            listed = isinstance(entry, list) and len(entry) == 2 and entry[1] is not None
            if listed and name != trained_name and (source / name).is_dir():
                copy_component(source / name, work / name)
        shutil.copy2(source / MODEL_INDEX, work / MODEL_INDEX)
        with quiet_hf_libraries():
            trained.save_pretrained(work / trained_name, safe_serialization=True)
        if finish is not None:
            finish(work)
        publish_folder(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out

# ------------------------------------------------------------------------------------------------------ grids

_GRID_CELL_PX = 192  # small models render 32-px images; scale them up (nearest) so they can be seen


def save_grid(images: list, prompts: list[str], path: str | os.PathLike) -> Path:
    """Write the images side by side (up to 4 per row) as one PNG with each prompt under its image."""
    from PIL import Image, ImageDraw, ImageFont

    if len(images) != len(prompts):
        raise ValueError(f"save_grid: {len(images)} images but {len(prompts)} prompts")
    font = ImageFont.load_default()
    line_px, chars_per_line, lines = 14, max(8, _GRID_CELL_PX // 7), 3
    columns = min(4, max(1, len(images)))
    rows = (len(images) + columns - 1) // columns
    cell_h = _GRID_CELL_PX + lines * line_px + 8
    grid = Image.new("RGB", (columns * (_GRID_CELL_PX + 8), max(1, rows) * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for number, (image, prompt) in enumerate(zip(images, prompts)):
        x, y = (number % columns) * (_GRID_CELL_PX + 8) + 4, (number // columns) * cell_h + 4
        scaled = image.convert("RGB").resize((_GRID_CELL_PX, _GRID_CELL_PX), Image.Resampling.NEAREST)
        grid.paste(scaled, (x, y))
        wrapped = textwrap.wrap(prompt or "(empty prompt)", chars_per_line)[:lines]
        for line_number, line in enumerate(wrapped):
            draw.text((x, y + _GRID_CELL_PX + 2 + line_number * line_px), line, fill=(0, 0, 0), font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


_SHEET_STEP = re.compile(r"step-(\d+)(\.png)?")


def write_contact_sheet(samples_dir: str | os.PathLike, prompts: list[str], weights: str) -> Path:
    """(Re)write samples_dir/index.html: every `step-NNNNNN.png` grid of the run so far (resumed runs included),
    oldest first, with its step number, under the prompts in grid order. `weights` says what the grids show
    ("EMA" or "trained"). Written to a temporary file and renamed, so a browser never sees half a page."""
    import html

    folder = Path(samples_dir)
    entries = sorted((int(m.group(1)), p.name) for p in folder.iterdir()
                     if (m := _SHEET_STEP.fullmatch(p.name)))
    prompt_items = "".join(f"<li>{html.escape(prompt or '(empty prompt)')}</li>" for prompt in prompts)
    rows = "".join(
        f'<section id="step-{step}"><h2>step {step}</h2>'
        + (f'<img src="{html.escape(name)}" alt="samples at step {step}">' if name.endswith(".png")
           else f'<a href="{html.escape(name)}/">{html.escape(name)}/</a>')
        + "</section>\n" for step, name in entries)
    page = ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>dstune samples</title>"
            "<style>body{font-family:sans-serif;margin:1em}img{max-width:100%;image-rendering:pixelated}"
            "section{margin-bottom:1.5em}</style></head><body>\n"
            f"<h1>samples: {len(entries)} steps ({html.escape(weights)} weights)</h1>\n"
            f"<p>Prompts, left to right, top to bottom:</p><ol>{prompt_items}</ol>\n{rows}</body></html>\n")
    target = folder / "index.html"
    tmp = folder / f".index.html.tmp{os.getpid()}"
    tmp.write_text(page)
    os.replace(tmp, target)
    return target


# ------------------------------------------------------------------------------------------- library chatter


@contextmanager
def quiet_hf_libraries():
    """Silence transformers/diffusers warnings and progress bars for the duration: importing the diffusers
    pipelines warns about torchvision's absence (irrelevant here), and save_pretrained draws progress bars into
    training logs. Errors still show."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    saved = [(lib, lib.get_verbosity(), lib.is_progress_bar_enabled())
             for lib in (transformers_logging, diffusers_logging)]
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
