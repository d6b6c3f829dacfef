"""`model.transformer_file`: a quantized single-file transformer as people download it, read offline (torch-free,
from the safetensors header alone), so that `dstune validate` checks the file and the memory plan counts its bytes.

The layouts read (each linear layer `L` quantized on its own; every other tensor of the file is a plain one):
  - ComfyUI's "scaled fp8" (also written by musubi-tuner and diffusion-pipe): `L.weight` in float8_e4m3fn (or
    e5m2) and `L.scale_weight`, one fp32 scale per tensor (per output row in some writers); a `scaled_fp8` marker
    tensor names the file's kind; `L.scale_input` serves fp8 matrix multiplication only and is not read here.
  - ComfyUI's quantized layers (`L.comfy_quant`, a uint8 tensor holding JSON such as {"format": "int8_tensorwise"},
    or the same per layer in the header's `_quantization_metadata`): formats float8_e4m3fn / float8_e5m2 and
    int8_tensorwise, the weight beside `L.weight_scale` (one fp32 scale per tensor or per output row).
The weight a layer computes with is stored x scale (dstune.families.quantized_base.ScaledLinear). The keys are
those of the pipeline folder's transformer in diffusers' naming, optionally under `model.diffusion_model.` or
`diffusion_model.`, or the model's original checkpoint naming where its card maps those names
(ModelCard.original_transformer_names; docs/lora-and-ema.md lists the models).
A fused original tensor is split by rows, never dequantized: each piece keeps the stored bytes of its rows, a
per-tensor scale goes to every piece and a per-row scale is sliced with its rows (`in_diffusers_names`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, replace
from math import prod
from pathlib import Path
from typing import Optional

SAFETENSORS_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1, "BF16": 2, "F16": 2, "I16": 2}
SAFETENSORS_BYTES.update({"F32": 4, "I32": 4, "U32": 4, "F64": 8, "I64": 8, "U64": 8})
# safetensors dtype of a quantized weight -> the storage ScaledLinear dequantizes
STORAGE = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8"}
# ComfyUI quantization formats read here -> the safetensors dtype of their weight
COMFY_FORMATS = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int8_tensorwise": "I8"}
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
LEGACY_MARKER = "scaled_fp8"
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
SKIPPED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class QuantizedFileError(ValueError):
    """The file is not a quantized transformer dstune reads: the message names the key and what is wrong."""


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


@dataclass(frozen=True)
class QuantizedLayer:
    """One linear layer stored quantized: `name` its path in the transformer (`transformer_blocks.0.attn.to_q`)."""

    name: str
    storage: str  # float8_e4m3fn | float8_e5m2 | int8
    weight_key: str  # the file's keys, prefix included
    scale_key: str
    weight: Tensor
    scale: Tensor
    rows: Rows = None  # the rows of the file's weight (and of a per-row scale) this layer is made of, in order


# row ranges [start, stop) of a file's tensor, concatenated in this order (a piece of a fused projection, or its
# halves swapped); None: the whole tensor
Rows = Optional[tuple[tuple[int, int], ...]]


@dataclass
class QuantizedFile:
    path: Path
    prefix: str
    layers: dict[str, QuantizedLayer]  # layer path -> its quantized weight and scale
    plain: dict[str, Tensor]  # parameter name (prefix removed) -> every other tensor the transformer loads
    plain_keys: dict[str, str] = field(default_factory=dict)  # parameter name -> the file's key
    plain_rows: dict[str, Rows] = field(default_factory=dict)  # parameter name -> its rows of the file's tensor
    naming: str = "diffusers"  # or the original naming the card mapped (its OriginalNames.naming)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter the file fills, by its name in the transformer, with its shape."""
        shapes = {f"{name}.weight": layer.weight.shape for name, layer in self.layers.items()}
        shapes.update({name: tensor.shape for name, tensor in self.plain.items()})
        return shapes

    @property
    def quantized_bytes(self) -> int:
        """The quantized weights and their scales as stored (1 byte a weight, 4 a scale)."""
        return sum(layer.weight.nbytes + layer.scale.nbytes for layer in self.layers.values())

    @property
    def params(self) -> int:
        return sum(layer.weight.numel for layer in self.layers.values()) + sum(t.numel for t in self.plain.values())

    def stored_bytes(self, weight_bytes: float) -> float:
        """The frozen transformer as dstune holds it: the quantized layers as the file stores them, every other
        parameter at the training precision's `weight_bytes`."""
        return self.quantized_bytes + weight_bytes * sum(t.numel for t in self.plain.values())

    @property
    def largest_layer_params(self) -> int:
        """The weights of the largest quantized layer: its dequantized copy is the working copy in each pass."""
        return max((layer.weight.numel for layer in self.layers.values()), default=0)


def read_header(path: Path) -> tuple[dict[str, Tensor], dict]:
    """The tensors (name -> dtype, shape, byte offsets) and the `__metadata__` of a safetensors file."""
    try:
        with open(path, "rb") as file:
            head = file.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= length <= MAX_HEADER_BYTES:
                raise QuantizedFileError(f"{path} is not a safetensors file (its first 8 bytes are no header length)")
            header = json.loads(file.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise QuantizedFileError(f"{path}: cannot read a safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise QuantizedFileError(f"{path}: its safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or {"dtype", "shape", "data_offsets"} - set(entry):
            raise QuantizedFileError(f"{path}: header entry {name!r} is not a tensor (dtype, shape, data_offsets)")
        tensors[name] = Tensor(entry["dtype"], tuple(entry["shape"]), tuple(entry["data_offsets"]))
    return tensors, metadata


def _prefix(names) -> str:
    for prefix in PREFIXES:
        if names and all(name.startswith(prefix) or name == LEGACY_MARKER for name in names):
            return prefix
    return ""


def _comfy_formats(path: Path, tensors: dict[str, Tensor], metadata: dict, prefix: str) -> dict[str, str]:
    """Layer path (prefix removed) -> its ComfyUI format, from the header's _quantization_metadata or the
    `.comfy_quant` tensors (JSON bytes, read from the file)."""
    formats = {}
    text = metadata.get("_quantization_metadata")
    if text:
        try:
            layers = json.loads(text.strip()).get("layers", {})
        except (json.JSONDecodeError, AttributeError):
            raise QuantizedFileError(f"{path}: __metadata__._quantization_metadata is not JSON") from None
        formats.update({name.removeprefix(prefix): conf.get("format", "") for name, conf in layers.items()})
    with open(path, "rb") as file:
        start = 8 + struct.unpack("<Q", file.read(8))[0]  # the tensors' data begins after the header
        for key, tensor in tensors.items():
            if key.endswith(".comfy_quant"):
                file.seek(start + tensor.offsets[0])
                try:
                    conf = json.loads(file.read(tensor.nbytes).decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    conf = None
                if not isinstance(conf, dict):
                    raise QuantizedFileError(f"{path}: {key} does not hold a JSON object (a ComfyUI layer format)")
                formats[key.removeprefix(prefix).removesuffix(".comfy_quant")] = conf.get("format", "")
    return formats


def read_quantized_file(path) -> QuantizedFile:
    """The quantized layers and plain tensors of `path`; QuantizedFileError naming the key for anything dstune
    cannot compute with (a quantized weight without its scale, a format it does not read, block-wise scales)."""
    path = Path(path).expanduser()
    tensors, metadata = read_header(path)
    prefix = _prefix(list(tensors))
    formats = _comfy_formats(path, tensors, metadata, prefix)
    unread = sorted({f for f in formats.values() if f not in COMFY_FORMATS})
    if unread:
        some = next(name for name, f in formats.items() if f == unread[0])
        raise QuantizedFileError(
            f"{path}: layer {some} is quantized as {unread[0]!r} (ComfyUI format); dstune reads "
            f"{', '.join(COMFY_FORMATS)} and the scaled fp8 layout (scale_weight). Use a file in one of those."
        )
    layers, plain, plain_keys = {}, {}, {}
    for key, tensor in tensors.items():
        name = key.removeprefix(prefix)
        if name == LEGACY_MARKER or name.endswith(SCALE_SUFFIXES + SKIPPED_SUFFIXES):
            continue
        if tensor.dtype not in STORAGE:
            plain[name], plain_keys[name] = tensor, key
            continue
        layers[name.removesuffix(".weight")] = _layer(path, key, name, tensor, tensors, prefix, formats)
    if not layers:
        raise QuantizedFileError(
            f"{path} holds no quantized weights (no float8 or int8 tensor with a scale beside it): it is a plain "
            "checkpoint. model.transformer_file reads quantized files only; a bf16/fp32 transformer belongs in the "
            "pipeline folder's transformer/ (or use model.base_precision to quantize it)."
        )
    return QuantizedFile(path, prefix, layers, plain, plain_keys)


def _layer(path, key, name, tensor, tensors, prefix, formats) -> QuantizedLayer:
    if not name.endswith(".weight") or len(tensor.shape) != 2:
        raise QuantizedFileError(
            f"{path}: {key} is stored {STORAGE[tensor.dtype]} with shape {list(tensor.shape)}; only the 2-D "
            "weights of linear layers are read quantized"
        )
    layer = name.removesuffix(".weight")
    scale_key = next((prefix + layer + s for s in SCALE_SUFFIXES if prefix + layer + s in tensors), None)
    if scale_key is None:
        raise QuantizedFileError(
            f"{path}: {key} is stored {STORAGE[tensor.dtype]} but the file has no {prefix + layer}.scale_weight "
            f"(scaled fp8) nor {prefix + layer}.weight_scale (ComfyUI): without its scale the weight cannot be "
            "dequantized. Is the file complete?"
        )
    fmt = formats.get(layer)
    if tensor.dtype == "I8" and fmt != "int8_tensorwise":
        raise QuantizedFileError(
            f"{path}: {key} is int8 but the file does not mark {layer} as ComfyUI's int8_tensorwise "
            f"({'its format is ' + repr(fmt) if fmt else 'no .comfy_quant or _quantization_metadata entry'}): "
            "other int8 layouts (rotated, packed 4-bit) dequantize differently"
        )
    if fmt is not None and COMFY_FORMATS.get(fmt) != tensor.dtype:
        raise QuantizedFileError(f"{path}: {key} is {tensor.dtype} but the file marks {layer} as {fmt!r}")
    scale, rows = tensors[scale_key], tensor.shape[0]
    if scale.dtype != "F32" or scale.numel not in (1, rows) or len([d for d in scale.shape if d != 1]) > 1:
        raise QuantizedFileError(
            f"{path}: {scale_key} has dtype {scale.dtype} and shape {list(scale.shape)}; dstune reads one fp32 "
            f"scale per tensor or one per output row ({rows}), not block-wise scales"
        )
    return QuantizedLayer(layer, STORAGE[tensor.dtype], key, scale_key, tensor, scale)


class OriginalNames(dict):
    """A card's map of its original checkpoint naming: diffusers' parameter name -> (the file's parameter name,
    prefix removed; the Rows of it), with `naming` saying whose names they are, for messages."""

    def __init__(self, naming: str, pairs):
        super().__init__(pairs)
        self.naming = naming


def in_diffusers_names(layout: QuantizedFile, card, config: dict) -> QuantizedFile:
    """`layout` with its parameters under diffusers' names where the file is in the model's original naming (the
    card's `original_transformer_names` maps it, from the file's shapes and the transformer's `config`); as it is
    otherwise. Only names and row ranges change: the bytes read later are the file's."""
    naming = getattr(card, "original_transformer_names", None)
    mapping = naming(layout.shapes(), config) if naming is not None else None
    if mapping is None:
        return layout
    layers, plain, plain_keys, plain_rows, used = {}, {}, {}, {}, set()
    for target, (source, rows) in mapping.items():
        layer = layout.layers.get(source.removesuffix(".weight")) if source.endswith(".weight") else None
        tensor = layer.weight if layer is not None else layout.plain.get(source)
        if tensor is None:
            continue  # key_problems names the transformer's parameter the file lacks
        used.add(source)
        count = _row_count(layout, source, tensor, rows)
        if layer is not None:
            scale = layer.scale if layer.scale.numel == 1 else _with_rows(_flat(layer.scale), count)
            name = target.removesuffix(".weight")
            layers[name] = replace(layer, name=name, weight=_with_rows(tensor, count), scale=scale, rows=rows)
        else:
            plain[target], plain_keys[target] = _with_rows(tensor, count), layout.plain_keys[source]
            plain_rows[target] = rows
    for source, tensor in layout.plain.items():  # what the mapping does not take: named as a key of no parameter
        if source not in used:
            plain[source], plain_keys[source] = tensor, layout.plain_keys[source]
    layers.update({n: q for n, q in layout.layers.items() if f"{n}.weight" not in used})
    return replace(
        layout, layers=layers, plain=plain, plain_keys=plain_keys, plain_rows=plain_rows, naming=mapping.naming
    )


def _row_count(layout: QuantizedFile, source: str, tensor: Tensor, rows: Rows) -> int:
    if rows is None:
        return tensor.shape[0] if tensor.shape else 1
    if any(not 0 <= start < stop <= tensor.shape[0] for start, stop in rows):
        raise QuantizedFileError(
            f"{layout.path}: {layout.prefix + source} has shape {list(tensor.shape)}: too few rows for the rows "
            f"{[list(r) for r in rows]} that diffusers' transformer takes from it. Is the file this model's?"
        )
    return sum(stop - start for start, stop in rows)


def _flat(tensor: Tensor) -> Tensor:
    return Tensor(tensor.dtype, (tensor.numel,), tensor.offsets)


def _with_rows(tensor: Tensor, count: int) -> Tensor:
    """`tensor`'s entry with `count` rows (its byte span scaled to them: what the memory plan counts)."""
    if not tensor.shape or tensor.shape[0] == count:
        return tensor
    size = tensor.nbytes // max(1, tensor.numel)
    shape = (count, *tensor.shape[1:])
    return Tensor(tensor.dtype, shape, (0, size * prod(shape)))


def key_problems(found: dict[str, tuple], expected: dict[str, tuple], where: str, naming="diffusers") -> list[str]:
    """What differs between the file's parameters (`found`: name -> shape, under diffusers' names or mapped from
    `naming`) and the transformer's (`expected`), each line naming keys; [] when they match."""

    def some(names) -> str:
        names = sorted(names)
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    problems = []
    missing, extra = set(expected) - set(found), set(found) - set(expected)
    if missing:
        problems.append(f"{len(missing)} parameters of {where} are not in the file: {some(missing)}")
    if extra:
        problems.append(f"{len(extra)} keys of the file are no parameter of {where}: {some(extra)}")
    if naming != "diffusers" and (missing or extra):
        problems.append(f"the file's keys were read as {naming} (mapped to diffusers' names as listed here)")
    elif missing and extra and len(extra) >= len(found) // 2:
        problems.append(
            "the file's keys look like another naming (a model's original checkpoint layout); dstune reads "
            "files in diffusers' naming of the pipeline's transformer (optionally under model.diffusion_model.) "
            "and, for the models docs/lora-and-ema.md lists, their original naming"
        )
    both = sorted(set(found) & set(expected))
    wrong = [
        f"{n} {list(found[n])} (expected {list(expected[n])})" for n in both if tuple(found[n]) != tuple(expected[n])
    ]
    if wrong:
        problems.append(f"{len(wrong)} shapes differ: {'; '.join(wrong[:3])}")
    return problems


def folder_shapes(component: Path) -> Optional[dict[str, tuple]]:
    """The parameter shapes of a pipeline folder's component from its safetensors headers; None without them."""
    files = sorted(p for p in component.glob("*.safetensors") if len(p.name.split(".")) == 2)
    if not files:
        return None
    shapes = {}
    for file in files:
        tensors, _ = read_header(file)
        shapes.update({name: t.shape for name, t in tensors.items()})
    return shapes


def read_for(reference, card=None, folder: Optional[Path] = None) -> QuantizedFile:
    """The file at `reference` read from its header, under diffusers' names where it is in the original naming of
    `card`'s model and the pipeline `folder`'s transformer config is here (its widths split fused tensors)."""
    layout = read_quantized_file(reference)
    config_file = folder / "transformer" / "config.json" if folder is not None else None
    if card is None or config_file is None or not config_file.is_file():
        return layout
    try:
        config = json.loads(config_file.read_text())
        return in_diffusers_names(layout, card, config)
    except (KeyError, ValueError, TypeError) as err:  # a config without the widths a map needs
        raise QuantizedFileError(f"{config_file}: cannot map {layout.path}'s original names with it ({err})") from None


def transformer_file_problems(
    reference: str, folder: Optional[Path], stage: int, card=None, nvme: bool = False
) -> list[str]:
    """What `dstune validate` says of model.transformer_file (the file `reference`, `folder` the pipeline folder
    when it is on this machine, `card` its model's card, `stage` the run's ZeRO stage, `nvme` whether parameters
    are offloaded to NVMe), each a sentence; [] when the file can be used. Without the folder's weights the keys are checked at start-up, against the model."""
    if stage == 3 and nvme:
        return [
            "a quantized file's weights with deepspeed.offload_param nvme under ZeRO stage 3: DeepSpeed 0.19.8's NVMe "
            "parameter swapper sizes and types every swap buffer in the training dtype, while the file's partitions "
            "are 1-byte integers: they would be read back wrong. Use deepspeed.offload_param cpu or none."
        ]
    path = Path(reference).expanduser()
    if not path.is_file():
        return []  # model_folder_issues says so (or warns, validating for another machine)
    try:
        layout = read_for(path, card, folder)
    except QuantizedFileError as err:
        return [str(err)]
    expected = folder_shapes(folder / "transformer") if folder is not None else None
    if expected is None:  # no weights beside the configs: the keys are checked against the model at start-up
        return []
    problems = key_problems(layout.shapes(), expected, f"{folder / 'transformer'}", layout.naming)
    return [f"{path} does not fit the pipeline's transformer: " + "; ".join(problems)] if problems else []


def quantized_file_setup(reference: Optional[str], setup, card=None, folder: Optional[Path] = None):
    """The memory plan's Setup (dstune.memory.plan) with a quantized file's frozen base: its stored bytes per
    parameter (weights and scales as the layers hold them, the other tensors at train.precision) and its largest
    layer's dequantized working copy (a fused original tensor counted as its pieces where `folder`'s config maps
    it; whole, an over-estimate, where not). Unchanged without a readable file (validate reports that one)."""
    if not reference:
        return setup
    try:
        layout = read_for(reference, card, folder)
    except (QuantizedFileError, OSError):
        return setup
    return replace(
        setup,
        base_bytes_per_param=layout.stored_bytes(setup.weight_bytes) / layout.params,
        dequantized_layer_params=layout.largest_layer_params,
    )
