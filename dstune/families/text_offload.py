"""Text encoders with their weights in host memory (`model.text_encoder_offload: cpu`): each layer's weights are
copied to the device for its own forward and dropped after it, so the device holds one layer's weights at a time
beside the pass's activations (the largest: the token embedding table), instead of the whole encoder.

    place_text_encoder(module, device, dtype, offload)   where a model's loader put `.to(device, dtype)`

A "layer" is every module that owns parameters itself (a Linear, an Embedding, a norm's weight, a connector's
learnable registers): a forward pre-hook gives it device copies of its own parameters, a forward hook gives the host
tensors back, so the copies are freed as soon as the layer's forward returns (nothing keeps them: the encoders run
without gradients). A module that owns parameters and has children (rare) keeps its own copies while its children
run. Tied weights (an LM head sharing the embedding table) are one Parameter: the module that runs moves it. Buffers
(rotary frequencies, position ids) are small and move to the device once. The host tensors are the ones loaded; the
copies hold the same values, so the encoder's outputs equal those of the encoder placed whole on the device, bit for
bit (tests/unit/test_text_offload.py checks that no operation reads a host weight during a pass).

Cost: the encoder's weights cross the host link once per pass (a 12 B encoder in bf16: 24 GB per chunk of
captions; pageable copies of some GB/s), with nothing overlapped. Used where the text encoders only build the text
cache (the card's text_offload_issues): its chunks are few, and training never waits on them.
"""

from __future__ import annotations

import torch

OFFLOADED = "dstune_text_offload"  # the hooks' handles, on the encoder (their presence: offloaded already)


def _own_parameters(module: torch.nn.Module) -> dict:
    return {name: p for name, p in module._parameters.items() if p is not None}


def _bring(device: torch.device):
    def pre_hook(module, args):
        module.dstune_host = {name: p.data for name, p in _own_parameters(module).items()}
        for name, p in _own_parameters(module).items():
            p.data = torch.empty_like(p.data, device=device).copy_(p.data)  # a copy, also where device is the host

    return pre_hook


def _give_back(module, args, output):
    for name, p in _own_parameters(module).items():
        p.data = module.dstune_host[name]
    module.dstune_host = {}


def offload_text_encoder(encoder: torch.nn.Module, device) -> torch.nn.Module:
    """The encoder (its weights where they are: the host) run layer by layer on `device`; see the module docstring."""
    if getattr(encoder, OFFLOADED, None) is not None:
        return encoder
    device, handles = torch.device(device), []
    for module in encoder.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
        if _own_parameters(module):
            handles.append(module.register_forward_pre_hook(_bring(device)))
            handles.append(module.register_forward_hook(_give_back))
    setattr(encoder, OFFLOADED, handles)
    return encoder


def place_text_encoder(module: torch.nn.Module, device, dtype, offload: str) -> torch.nn.Module:
    """The text encoder frozen in `dtype` (None: as loaded) on `device` (`offload` "none"), or in host memory run
    layer by layer on `device` (`offload` "cpu", model.text_encoder_offload)."""
    if offload == "cpu":
        module = module.to(dtype=dtype) if dtype is not None else module
        return offload_text_encoder(module.eval().requires_grad_(False), device)
    return module.to(device, dtype).eval().requires_grad_(False)
