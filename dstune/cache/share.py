"""How ranks share a cache folder: who sees which folder, a barrier with its own timeout, the folder's path.

Each rank writes a probe file into its cache folder and looks which ranks' probes it sees: ranks that see each
other share the folder (one node, or shared storage) and split that folder's entries between them; ranks with a
folder of their own (node-local disks, `{node}`/`{rank}` in data.cache.dir) build it all, because the global-epoch
sampler sends every sample to every rank over the epochs. Used by both entry kinds (latents/text, codec tokens).
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path

from dstune.distributed import all_gather_object


def cache_folder(cache_dir: str | None, output_cache_dir: str, rank: int, node_rank: int) -> Path:
    """data.cache.dir with {rank}/{node} filled in; omitted: <output.cache_dir>/encoded."""
    text = cache_dir if cache_dir else str(Path(output_cache_dir) / "encoded")
    return Path(text.replace("{rank}", str(rank)).replace("{node}", str(node_rank))).expanduser()


def sharing_group(run, folder: Path) -> list[int]:
    """The ranks that see the same cache folder as this one (this rank included), found with probe files."""
    token = all_gather_object(secrets.token_hex(8))[0]  # not torch's RNG: that would shift training's draws
    probes = folder / ".probes"
    probes.mkdir(parents=True, exist_ok=True)
    mine = probes / f"{token}-{run.rank}"
    mine.write_text(str(run.rank))
    all_gather_object(None)  # everyone has written before anyone looks
    seen = sorted(int(p.name.rsplit("-", 1)[1]) for p in probes.glob(f"{token}-*"))
    all_gather_object(None)  # everyone has looked before anyone deletes
    mine.unlink()
    return seen


def monitored_barrier(run, timeout_minutes: int) -> str | None:
    """Wait for every rank on a gloo side group with its own timeout (works beside nccl too); an error naming the
    ranks that did not arrive, or None."""
    import torch.distributed as dist

    if not dist.is_initialized() or run.world_size == 1:
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(minutes=timeout_minutes), wait_all_ranks=True)
    except RuntimeError as err:
        return (
            f"cache build: not every rank finished within data.cache.barrier_timeout_minutes={timeout_minutes} "
            f"({str(err).splitlines()[0]}). Build the cache first (`dstune cache SPEC` or `--cache-only`) or "
            "raise the timeout."
        )
    return None
