"""The memory verdict of a run: whether its peak fits the GPUs (`memory_json`, what `dstune validate --json` says
under `memory`), and when it does not, the cheapest changes that make it fit, each with its per-GPU peak and the
phase it relieves (`suggestions`). The arithmetic behind them is dstune.memory.plan's. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from dstune.memory.phases import host_warning
from dstune.memory.plan import ModelCounts, Setup, estimate, reduce_bucket_elements
from dstune.memory.working import MAX_CHUNK_ENTRIES
from dstune.spec.models import BASE_PRECISION_BYTES


@dataclass(frozen=True)
class Change:
    kind: str  # one suggestion per kind
    text: str  # what to set, as `--set` keys
    counts: ModelCounts
    setup: Setup


def _divisors_below(number: int) -> list[int]:
    return [d for d in range(number - 1, 0, -1) if number % d == 0]


def candidate_changes(counts: ModelCounts, setup: Setup) -> list[Change]:
    """Single changes, cheapest first (what costs least speed, or changes least of what is trained); within a kind
    the mildest first."""
    return _schedule_changes(counts, setup) + _precision_and_offload_changes(counts, setup)


def _schedule_changes(counts: ModelCounts, setup: Setup) -> list[Change]:
    """What changes no weight's precision or place: no samples, a higher ZeRO stage, gradient checkpointing, a
    smaller micro batch (with the same global batch)."""
    changes = []
    if setup.samples:  # first: costs no speed and changes nothing that trains
        never = f": {', '.join(counts.sampling_companions)} never loads" if counts.sampling_companions else ""
        changes.append(
            Change(
                "samples",
                f"sample.prompts=[] (no samples during training{never})",
                counts,
                replace(setup, samples=False),
            )
        )
    changes += [
        Change("stage", f"deepspeed.zero_stage={stage}", counts, replace(setup, zero_stage=stage))
        for stage in range(setup.zero_stage + 1, 4)
    ]
    if not setup.gradient_checkpointing and counts.checkpointed_sample_bytes < counts.activation_sample_bytes:
        changes.append(
            Change(
                "checkpointing",
                "model.gradient_checkpointing=true",
                counts,
                replace(setup, gradient_checkpointing=True),
            )
        )
    if not setup.vae_tiling and (counts.encode_entry_tiled_bytes or counts.decode_sample_tiled_bytes):
        changes.append(
            Change(
                "vae tiling",
                "model.vae_tiling=true (the VAE's own tiles: latents and samples differ from untiled ones)",
                counts,
                replace(setup, vae_tiling=True),
            )
        )
    for micro in _divisors_below(setup.micro_batch):
        accumulation = setup.accumulation * setup.micro_batch // micro
        changes.append(
            Change(
                "micro batch",
                f"train.micro_batch_size={micro} train.gradient_accumulation_steps={accumulation} (same global batch)",
                counts,
                replace(setup, micro_batch=micro, accumulation=accumulation),
            )
        )
    return changes


def _precision_and_offload_changes(counts: ModelCounts, setup: Setup) -> list[Change]:
    """What changes how or where weights are held, or what trains: a quantized frozen base, optimizer and parameter
    offload, LoRA in place of full training."""
    changes = []
    if setup.lora and setup.zero_stage < 3:  # ZeRO-3 cannot partition quantized weights (validate refuses it)
        changes += [
            Change(
                "base precision",
                f"model.base_precision={name} (quantized frozen base)",
                counts,
                replace(setup, base_bytes_per_param=BASE_PRECISION_BYTES[name]),
            )
            for name in ("int8", "nf4")
        ]
    if setup.offload_optimizer == "none":
        stage = max(setup.zero_stage, 1)
        extra = "" if stage == setup.zero_stage else f" deepspeed.zero_stage={stage}"
        changes.append(
            Change(
                "optimizer offload",
                "deepspeed.offload_optimizer=cpu" + extra,
                counts,
                replace(setup, zero_stage=stage, offload_optimizer="cpu"),
            )
        )
    if setup.offload_param == "none":
        extra = "" if setup.offload_optimizer != "none" else " deepspeed.offload_optimizer=cpu"
        changes.append(
            Change(
                "parameter offload",
                f"deepspeed.zero_stage=3 deepspeed.offload_param=cpu{extra}",
                counts,
                replace(
                    setup,
                    zero_stage=3,
                    offload_param="cpu",
                    offload_optimizer="cpu" if extra else setup.offload_optimizer,
                ),
            )
        )
    if not setup.lora and counts.default_lora_params:
        changes.append(
            Change(
                "lora",
                "model.train=lora (rank 16 on the attention projections)",
                replace(counts, trainable_params=counts.default_lora_params),
                replace(setup, lora=True),
            )
        )
    return changes


def suggestions(counts: ModelCounts, setup: Setup, gpu_bytes: float, limit: int = 5) -> list[dict]:
    """The cheapest changes after which the run fits in gpu_bytes per GPU: the mildest single change of each kind
    that fits, cheapest kind first; when no single change fits, the strongest change of each kind combined, in that
    order, until the run fits (nothing when even all of them together do not)."""
    found, kinds = [], set()
    relieved = estimate(counts, setup).peak_phase.name  # the phase that does not fit now
    changes = candidate_changes(counts, setup)
    for change in changes:
        after = estimate(change.counts, change.setup)
        if after.peak <= gpu_bytes and change.kind not in kinds:
            kinds.add(change.kind)
            found.append(
                {
                    "change": change.text,
                    "per_gpu_total_bytes": int(after.peak),
                    "relieves": relieved,
                    "peak_phase": after.peak_phase.name,
                }
            )
    if found:
        return found[:limit]
    strongest = {change.kind: change for change in changes}  # the last of each kind is the strongest
    texts, current_counts, current = [], counts, setup
    for change in strongest.values():
        updates = {
            name: getattr(change.setup, name)
            for name in Setup.__dataclass_fields__
            if getattr(change.setup, name) != getattr(setup, name)
        }
        if "zero_stage" in updates:
            updates["zero_stage"] = max(updates["zero_stage"], current.zero_stage)
        current = replace(current, **updates)
        current_counts = change.counts if change.counts is not counts else current_counts
        texts.append(change.text)
        after = estimate(current_counts, current)
        if after.peak <= gpu_bytes:
            return [
                {
                    "change": " + ".join(texts),
                    "per_gpu_total_bytes": int(after.peak),
                    "relieves": relieved,
                    "peak_phase": after.peak_phase.name,
                }
            ]
    return []


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
        "suggestions": suggestions(counts, setup, gpu_bytes) if fits is False else [],
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
        "parameters": {
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
        },
    }
