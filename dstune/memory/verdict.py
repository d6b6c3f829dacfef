"""The memory verdict of a run: whether its peak fits the GPUs (`memory_json`, what `dstune validate --json` says
under `memory`). When it does not, dstune.memory_advice re-plans the spec with the settings that would lower the
peak (`suggestions`: validate fills them in). The arithmetic behind them is dstune.memory.plan's. Torch-free.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from dstune.memory.frozen_base import int8_codes_per_rank
from dstune.memory.phases import host_warning
from dstune.memory.plan import (
    ModelCounts,
    Setup,
    estimate,
    frozen_base_bytes,
    parse_size,
    reduce_bucket_elements,
)
from dstune.memory.working import MAX_CHUNK_ENTRIES
from dstune.card import COMMON_GPUS, gpu_words


def common_gpus(counts: ModelCounts, setup: Setup) -> list[dict]:
    """Each common card's verdict, the spec planned for that card as `--gpu-memory` would plan it: the cache build
    encodes as many entries a pass as fit that card (choose_encoding), so a peak over a card's memory with the most
    entries a pass may still fit it with fewer."""
    rows = []
    for size, _ in COMMON_GPUS:
        card_bytes = parse_size(size)
        on_card = choose_encoding(counts, setup, card_bytes)
        peak = estimate(counts, on_card).peak
        rows.append(
            {
                "gpu": size,
                "memory_bytes": int(card_bytes),
                "peak_per_gpu_bytes": int(peak),
                "entries_per_pass": on_card.cache_chunk,
                "fits": peak <= card_bytes,
            }
        )
    return rows


def common_gpus_text(verdicts: list[dict]) -> str:
    """Whether the spec fits the common cards (common_gpus' verdicts), in one line: the smallest that holds it, or
    none of them."""
    cards = [(row["gpu"], gpu_words(row["gpu"]), row["fits"]) for row in verdicts]
    fitting = [name for _, name, fits in cards if fits]
    if not fitting:
        return f"fits none of the common GPUs (the largest, {cards[-1][1]}, is too small)"
    if len(fitting) == len(cards):
        return f"fits every common GPU from {fitting[0]} up"
    return f"fits {fitting[0]} and larger; not {cards[len(cards) - len(fitting) - 1][1]}"


def choose_encoding(counts: ModelCounts, setup: Setup, gpu_bytes: Optional[float]) -> Setup:
    """The cache build's chunk, the entries one encoder pass takes (the VAE's, the text encoders'): without a GPU
    size the most (MAX_CHUNK_ENTRIES), with one the most whose cache phase fits, down to one (where even one
    does not fit, the verdict says the cache phase does not)."""
    if gpu_bytes is None:
        return replace(setup, cache_chunk=MAX_CHUNK_ENTRIES)

    def fits(chunk: int) -> bool:
        phases = estimate(counts, replace(setup, cache_chunk=chunk)).phases
        return "cache" not in phases or phases["cache"].per_gpu <= gpu_bytes

    return replace(setup, cache_chunk=next((n for n in range(MAX_CHUNK_ENTRIES, 0, -1) if fits(n)), 1))


def memory_json(counts: ModelCounts, setup: Setup, gpu_bytes: Optional[float]) -> dict:
    """The `memory` object of `dstune validate --json` (names other tools read: docs/memory.md)."""
    setup = choose_encoding(counts, setup, gpu_bytes)
    result = estimate(counts, setup)
    fits = None if gpu_bytes is None else result.peak <= gpu_bytes
    host = result.host_per_node
    return {
        "per_gpu": result.per_gpu(),  # the training step
        "phases": {
            name: {
                "per_gpu_bytes": int(phase.per_gpu),
                "parts": {label: int(value) for label, value in phase.parts.items() if value},
                "one_at_a_time": [
                    held
                    for held in ([label for label in group if phase.parts.get(label)] for group in phase.one_at_a_time)
                    if held
                ],
            }
            for name, phase in result.phases.items()
        },
        "cache_encoding": {
            "entries_per_pass": setup.cache_chunk,
            "chosen_for_gpu_memory": gpu_bytes is not None,
            "vae_tiling": setup.vae_tiling,
        },
        "peak_per_gpu_bytes": int(result.peak),  # the largest phase: what must fit
        "peak_phase": result.peak_phase.name,
        "host_per_node_bytes": int(host),
        "host_once_per_node_bytes": int(result.host_once_per_node),
        "host_warning": host_warning(host, counts, setup),
        "nvme_per_node_bytes": int(result.nvme_per_node),
        "cache_disk_bytes": int(result.cache_bytes),
        "gpu_memory_bytes": None if gpu_bytes is None else int(gpu_bytes),
        "fits": fits,
        **({"common_gpus": common_gpus(counts, setup)} if gpu_bytes is None else {}),
        "suggestions": [],  # dstune.memory_advice's, where the spec does not fit (validate re-plans it)
        **(
            {
                "sequence_parallel": {
                    "size": setup.sequence_parallel,
                    "all_to_all_bytes": int(setup.all_to_all_bytes),
                    "reduce_bucket_elements": reduce_bucket_elements(counts, setup),
                    "reduce_bucket_raised": reduce_bucket_elements(counts, setup) > setup.reduce_bucket,
                }
            }
            if setup.sequence_parallel > 1
            else {}
        ),
        **(
            {  # model.transformer_file: the frozen base as the file stores it, one layer of it dequantized
                "transformer_file": {
                    "stored_bytes": round(frozen_base_bytes(counts, setup)),
                    "dequantized_layer_bytes": int(setup.weight_bytes * setup.dequantized_layer_params),
                }
            }
            if setup.dequantized_layer_params
            else {}
        ),
        "parameters": _parameters_json(counts, setup),
    }


def _parameters_json(counts: ModelCounts, setup: Setup) -> dict:
    """`memory.parameters`: what the plan counted (docs/memory.md names each key)."""
    return {
        "module": counts.trainable_module,
        "module_params": counts.module_params,
        "trainable_params": counts.trainable_params,
        "frozen_base_params": counts.frozen_base_params,
        "largest_layer_params": counts.largest_layer_params,
        "companions": dict(counts.companions),
        "cached_companions": list(counts.cached_companions),
        "once_per_node_companions": list(counts.once_per_node),
        "text_on_every_rank": counts.text_on_every_rank or None,
        "origin": counts.origin,
        "sampling_companions": dict(counts.sampling_companions),
        "expert": counts.expert,
        # model.base_precision int8 under ZeRO-3: what each rank stores of the base (int8 codes, scales, the
        # rest at the compute dtype) and of it the int8 codes alone
        **(
            {
                "quantized_base": {
                    "stored_bytes_per_rank": frozen_base_bytes(counts, setup) / setup.world_size,
                    "int8_codes_bytes_per_rank": int8_codes_per_rank(counts, setup),
                    "linear_weights": counts.linear_weights[0],
                    "linear_rows": counts.linear_weights[1],
                }
            }
            if setup.int8_partitioned and counts.frozen_base_params and counts.linear_weights[0]
            else {}
        ),
    }
