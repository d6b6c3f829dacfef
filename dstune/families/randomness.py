"""Per-sample random draws: a sample's noise, timestep and the like depend only on (run seed, optimizer step, dataset
index, purpose), never on the global RNG, the rank, the micro-batch split or the device. So 1 rank x 4 accumulation
steps and 2 ranks x 2 draw the same noise for the same sample at the same step, and CPU and GPU runs agree.
Every family draws through these (dstune.families.base describes the contract)."""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

import torch


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
