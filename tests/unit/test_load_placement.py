"""The start-up is not a memory peak: the trainable module reaches the device only in its training dtype (never
the fp32 copy DeepSpeed would cast anyway), and a quantized base reaches it already quantized. Observed on a real
tiny model through dstune.startup.load_trained_model: every `.to(<device>)` of the trainable module records its first
parameter's dtype and device and how many unquantized base nn.Linear layers are left, at the moment of the move."""

from __future__ import annotations

import pytest
import torch

from dstune.spec.models import Spec
from loaded_models import CACHE_DIR


def _one_process_run():
    from dstune.distributed import Run
    from dstune.world import World

    world = World(world_size=1, num_nodes=1, ranks_per_node=(1,), hosts=("localhost",), source="test")
    return Run(rank=0, local_rank=0, world=world, device="cpu", accelerator="cpu", node_rank=0, launched=False)


def _moves_while_building(monkeypatch, model: dict, precision: str) -> tuple[list[dict], object]:
    """load_trained_model on one process; every Module.to call that names a device on a UNet2DConditionModel, as seen
    just before it runs."""
    from diffusers import UNet2DConditionModel

    from dstune.startup import load_trained_model

    spec = Spec.model_validate(
        {
            "model": {"family": "sd", **model},
            "data": {"path": "builtin:shapes"},
            "train": {"precision": precision, "max_steps": 1, "micro_batch_size": 1},
            "output": {"cache_dir": str(CACHE_DIR)},
        }
    )
    moves, real_to = [], torch.nn.Module.to

    def recording_to(module, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if isinstance(module, UNet2DConditionModel) and device is not None:
            first = next(module.parameters())
            moves.append(
                {
                    "dtype": first.dtype,
                    "from": first.device.type,
                    "to": device.type,
                    "fp32_linears": sum(
                        type(m) is torch.nn.Linear and ".lora_" not in name for name, m in module.named_modules()
                    ),
                }
            )  # adapters are Linear too
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    built = load_trained_model(_one_process_run(), spec)
    monkeypatch.setattr(torch.nn.Module, "to", real_to)
    return moves, built


def test_full_training_module_moves_in_its_training_dtype(monkeypatch):
    moves, built = _moves_while_building(monkeypatch, {}, "bf16")
    assert moves, "the trainable module was never moved to the run's device"
    assert all(move["dtype"] == torch.bfloat16 for move in moves), moves
    assert next(built.trainable.parameters()).dtype == torch.bfloat16
    # buffers stay as loaded, as DeepSpeed's own cast leaves them (parameters only)
    assert all(b.dtype != torch.bfloat16 for b in built.trainable.buffers())


def test_quantized_base_reaches_the_device_quantized(monkeypatch):
    pytest.importorskip("bitsandbytes")
    lora = {"train": "lora", "lora": {"rank": 2, "alpha": 2}, "base_precision": "int8"}
    moves, built = _moves_while_building(monkeypatch, lora, "bf16")
    assert moves and all(move["fp32_linears"] == 0 and move["dtype"] == torch.bfloat16 for move in moves), moves
    int8 = [p for p in built.trainable.parameters() if p.dtype == torch.int8]
    adapters = [p for p in built.trainable.parameters() if p.requires_grad]
    assert int8 and adapters and all(p.dtype == torch.bfloat16 for p in adapters)
