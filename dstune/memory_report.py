"""The plan table's Memory group (dstune.report prints it): what each GPU holds per phase, host RAM and NVMe per
node, the cache on disk, the verdict against --gpu-memory and the changes that would make a run fit, from the memory
plan's dict (dstune.memory.plan / phases). Torch-free, like the report."""

from __future__ import annotations

from dstune.memory.verdict import common_gpus_text
from dstune.sets_plan import preservation_rows


def count_text(number: int) -> str:
    """2567463684 -> "2.57 B", 37355520 -> "37.4 M"."""
    return f"{number / 1e9:.3g} B" if number >= 1e9 else f"{number / 1e6:.3g} M"


def gb(value: float) -> str:
    """Bytes in GB (10^9), or MB below one GB."""
    return f"{value / 1e9:.3g} GB" if value >= 1e9 else f"{value / 1e6:.3g} MB"


def _text_encoder_rows(memory: dict, counts: dict) -> list[tuple[str, str]]:
    """Where the text encoders load: once per node (how much of the host figure they are), or on every rank and why."""
    if memory.get("host_once_per_node_bytes"):
        return [("  text encoders", gb(memory["host_once_per_node_bytes"]) + " of it, on one rank per node")]
    if counts.get("text_on_every_rank"):
        return [("  text encoders", f"on every rank: {counts['text_on_every_rank']}")]
    return []


def _quantized_base_rows(counts: dict) -> list[tuple[str, str]]:
    """model.base_precision int8 under ZeRO-3: the base's stored share per rank."""
    quantized = counts.get("quantized_base")
    if not quantized:
        return []
    return [
        (
            "  int8 base",
            f"{gb(quantized['stored_bytes_per_rank'])} stored per GPU ({gb(quantized['int8_codes_bytes_per_rank'])} "
            f"int8 codes of {count_text(quantized['linear_weights'])} linear weights, a scale per row, the rest at "
            "train.precision); each gathered layer adds its dequantized copy while it computes",
        )
    ]


def memory_rows(memory: dict, spec) -> list[tuple[str, str]]:
    """The Memory group: what each GPU holds, host RAM and NVMe per node, the cache on disk, the verdict."""
    if memory.get("per_gpu") is None:
        return [("unknown", memory.get("unknown", ""))]
    gpu, counts = memory["per_gpu"], memory["parameters"]
    what = (
        "full"
        if counts["trainable_params"] == counts["module_params"]
        else f"LoRA: {count_text(counts['trainable_params'])} adapters on a frozen base of "
        f"{count_text(counts['frozen_base_params'])}"
    )
    companions = _frozen_parts_text(counts, getattr(spec.model, "text_encoder_offload", "none") == "cpu")
    checkpointing = "on" if getattr(spec.model, "gradient_checkpointing", False) else "off"
    rows = [
        (
            "model",
            f"{counts['module']} {count_text(counts['module_params'])} parameters ({what}); largest layer "
            f"{count_text(counts['largest_layer_params'])}; from {counts['origin']}",
        ),
        ("frozen parts", companions),
        *_quantized_base_rows(counts),
        ("per GPU, step", f"{gb(gpu['total_bytes'])} in all (a training step)"),
        ("  parameters", gb(gpu["parameters_bytes"])),
        ("  gradients", gb(gpu["gradients_bytes"])),
        ("  optimizer states", gb(gpu["optimizer_bytes"])),
        ("  frozen weights", gb(gpu["frozen_bytes"]) + _quantized_file_text(memory)),
        (
            "  activations",
            f"{gb(gpu['activations_bytes'])} (estimate; gradient checkpointing {checkpointing}"
            + _offload_text(spec, gpu)
            + ")",
        ),
        *_working_rows(gpu),
        ("  DeepSpeed buffers", gb(gpu["buffers_bytes"]) + _all_to_all_text(memory)),
        *([("  EMA", gb(gpu["ema_bytes"]) + " (fp32 share)")] if gpu.get("ema_bytes") else []),
        *preservation_rows(spec),
        ("  runtime reserve", gb(gpu["runtime_reserve_bytes"]) + " (CUDA context, NCCL, allocator)"),
        *_phase_rows(memory),
        *_encoding_rows(memory),
        ("host RAM per node", gb(memory["host_per_node_bytes"]) + " (model-related; add the processes' own)"),
        *_text_encoder_rows(memory, counts),
    ]
    if memory.get("host_warning"):
        rows.append(("  warning", memory["host_warning"]))
    if counts.get("expert"):
        rows.insert(1, ("expert", counts["expert"]["text"]))
    rows += _sampling_rows(counts.get("sampling_companions") or {}, memory, bool(spec.sample.prompts))
    if memory.get("nvme_per_node_bytes"):
        rows.append(("NVMe per node", gb(memory["nvme_per_node_bytes"])))
    if memory.get("cache_disk_bytes"):
        rows.append(("cache on disk", gb(memory["cache_disk_bytes"])))
    if memory["fits"] is None:  # no --gpu-memory: the spec planned for each card people train on
        rows.append(("common GPUs", _common_gpus_row(memory)))
    return rows + _verdict_rows(memory)


def _common_gpus_row(memory: dict) -> str:
    """The common cards' verdict, and where the smallest card that fits plans a smaller cache pass than the figures
    above (the most entries a pass), its own peak."""
    verdicts = memory["common_gpus"]

    def entries(n: int) -> str:
        return f"{n} {'entry' if n == 1 else 'entries'} a cache pass"

    most = memory["cache_encoding"]["entries_per_pass"]
    said = f"{common_gpus_text(verdicts)} (peak {gb(memory['peak_per_gpu_bytes'])} per GPU"
    smallest = next((row for row in verdicts if row["fits"]), None)
    if smallest and smallest["entries_per_pass"] != most:
        said += (
            f" with {entries(most)}; on {smallest['gpu'].removesuffix('GB')} GB "
            f"{gb(smallest['peak_per_gpu_bytes'])} with {entries(smallest['entries_per_pass'])}"
        )
    return said + "; check one card, with what would make it fit: --gpu-memory SIZE)"


def _frozen_parts_text(counts: dict, text_offloaded: bool) -> str:
    """The frozen parts with their parameters and, for those a cache replaces, where they go while training
    (`text_offloaded`: model.text_encoder_offload, the text encoders built the cache from host memory)."""
    once = counts.get("once_per_node_companions") or []

    def where(name: str) -> str:
        if name in once and text_offloaded:
            return (
                " (cached: one rank per node, in host memory, one layer at a time on the GPU; dropped after the cache)"
            )
        if name in once:
            return " (cached: one rank per node, dropped after the cache)"
        return " (cached: host)" if name in counts["cached_companions"] else ""

    return ", ".join(f"{name} {count_text(n)}{where(name)}" for name, n in counts["companions"].items()) or "none"


def _verdict_rows(memory: dict) -> list[tuple[str, str]]:
    """--gpu-memory's verdict and, where the run does not fit, the cheapest settings that make it fit (each as its
    --set lines, its figure validate's own for them, and what it costs), more GPUs where they make it fit, or why
    nothing does (dstune.memory_advice)."""
    rows: list[tuple[str, str]] = []
    if memory["fits"] is None:
        return rows
    rows.append(("--gpu-memory", f"{gb(memory['gpu_memory_bytes'])}: {'fits' if memory['fits'] else 'DOES NOT FIT'}"))
    if memory["fits"]:
        return rows
    for item in memory["suggestions"]:
        relieves = f" (relieves the {item['relieves']} phase)" if item.get("relieves") else ""
        sets = " ".join(f"--set {line}" for line in item.get("set") or item["change"].split())
        rows.append(("  would fit with", f"{sets} -> {gb(item['per_gpu_total_bytes'])} per GPU at the peak{relieves}"))
        rows += [("    costs", cost) for cost in item.get("costs", ())]
    more = memory.get("more_gpus")
    if more:
        rows.append(
            (
                "  more GPUs",
                f"fits on {more['num_gpus']} GPUs ({more['world']}) as it is: "
                f"{gb(more['per_gpu_total_bytes'])} per GPU at the peak",
            )
        )
    if not memory["suggestions"]:
        why = memory.get("nothing_fits") or "no setting dstune has lowers the peak enough"
        rows.append(("  nothing fits", why + ("" if more else "; more GPUs do not lower it enough either")))
    return rows


def _offload_text(spec, gpu: dict) -> str:
    """model.activation_offload: where the blocks' inputs wait (a GPU run: the host bytes per rank)."""
    if getattr(spec.model, "activation_offload", "none") != "cpu":
        return ""
    held = gpu.get("offloaded_activations_bytes")
    return f"; block inputs offloaded: {gb(held)} per rank in host memory" if held else "; block inputs offloaded"


def _quantized_file_text(memory: dict) -> str:
    quantized = memory.get("transformer_file")
    if not quantized:
        return ""
    return (
        f" (the transformer as model.transformer_file stores it: {gb(quantized['stored_bytes'])}; its largest layer "
        f"dequantized, one at a time: {gb(quantized['dequantized_layer_bytes'])}, in the buffers)"
    )


def _working_rows(gpu: dict) -> list[tuple[str, str]]:
    """The step's working memory beside the activations (dstune.memory.working), where there is any."""
    rows = (
        ("transients", gpu.get("backward_transients_bytes"), "the backward's: logits gradient, masks"),
        ("in-flight grads", gpu.get("gradients_in_flight_bytes"), "2 x the largest layer's gradient"),
        ("encoders", gpu.get("encoders_working_bytes"), "uncached: on the micro batch, before the forward pass"),
    )
    return [(f"  {label}", f"{gb(value)} ({why})") for label, value, why in rows if value]


def _encoding_rows(memory: dict) -> list[tuple[str, str]]:
    """How the cache build encodes (the cache phase counts it): entries per encoder pass, the VAE tiled or not."""
    encoding = memory.get("cache_encoding")
    if not encoding or "cache" not in (memory.get("phases") or {}):
        return []
    chosen = (
        "chosen for --gpu-memory"
        if encoding["chosen_for_gpu_memory"]
        else "the most; a run chooses it for its GPU's memory, as --gpu-memory does"
    )
    tiling = ", the VAE tiled (its own tiles)" if encoding["vae_tiling"] else ""
    entries = encoding["entries_per_pass"]
    per_pass = f"{entries} {'entry' if entries == 1 else 'entries'} per encoder pass"
    return [("  cache encoding", f"{per_pass} ({chosen}){tiling}")]


def _all_to_all_text(memory: dict) -> str:
    sequence = memory.get("sequence_parallel") or {}
    if sequence.get("size", 1) == 1:
        return ""
    raised = (
        (
            f"; the reduce bucket raised to the largest trainable parameter, {sequence['reduce_bucket_elements']:,} "
            "elements (ZeRO-3)"
        )
        if sequence.get("reduce_bucket_raised")
        else ""
    )
    return (
        f" (with {gb(sequence['all_to_all_bytes'])} of attention all-to-all buffers; activations are 1/"
        f"{sequence['size']} of a sample's: sequence parallelism{raised})"
    )


PHASE_TEXT = {
    "load": "start-up: the trainable module placed beside every frozen part",
    "cache": "building the cache: every encoder in use, before DeepSpeed's states",
    "step": "a training step",
    "sample": "rendering samples: the encoders back beside DeepSpeed's states",
}


def _phase_rows(memory: dict) -> list[tuple[str, str]]:
    """Each phase's bytes per GPU, the peak marked: the peak is what --gpu-memory is held to."""
    phases = memory.get("phases") or {}
    rows = [
        (
            "per GPU, peak",
            f"{gb(memory['peak_per_gpu_bytes'])} ({memory.get('peak_phase', 'step')} phase: what must fit)",
        )
    ]
    for name, phase in phases.items():
        mark = " <- peak" if name == memory.get("peak_phase") else ""
        rows.append((f"  {name}", f"{gb(phase['per_gpu_bytes'])}: {PHASE_TEXT.get(name, name)}{mark}"))
    return rows


def _sampling_rows(sampling: dict, memory: dict, samples: bool) -> list[tuple[str, str]]:
    """Parts that load only while samples render (a two-expert model's untrained expert): whether they set the peak."""
    if not sampling:
        return []
    what = f"{', '.join(sampling)} ({count_text(sum(sampling.values()))})"
    if not samples:
        return [("while sampling", f"{what} never loads: no sample.prompts")]
    if memory.get("peak_phase") == "sample":
        return [
            (
                "while sampling",
                f"{what} joins on every GPU while samples render (the sample phase is the peak; "
                "it counts in host RAM too)",
            )
        ]
    return [("while sampling", f"{what} joins on every GPU while samples render: below the peak")]
