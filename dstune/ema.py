"""EMA (exponential moving average) of the trained weights, sharded across ranks, for every family and ZeRO stage.

Sharding. Each rank keeps the EMA of only its 1/world share of every trained parameter: the share ZeRO-3 already
gives it (`param.ds_tensor`, its own partition, no communication at all), and under ZeRO 0-2, where every rank
holds the full weights, the same contiguous slice ZeRO-3 would give it (ceil(numel / world) elements per rank).
So the EMA costs 4 bytes per trained parameter in total over all ranks, not per rank: a full copy on every rank
would put (ranks per node) x 4 bytes x parameters into one node's host memory. Updating needs no collective; only
sampling with the EMA under ZeRO 0-2 gathers the shares (once per sample grid), and the export concatenates the
per-rank files offline. Checkpoints hold each rank's share (`ema_rank{R}.pt`), so exact resume holds as for the
optimizer state; a resume on another number of ranks concatenates the shares and cuts this world's (`load_resharded`).

The EMA follows the module's weights as the forward pass sees them (fp32 runs: the fp32 weights; bf16 runs: the
bf16 copy DeepSpeed writes back after each step), like diffusers' EMAModel, kept in fp32.
When. The training loop calls `Ema.on_optimizer_step` right after every optimizer step DeepSpeed really applied
(`engine.was_step_applied()`: a skipped fp16 overflow step leaves the weights, and so the EMA, unchanged).
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from pathlib import Path

import torch

FILE_PATTERN = "ema_rank{rank}.pt"
_FILE_RE = re.compile(r"ema_rank(\d+)\.pt")


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of a flattened parameter owned by `rank`: ZeRO-3's partitioning (ceil(numel / world) each)."""
    part = math.ceil(numel / world_size)
    return min(rank * part, numel), min((rank + 1) * part, numel)


def _is_zero3(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_tensor")


def _local_share(param: torch.nn.Parameter, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of `param` as a 1-D view (writes go into the parameter)."""
    if _is_zero3(param):
        return param.ds_tensor.data.view(-1)  # ceil(numel / world) elements; the last rank's end is padding
    start, end = shard_range(param.numel(), rank, world_size)
    return param.data.view(-1)[start:end]


def decay_at(update_index: int, decay: float, warmup: bool) -> float:
    """The decay of the update with this 0-based index (diffusers' EMAModel: min(decay, (1 + n) / (10 + n)))."""
    return min(decay, (1 + update_index) / (10 + update_index)) if warmup else decay


class Ema:
    """The EMA of `named_params` (the trainable parameters, after deepspeed.initialize) on this rank."""

    def __init__(self, named_params, settings, rank: int = 0, world_size: int = 1):
        self.decay, self.warmup, self.every_steps = settings.decay, settings.warmup, settings.every_steps
        self.use_for_export = settings.export == "ema"
        self.rank, self.world_size = rank, world_size
        self.params = dict(named_params)
        if not self.params:
            raise ValueError("EMA: the model has no trainable parameters")
        self.shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in self.params.items()}
        first = _local_share(next(iter(self.params.values())), rank, world_size)
        self.device = torch.device("cpu") if settings.device == "cpu" else first.device
        self.shadow = {
            name: _local_share(p, rank, world_size).detach().to(self.device, torch.float32, copy=True)
            for name, p in self.params.items()
        }
        self.optimizer_steps = 0  # optimizer updates seen
        self.updates = 0  # EMA updates made (every `every_steps` optimizer updates)

    def on_optimizer_step(self) -> None:
        """Called after every applied optimizer update (no collective inside: every rank updates its own share)."""
        self.optimizer_steps += 1
        if self.optimizer_steps % self.every_steps == 0:
            self.update()

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - decay_at(self.updates, self.decay, self.warmup)
        for name, param in self.params.items():
            current = _local_share(param, self.rank, self.world_size)
            self.shadow[name].lerp_(current.to(self.device, torch.float32), weight)
        self.updates += 1

    # ------------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """Plain tensors, ints and strings only (checkpoints load weights-only)."""
        return {
            "format": 1,
            "rank": self.rank,
            "world_size": self.world_size,
            "optimizer_steps": self.optimizer_steps,
            "updates": self.updates,
            "numels": {name: math.prod(shape) for name, shape in self.shapes.items()},
            "shapes": {name: list(shape) for name, shape in self.shapes.items()},
            "shards": {name: shard.cpu() for name, shard in self.shadow.items()},
        }

    def load_state_dict(self, state: dict, where: str) -> None:
        if state.get("world_size") != self.world_size or state.get("rank") != self.rank:
            raise ValueError(
                f"{where}: EMA share of rank {state.get('rank')} of {state.get('world_size')}, "
                f"this is rank {self.rank} of {self.world_size}"
            )
        saved = state["shards"]
        if set(saved) != set(self.shadow):
            missing, extra = sorted(set(self.shadow) - set(saved)), sorted(set(saved) - set(self.shadow))
            raise ValueError(
                f"{where}: the EMA does not fit this model: {len(missing)} trained parameters missing "
                f"(e.g. {missing[:2]}), {len(extra)} unknown (e.g. {extra[:2]})"
            )
        for name, shard in saved.items():
            if shard.shape != self.shadow[name].shape:
                raise ValueError(
                    f"{where}: EMA share of {name} has shape {list(shard.shape)}, expected "
                    f"{list(self.shadow[name].shape)}"
                )
            self.shadow[name].copy_(shard)
        self.optimizer_steps, self.updates = int(state["optimizer_steps"]), int(state["updates"])

    def save(self, folder: Path) -> Path:
        path = Path(folder) / FILE_PATTERN.format(rank=self.rank)
        torch.save(self.state_dict(), path)
        return path

    def load(self, folder: Path) -> None:
        path = Path(folder) / FILE_PATTERN.format(rank=self.rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no EMA in this checkpoint (train.ema was off when it was written?)")
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), str(path))

    def load_resharded(self, folder: Path) -> None:
        """The EMA of a checkpoint written by another number of ranks: every rank's share concatenated (as the
        export does), then this rank's share cut for this world (the padding of a ZeRO-3 partition stays 0)."""
        states = _read_shares(folder)
        full = _concatenated(folder, states)
        if set(full) != set(self.shadow):
            missing, extra = sorted(set(self.shadow) - set(full)), sorted(set(full) - set(self.shadow))
            raise ValueError(
                f"{folder}: the EMA does not fit this model: {len(missing)} trained parameters missing "
                f"(e.g. {missing[:2]}), {len(extra)} unknown (e.g. {extra[:2]})"
            )
        for name, shadow in self.shadow.items():
            flat = full[name].reshape(-1)
            if flat.numel() != math.prod(self.shapes[name]):
                raise ValueError(
                    f"{folder}: EMA of {name} has {flat.numel()} elements, the model's {math.prod(self.shapes[name])}"
                )
            start, _ = shard_range(flat.numel(), self.rank, self.world_size)
            piece = flat[start : start + shadow.numel()]
            shadow.zero_()
            shadow[: piece.numel()].copy_(piece)
        self.optimizer_steps, self.updates = int(states[0]["optimizer_steps"]), int(states[0]["updates"])

    # ---------------------------------------------------------------------------------------------- sampling

    @contextmanager
    def weights_in_model(self):
        """Collective under ZeRO 0-2 (gathers the shares). Inside, the model's trained parameters hold the EMA;
        afterwards they hold exactly what they held before."""
        saved = {}
        try:
            with torch.no_grad():
                for name, param in self.params.items():
                    if _is_zero3(param):  # the forward pass gathers the partitions itself
                        target = _local_share(param, self.rank, self.world_size)
                        saved[name] = target.clone()
                        target.copy_(self.shadow[name].to(target.device, target.dtype))
                    else:
                        saved[name] = param.data.to(self.device, copy=True)  # off the accelerator with cpu
                        param.data.view(-1).copy_(self._gathered(name, param))
            yield
        finally:
            with torch.no_grad():
                for name, before in saved.items():
                    param = self.params[name]
                    target = _local_share(param, self.rank, self.world_size) if _is_zero3(param) else param.data
                    target.copy_(before)

    def _gathered(self, name: str, param: torch.nn.Parameter) -> torch.Tensor:
        """The full flattened EMA of one parameter, from every rank's share (ZeRO 0-2)."""
        shard = self.shadow[name].to(param.device, param.dtype)
        if self.world_size == 1:
            return shard
        import torch.distributed as dist

        part = math.ceil(param.numel() / self.world_size)
        padded = torch.zeros(part, device=param.device, dtype=param.dtype)
        padded[: shard.numel()] = shard
        pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(pieces, padded)
        return torch.cat(pieces)[: param.numel()]


# ------------------------------------------------------------------------------------------------------ export


def _read_shares(folder: Path) -> list[dict]:
    """Every rank's saved EMA share in a checkpoint folder, in rank order (all of them, or FileNotFoundError)."""
    files = {int(m.group(1)): p for p in Path(folder).glob("ema_rank*.pt") if (m := _FILE_RE.fullmatch(p.name))}
    if not files:
        raise FileNotFoundError(f"{folder}: no ema_rank*.pt (the run had train.ema off)")
    states = [torch.load(files[r], map_location="cpu", weights_only=True) for r in sorted(files)]
    world_size = states[0]["world_size"]
    if sorted(files) != list(range(world_size)):
        raise FileNotFoundError(f"{folder}: EMA shares of ranks {sorted(files)}, expected 0..{world_size - 1}")
    return states


def _concatenated(folder: Path, states: list[dict]) -> dict[str, torch.Tensor]:
    full = {}
    for name, numel in states[0]["numels"].items():
        flat = torch.cat([state["shards"][name].float() for state in states])
        if flat.numel() < numel:
            raise ValueError(f"{folder}: EMA shares of {name} hold {flat.numel()} of {numel} elements")
        full[name] = flat[:numel].reshape(states[0]["shapes"][name])
    return full


def consolidated_ema(folder: Path) -> dict[str, torch.Tensor]:
    """Full fp32 EMA tensors from every rank's share in a checkpoint folder (one process, no launcher)."""
    return _concatenated(folder, _read_shares(folder))


def overlay_ema(state: dict, ema: dict) -> dict:
    """`state` with every EMA tensor in place of the raw one (reshaped to the state's shape: 0-dim parameters are
    stored as (1,) while training). Every EMA name must be in `state`."""
    unknown = sorted(set(ema) - set(state))
    if unknown:
        raise ValueError(f"EMA tensors with no matching weight in the checkpoint: {unknown[:3]}")
    out = dict(state)
    for name, tensor in ema.items():
        out[name] = tensor.reshape(state[name].shape).to(state[name].dtype)
    return out
