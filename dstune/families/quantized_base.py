"""`model.base_precision`: the frozen denoiser's linear weights stored quantized under LoRA (QLoRA-style).

Why bitsandbytes (tried against torchao and optimum-quanto, see docs/lora-and-ema.md): its quantized weights are
`torch.nn.Parameter` subclasses holding plain int8/uint8 data with the scales beside it, so
`deepspeed.initialize` handles them like any frozen weight (its parameter broadcast views every weight as bytes,
its bf16 cast skips integer tensors); it runs on CPU and CUDA; peft adds adapters on top of its layers. torchao's
quantized tensors fail that broadcast (`aten.view.dtype` is not implemented for them); peft has no LoRA layer for
optimum-quanto's.

Only `nn.Linear` weights are quantized (the attention and feed-forward projections: most of a transformer's or a
UNet's weights); biases stay in the original dtype, as do convolutions, norms and embeddings. Quantizing happens
after the fp32 model is loaded in host memory and before the adapters are added, so peft wraps the quantized layers;
each layer is quantized on its way to the accelerator, so the fp32 base never reaches it.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from dstune.families.base import FamilyError
from dstune.families.quantized_file import QuantizedFileError, in_diffusers_names, key_problems, read_quantized_file
from dstune.hf import quiet_hf_libraries

NF4_BLOCK_SIZE = 64  # weights per fp32 absmax: 0.5 + 4 / 64 bytes per weight (spec.BASE_PRECISION_BYTES["nf4"])


def _quantized_linear(linear: torch.nn.Linear, precision: str, device=None) -> torch.nn.Module:
    """A bitsandbytes layer holding `linear`'s weight quantized, on `device` (None: the layer's own); frozen."""
    import bitsandbytes as bnb

    device = linear.weight.device if device is None else torch.device(device)
    weight = linear.weight.detach().to("cpu", torch.float32)  # bitsandbytes quantizes when the layer is moved
    has_bias = linear.bias is not None
    if precision == "int8":
        # threshold 0: no fp16 outlier columns, every weight is int8 (LLM.int8's outlier path needs fp16 copies).
        layer = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False, threshold=0.0
        )
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:  # nf4; compute dtype follows the input (train.precision)
        layer = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=has_bias, quant_type="nf4", compress_statistics=False
        )
        layer.weight = bnb.nn.Params4bit(
            weight, requires_grad=False, quant_type="nf4", blocksize=NF4_BLOCK_SIZE, compress_statistics=False
        )
    if has_bias:
        layer.bias = torch.nn.Parameter(linear.bias.detach().to("cpu").clone(), requires_grad=False)
    return layer.to(device).requires_grad_(False)


def quantize_linear_weights(module: torch.nn.Module, precision: str, device=None) -> int:
    """Replace every `nn.Linear` inside `module` by its quantized bitsandbytes counterpart (in place), each placed
    on `device` as it is quantized (None: where the layer is), so a base loaded in host memory reaches the
    accelerator quantized, one fp32 layer in flight at most. Returns the number of layers replaced."""
    if precision == "int8":
        # LLM.int8 casts activations to fp16 before quantizing them by design; bitsandbytes says so on every call.
        warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast from")
    replaced = 0
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:  # exactly Linear: subclasses may carry behaviour a swap would drop
            setattr(module, name, _quantized_linear(child, precision, device))
            replaced += 1
        else:
            replaced += quantize_linear_weights(child, precision, device)
    return replaced


def stored_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes the module's parameters occupy as stored (quantized data, not counting scales kept outside)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


# ------------------------------------------------------------------------------ model.transformer_file (fp8, int8)

TORCH_STORAGE = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def dequantized(weight: torch.Tensor, scale_bits: torch.Tensor, storage: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight a ScaledLinear computes with, in `dtype`: the stored values x their scale (one per tensor or per
    output row), in one new tensor (the product taken in place)."""
    values = weight.view(TORCH_STORAGE[storage]).to(dtype)
    scale = scale_bits.view(torch.float32).to(dtype)
    return values.mul_(scale.view(-1, 1) if scale.numel() > 1 else scale)


class _DequantizedLinear(torch.autograd.Function):
    """x @ dequantized(W).T + b, keeping for backward the stored weight (1 byte an element), not the dequantized
    copy autograd would keep for F.linear: each layer's copy lives for its own product only, in forward and again
    in backward. The base is frozen: no gradient for the weight, the scale or the bias."""

    @staticmethod
    def forward(ctx, x, weight, scale_bits, bias, storage):
        ctx.save_for_backward(weight, scale_bits)
        ctx.storage = storage
        full = dequantized(weight, scale_bits, storage, x.dtype)
        return torch.nn.functional.linear(x, full, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        weight, scale_bits = ctx.saved_tensors
        full = dequantized(weight, scale_bits, ctx.storage, grad.dtype)
        return grad @ full, None, None, None, None


class ScaledLinear(torch.nn.Linear):
    """A frozen linear layer read from a quantized file (dstune.families.quantized_file): `weight` holds the stored
    bytes as int8 (fp8 values viewed as int8: an integer tensor, which the casts to train.precision, DeepSpeed's
    among them, leave as it is, and which diffusers' dtype checks already know from bitsandbytes' int8 layers),
    `scale_bits` the fp32 scales' bits as int32 (for the same reason: a cast to bf16 would round them). A subclass of
    nn.Linear, so peft wraps it with its LoRA layer like any linear layer; the adapter adds to this layer's output."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, storage: str, bias: Optional[torch.Tensor]):
        torch.nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.storage = storage
        stored = weight.view(torch.int8) if weight.dtype != torch.int8 else weight
        self.weight = torch.nn.Parameter(stored, requires_grad=False)
        bits = scale.to(torch.float32).reshape(-1).contiguous().view(torch.int32)
        self.scale_bits = torch.nn.Parameter(bits, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantizedLinear.apply(x, self.weight, self.scale_bits, self.bias, self.storage)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={self.storage}"


def load_quantized_transformer(model_class, config: dict, path, card=None) -> torch.nn.Module:
    """`model_class` built from `config` (its parameters on the meta device, no random weights) and filled from
    the quantized file at `path`: each quantized layer as a ScaledLinear holding the file's bytes, every other
    parameter in fp32 (the start-up casts it). A file in the model's original naming is read through the `card`'s
    map (a fused tensor's rows split, its bytes as stored). FamilyError naming the keys when the file is not this
    transformer, before any weight is read."""
    from accelerate import init_empty_weights
    from safetensors import safe_open

    try:
        layout = in_diffusers_names(read_quantized_file(path), card, config)
    except QuantizedFileError as err:
        raise FamilyError(f"model.transformer_file: {err}") from None
    with quiet_hf_libraries(), init_empty_weights(include_buffers=False):
        model = model_class.from_config(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    problems = key_problems(layout.shapes(), expected, model_class.__name__, layout.naming)
    problems += [
        f"{name}.weight is stored quantized but {name} is a {type(model.get_submodule(name)).__name__}, not a "
        "linear layer"
        for name in layout.layers
        if f"{name}.weight" in expected and type(model.get_submodule(name)) is not torch.nn.Linear
    ]
    if problems:
        raise FamilyError(
            f"model.transformer_file {layout.path} does not fit the pipeline's {model_class.__name__}:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    with safe_open(str(layout.path), framework="pt", device="cpu") as file:
        plain = {
            name: _rows(file.get_tensor(key), layout.plain_rows.get(name)).to(torch.float32)
            for name, key in layout.plain_keys.items()
        }
        for name, layer in layout.layers.items():
            parent, _, child = name.rpartition(".")
            bias = plain.pop(f"{name}.bias", None)
            weight, scale = file.get_tensor(layer.weight_key), file.get_tensor(layer.scale_key)
            weight = _rows(weight.view(torch.int8) if weight.dtype != torch.int8 else weight, layer.rows)
            scale = _rows(scale.reshape(-1), layer.rows) if scale.numel() > 1 else scale
            setattr(model.get_submodule(parent), child, ScaledLinear(weight, scale, layer.storage, bias))
    model.load_state_dict(plain, strict=False, assign=True)
    return model


def _rows(tensor: torch.Tensor, rows) -> torch.Tensor:
    """The rows of a file's tensor a parameter is made of (quantized_file.Rows), the bytes as stored."""
    if rows is None:
        return tensor
    return torch.cat([tensor[start:stop] for start, stop in rows]) if len(rows) > 1 else tensor[slice(*rows[0])].clone()


def scaled_layers(module: torch.nn.Module) -> list[ScaledLinear]:
    """The module's layers read quantized from model.transformer_file (peft's wrappers looked through)."""
    return [layer for layer in module.modules() if isinstance(layer, ScaledLinear)]
