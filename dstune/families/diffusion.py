"""What the diffusers-based families share: loading components from a pipeline folder, the
folder's model_index.json, export of a complete pipeline folder, non-reentrant checkpointing and dtype casting."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch

from dstune.card import DATA_PIXELS, PixelRange
from dstune.families.base import FamilyError
from dstune.families.folders import MODEL_INDEX, is_modular, read_model_index
from dstune.families.modular import write_modular_index
from dstune.families.precision import at_least_float32
from dstune.fsutil import folder_written_atomically
from dstune.hf import quiet_hf_libraries

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pt", ".pth", ".msgpack", ".h5", ".onnx", ".pb", ".gguf")


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


def export_pipeline_folder(source: Path, out_dir, trained_name: str, trained, finish=None) -> Path:
    """Write a complete diffusers pipeline folder at `out_dir`: the trained component `trained_name` (a module,
    saved as safetensors) plus every other component `source`'s index lists, copied unchanged. A modular pipeline's
    modular_model_index.json is written with its components loading from the export (dstune.families.modular), so
    the folder never loads the untrained transformer from the source.
    `finish(work_folder)` may adjust the copy before it is published (sd: the scheduler's prediction type).
    Written beside `out_dir` and renamed into place, replacing an older export only once complete."""
    index = read_model_index(source)
    out = Path(out_dir)
    with folder_written_atomically(out, "exporting") as work:
        for name, entry in index.items():
            listed = isinstance(entry, list) and len(entry) == 2 and entry[1] is not None
            if listed and name != trained_name and (source / name).is_dir():
                copy_component(source / name, work / name)
        with quiet_hf_libraries():
            trained.save_pretrained(work / trained_name, safe_serialization=True)
        if is_modular(source):
            write_modular_index(source, work, out)
        else:
            shutil.copy2(source / MODEL_INDEX, work / MODEL_INDEX)
        if finish is not None:
            finish(work)
    return out


def load_component(folder: Path, name: str, loader: Callable, **kwargs):
    try:
        with quiet_hf_libraries():
            return loader(folder, subfolder=name, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise FamilyError(f"{folder / name}: cannot load it ({first_line})") from None


def load_trainable(folder: Path, name: str, model_class, zero3_config: Optional[dict] = None):
    """The component a family trains, with one copy of its weights per process at most.

    Without `zero3_config`: `from_pretrained` with low_cpu_mem_usage (built on the meta device and filled from the
    memory-mapped safetensors, no second randomly initialised copy), in fp32 in host memory. It stays there: the
    start-up (dstune.startup.load_trained_model) quantizes a frozen base and adds LoRA adapters on the host, then casts the
    module to its training dtype and only then moves it to the accelerator (dstune.engine.place_trainable), so the
    accelerator never holds an fp32 copy DeepSpeed would cast anyway. With `zero3_config` (the run's DeepSpeed JSON,
    ZeRO stage 3): built partitioned under deepspeed.zero.Init in the config's precision and filled one parameter at
    a time, so no rank holds the whole model."""
    if zero3_config is None:
        return load_component(
            folder, name, model_class.from_pretrained, torch_dtype=torch.float32, low_cpu_mem_usage=True
        )
    return load_partitioned(folder, name, model_class, zero3_config)


def default_safetensors(component: Path) -> list[Path]:
    """The weight files from_pretrained reads by default: safetensors without a variant infix (sharded or not)."""
    return sorted(p for p in component.glob("*.safetensors") if len(p.name.split(".")) == 2)


def load_partitioned(folder: Path, name: str, model_class, zero3_config: dict):
    """Collective (every rank, same order). The module built under deepspeed.zero.Init (each rank allocates only its
    share of every parameter, in the config's precision), then each parameter gathered in turn, filled on rank 0
    from the safetensors file (read one tensor at a time, memory-mapped) and re-partitioned. Buffers, which ZeRO
    does not partition, are read on every rank."""
    import deepspeed
    import torch.distributed as dist
    from safetensors import safe_open

    files = default_safetensors(folder / name)
    if not files:
        raise FamilyError(
            f"{folder / name}: no .safetensors weights; ZeRO-3 builds the model partitioned and "
            "reads safetensors only. Convert the weights (save_pretrained(safe_serialization=True))."
        )
    config = load_component(folder, name, model_class.load_config)
    with quiet_hf_libraries(), deepspeed.zero.Init(config_dict_or_path=zero3_config):
        model = model_class.from_config(config)
    where: dict[str, Path] = {}
    shapes: dict[str, tuple] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                where[key], shapes[key] = path, tuple(handle.get_slice(key).get_shape())
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    # Checked on every rank before any gather (same files, same verdict): a copy failing on rank 0 alone would hang.
    wrong = sorted(key for key, param in params.items() if shapes.get(key) != tuple(param.ds_shape))
    if wrong:
        raise FamilyError(
            f"{folder / name}: {len(wrong)} parameter(s) of {model_class.__name__} are missing from "
            f"its weights or have another shape (e.g. {wrong[:3]}); was it written by this class's "
            "save_pretrained?"
        )
    is_source = dist.get_rank() == 0
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in [k for k in params if where[k] == path]:
                with deepspeed.zero.GatheredParameters([params[key]], modifier_rank=0):
                    if is_source:
                        params[key].data.copy_(handle.get_tensor(key))
            for key in [k for k in buffers if where.get(k) == path]:
                buffers[key].copy_(handle.get_tensor(key))
    return model


def non_reentrant_checkpoint(module, *args):
    # Explicit use_reentrant=False: reentrant checkpointing drops gradients when no input requires grad and warns;
    # passing it explicitly also keeps torch's "use_reentrant should be passed" warning out of the logs.
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)


def offloaded_checkpoint(module, *args):
    """non_reentrant_checkpoint with the block's inputs kept in host memory (model.activation_offload: cpu): the
    checkpoint holds copies of them (pinned host tensors on a GPU; on the CPU accelerator, where the host is the
    device, plain copies) and its recomputation moves them back to the device. Copies, never the inputs themselves:
    an input several blocks read (a time embedding) is left where it is, and freed only when nothing reads it
    (DeepSpeed's cpu_checkpointing frees it, which is why dstune refuses that). A 0-element tensor on the device
    goes first, so that checkpoint saves and restores that device's RNG state (it reads the devices from the
    arguments, which are now on the host)."""
    anchor = next((value for value in _tensors(args)), None)
    if anchor is None:
        return non_reentrant_checkpoint(module, *args)
    device = anchor.device

    def run(marker, *held):
        return module(*_moved(held, marker.device))

    held = _host_copies(args, device.type == "cuda")
    return torch.utils.checkpoint.checkpoint(run, torch.empty(0, device=device), *held, use_reentrant=False)


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _host_copies(value, pinned: bool):
    """Host copies of every tensor in `value` (tuples, lists and dicts of them), through autograd (a copy_ into a
    new tensor): the gradient of a copy flows back to its device original."""
    if torch.is_tensor(value):
        copy = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pinned)
        return copy.copy_(value, non_blocking=pinned)
    if isinstance(value, (tuple, list)):
        return type(value)(_host_copies(item, pinned) for item in value)
    if isinstance(value, dict):
        return {key: _host_copies(item, pinned) for key, item in value.items()}
    return value


def _moved(value, device: torch.device):
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _moved(item, device) for key, item in value.items()}
    return value


def block_checkpoint(activation_offload: str):
    """The checkpoint function a denoiser's blocks run through: model.activation_offload's."""
    return offloaded_checkpoint if activation_offload == "cpu" else non_reentrant_checkpoint


def compile_repeated_blocks(module: torch.nn.Module) -> dict:
    """train.compile blocks: torch.compile (inductor) each block of the classes the denoiser's diffusers class lists
    in `_repeated_blocks`, in place (nn.Module.compile, as diffusers' compile_repeated_blocks does): the module keeps
    its parameters and their names, so DeepSpeed, LoRA, checkpoints and the export see the same module. Compiled at
    a block's first call. Returns block class -> how many were compiled; FamilyError where the class lists none."""
    wanted = set(getattr(module, "_repeated_blocks", None) or ())
    found: dict = {}
    for block in module.modules():
        name = type(block).__name__
        if name in wanted:
            block.compile()
            found[name] = found.get(name, 0) + 1
    if not found:
        raise FamilyError(
            f"train.compile blocks: {type(module).__name__} lists no repeated blocks diffusers can compile "
            f"(_repeated_blocks: {sorted(wanted) or 'none'}); set train.compile: off"
        )
    return found


def compile_seconds() -> float:
    """Seconds this process spent in torch.compile so far: tracing and compiling the forward graphs, and the
    backward graphs compiled at their first backward (torch._dynamo's own timers)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(
        sum(compilation_time_metrics.get(key, ())) for key in ("_compile.compile_inner", "backward._backward_impl")
    )


def batch_field(batch: dict, *names: str):
    for name in names:
        if name in batch:
            return batch[name]
    raise KeyError(f"batch has none of the keys {names} (it has {sorted(batch)})")


@contextmanager
def inputs_cast_to(module: torch.nn.Module, dtype: torch.dtype):
    """Cast floating inputs (also inside dict arguments such as a UNet's added_cond_kwargs) to `dtype` while a
    pipeline runs: a bf16 denoiser beside fp32 frozen parts."""

    def cast(value):
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    handle = module.register_forward_pre_hook(
        lambda _m, args, kwargs: (tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}),
        with_kwargs=True,
    )
    try:
        yield
    finally:
        handle.remove()


def vae_pixels(pixels: torch.Tensor, pixel_range: PixelRange = DATA_PIXELS) -> torch.Tensor:
    """The data layer's pixels ([-1, 1], channels on axis 1) as the VAE takes them (its card's pixel_range): as they
    are for the default range, else mapped to [low, high] and normalised per channel."""
    if pixel_range.is_data_range:
        return pixels
    shape = (1, -1) + (1,) * (pixels.ndim - 2)
    mean = torch.tensor(pixel_range.mean, dtype=pixels.dtype, device=pixels.device).view(shape)
    std = torch.tensor(pixel_range.std, dtype=pixels.dtype, device=pixels.device).view(shape)
    unit = (pixels + 1) / 2
    return (pixel_range.low + (pixel_range.high - pixel_range.low) * unit - mean) / std


def vae_posterior(
    vae, pixels: torch.Tensor, pixel_range: PixelRange = DATA_PIXELS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE posterior of images (B, 3, H, W) in the data layer's [-1, 1], mapped to the VAE's
    `pixel_range` first, float32, (B, C, h, w). A video-style VAE (a `temperal_downsample` config) encodes them as
    one-frame clips (B, 3, 1, H, W); clips (B, 3, frames, H, W) go in as they are and keep their latent frames
    (B, C, f, h, w)."""
    pixels = vae_pixels(pixels, pixel_range)
    video = getattr(vae.config, "temperal_downsample", None) is not None and pixels.ndim == 4
    if getattr(vae.config, "in_channels", 3) == 4 and pixels.shape[1] == 3:  # an RGBA VAE reads
        pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)  # the image opaque, as its example does
    with torch.no_grad():
        posterior = vae.encode(pixels.unsqueeze(2) if video else pixels).latent_dist
    mean, std = at_least_float32(posterior.mean), at_least_float32(posterior.std)
    return (mean.squeeze(2), std.squeeze(2)) if video else (mean, std)
