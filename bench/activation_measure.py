"""Counting the bytes autograd keeps for backward in one training forward of a real model (bench/activation_table.py
stores the fitted constants; tests/unit/test_activation_constants.py checks them against a fresh count).

A count runs the model's forward and its loss under `torch.autograd.graph.saved_tensors_hooks` and adds up each
saved tensor's storage once (views of one storage count once; what was alive before the forward, the parameters,
buffers, inputs and cached tables, is not activations). Module hooks on the model's repeated blocks attribute every storage to the block that first saved it,
so a block's own bytes are those of a block past the first (what the first block saves of the shared inputs,
timestep modulation or rotary tables, stays outside the blocks). Tensors whose last dimension is the vocabulary
(an LM's logits and their fp32 copies) are counted apart: they grow with the vocabulary, not with the width.

Gradient checkpointing (diffusers' and transformers' `_gradient_checkpointing_func`, non-reentrant as dstune runs
it) keeps per checkpointed module only its inputs (held by the checkpoint until backward recomputes it), plus what
runs outside the checkpointed modules; backward then recomputes one module at a time, which holds that module's full
saved bytes on top. The count wraps each module's `_gradient_checkpointing_func` to see those inputs.

Attention: the count forces the flash kernel of `scaled_dot_product_attention` (on the CPU,
`_scaled_dot_product_flash_attention_for_cpu`), which keeps the output and a float32 log-sum-exp per head and query
as the GPU's flash and memory-efficient kernels do, never the tokens x tokens scores. Models whose attention is not
SDPA (SpeechT5 with its guided-attention loss) keep their scores on any device; their fit has the quadratic terms.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import dataclass, field

import torch


@dataclass
class Count:
    """Bytes of one forward: outside the blocks, per block (kind, index), the logits, and with checkpointing the
    checkpointed modules' inputs and the largest module's own bytes."""

    outside: int = 0
    blocks: dict = field(default_factory=dict)  # (kind, index) -> bytes first saved inside that block
    logits: int = 0
    checkpoint_inputs: int = 0  # unique storages given to checkpointed modules, not otherwise saved
    largest_module: int = 0  # the largest checkpointed module's full saved bytes (recomputed in backward)
    module_bytes: dict = field(default_factory=dict)  # id(module) -> its full saved bytes (full pass)

    def block(self, kind: str) -> int:
        """A block past the first of `kind` (the first also saves the inputs every block shares)."""
        indices = sorted(index for k, index in self.blocks if k == kind)
        return self.blocks[(kind, indices[1] if len(indices) > 1 else indices[0])]

    @property
    def total(self) -> int:
        return self.outside + sum(self.blocks.values()) + self.logits


def _storage_key(tensor: torch.Tensor):
    if tensor._is_zerotensor():  # a forward-mode tangent known to be zero (torch.func.jvp's): it holds no memory
        return 0, 0
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def existing_storages(model: torch.nn.Module) -> set:
    """Storages alive before the forward: parameters, buffers, and every tensor Python holds (the inputs, tables a
    model caches across steps such as Qwen-Image's rotary positions). A training step does not add them, so they
    are no activations; the caller runs one forward beforehand (`warm_up`) so the caches are filled."""
    alive = {_storage_key(t)[0] for t in list(model.parameters()) + list(model.buffers())}
    with warnings.catch_warnings():  # isinstance on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [value for value in gc.get_objects() if isinstance(value, torch.Tensor)]
    alive.update(_storage_key(t)[0] for t in tensors if not t.is_meta)
    return alive


def warm_up(run_loss) -> None:
    """One forward without autograd: what the model caches across calls exists before the counted forward."""
    with torch.no_grad(), _flash_attention():
        run_loss()


def _flash_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def count_saved(model: torch.nn.Module, run_loss, blocks: dict, vocab: int = 0, checkpointed_modules=()) -> Count:
    """One forward + loss (`run_loss()`, no backward) of `model`; `blocks`: kind -> list of its repeated blocks (the
    modules whose bytes are attributed apart); `checkpointed_modules`: the modules whose full bytes are kept (the
    largest is what backward recomputes at once under checkpointing)."""
    model_states = existing_storages(model)
    seen, count, owner = set(), Count(), [None]
    tracked = {id(m): m for m in checkpointed_modules}
    running: list = []  # tracked modules currently running (nested: the innermost and its ancestors all count)
    handles = []

    def enter(key):
        return lambda module, *args, **kwargs: owner.__setitem__(0, key)

    for kind, modules in blocks.items():
        for index, module in enumerate(modules):
            handles.append(module.register_forward_pre_hook(enter((kind, index))))
            handles.append(module.register_forward_hook(enter(None)))
    for module in tracked.values():
        handles.append(module.register_forward_pre_hook(lambda m, *a, **k: running.append(id(m))))
        handles.append(module.register_forward_hook(lambda m, *a, **k: running.remove(id(m))))

    def pack(tensor):
        ptr, nbytes = _storage_key(tensor)
        if ptr == 0 or ptr in model_states or ptr in seen:
            return tensor
        seen.add(ptr)
        for module_id in running:
            count.module_bytes[module_id] = count.module_bytes.get(module_id, 0) + nbytes
        if vocab and tensor.dim() and tensor.shape[-1] == vocab:
            count.logits += nbytes
        elif owner[0] is None:
            count.outside += nbytes
        else:
            count.blocks[owner[0]] = count.blocks.get(owner[0], 0) + nbytes
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), _flash_attention():
            loss = run_loss()
        del loss
    finally:
        for handle in handles:
            handle.remove()
    count.largest_module = max(count.module_bytes.values(), default=0)
    return count


def _checkpointed_module(target):
    """The module a `_gradient_checkpointing_func` call runs: diffusers passes the module (or its bound
    `__call__`), transformers `partial(forward, module, **kwargs)`."""
    if isinstance(target, torch.nn.Module):
        return target
    if isinstance(getattr(target, "__self__", None), torch.nn.Module):
        return target.__self__
    return next((arg for arg in getattr(target, "args", ()) if isinstance(arg, torch.nn.Module)), None)


def count_checkpointed(model: torch.nn.Module, run_loss, blocks: dict, vocab: int = 0) -> tuple[Count, list]:
    """A forward + loss with the model's gradient checkpointing on (the caller enabled it): what is saved outside
    the checkpointed modules (`outside`) and what each checkpoint keeps of its inputs (torch's non-reentrant
    checkpoint saves them for backward, so the hooks see them), per block of `blocks` (kind -> list; `blocks`) or
    of another checkpointed module (`checkpoint_inputs`). Returns the count and the checkpointed modules."""
    model_states = existing_storages(model)
    count, checkpointed, owner = Count(), [], [None]
    block_of = {id(module): (kind, index) for kind, modules in blocks.items() for index, module in enumerate(modules)}
    originals = []
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if function is None:
            continue

        def wrapped(target, *args, _function=function, **kwargs):
            callee = _checkpointed_module(target)
            if isinstance(callee, torch.nn.Module) and callee not in checkpointed:
                checkpointed.append(callee)
            owner[0] = block_of.get(id(callee), "checkpoint")
            try:
                return _function(target, *args, **kwargs)
            finally:
                owner[0] = None

        originals.append((module, function))
        module._gradient_checkpointing_func = wrapped
    seen = set()

    def pack(tensor):
        ptr, nbytes = _storage_key(tensor)
        if ptr == 0 or ptr in model_states or ptr in seen:
            return tensor
        seen.add(ptr)
        if vocab and tensor.dim() and tensor.shape[-1] == vocab:
            count.logits += nbytes
        elif owner[0] is None:
            count.outside += nbytes
        elif owner[0] == "checkpoint":
            count.checkpoint_inputs += nbytes
        else:
            count.blocks[owner[0]] = count.blocks.get(owner[0], 0) + nbytes
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), _flash_attention():
            loss = run_loss()
        del loss
    finally:
        for module, function in originals:
            module._gradient_checkpointing_func = function
    return count, checkpointed


@contextlib.contextmanager
def training_mode(model: torch.nn.Module):
    model.train()
    try:
        yield
    finally:
        model.eval()
