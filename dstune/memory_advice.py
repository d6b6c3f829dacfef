"""What would make a run fit its GPUs (`dstune validate --gpu-memory`): a search over every setting dstune has that
lowers the per-GPU peak, each suggestion the plan's own figure for the spec re-planned with its `--set` lines.

    LEVERS                 one row per setting: its name, what it costs (speed, or what changes in the training),
                           and its `--set` lines for a validated spec, mildest first
    advise(...) -> dict    the cheapest combinations that fit (each re-planned: `suggestions`), more GPUs where
                           they make it fit (`more_gpus`), or why nothing fits (`nothing_fits`)

The search re-plans the spec file with the user's `--set` lines plus a combination's (dstune.validate's
load_and_validate and plan_memory, as `dstune validate SPEC --set ...` would): a combination the spec's rules
refuse is never suggested, and the figure printed is the one validate prints for it. Levers are tried cheapest
first (the table's order); the resolution and the frames come last, since they change what is trained. A re-plan
takes a few milliseconds (the configs are read once); a search makes a few dozen. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from dstune.memory.working import text_part
from dstune.spec.load import SpecError
from dstune.spec.models import AUDIO_FAMILIES
from dstune.validate import Resolved, load_and_validate, plan_memory
from dstune.world import World, WorldError

Lines = dict  # "--set" key -> value, as typed after the "="
MAX_SUGGESTIONS = 3
MORE_GPU_FACTORS = (2, 4, 8)  # more GPUs: the world's nodes times these (ranks per node as now)


@dataclass(frozen=True)
class Lever:
    name: str
    cost: str  # what it costs: speed, or what changes in the training
    options: Callable[[Resolved], list]  # the validated spec -> its --set lines (Lines), mildest first


def _flag(key: str) -> Callable[[Resolved], list]:
    """A boolean setting of the spec that is off: turned on."""

    def options(resolved: Resolved) -> list:
        section, _, name = key.rpartition(".")
        node = resolved.spec
        for part in section.split("."):
            node = getattr(node, part, None)
        return [{key: "true"}] if node is not None and getattr(node, name, True) is False else []

    return options


def _no_samples(resolved: Resolved) -> list:
    return [{"sample.prompts": "[]"}] if resolved.spec.sample.prompts else []


def _latent_cache(resolved: Resolved) -> list:
    data = resolved.spec.data
    if getattr(data.cache, "latents", True):
        return []
    return [{"data.cache.latents": "true", **({} if data.center_crop else {"data.center_crop": "true"})}]


def _zero_stage(resolved: Resolved) -> list:
    stage = int(resolved.ds_config.get("zero_optimization", {}).get("stage", 0))
    return [{"deepspeed.zero_stage": str(s)} for s in range(stage + 1, 4)]


def _micro_batch(resolved: Resolved) -> list:
    """The same global batch in smaller micro batches (more accumulation), the mildest (largest) first."""
    micro, accumulation = resolved.plan.micro_batch_size, resolved.plan.gradient_accumulation_steps
    return [
        {"train.micro_batch_size": str(d), "train.gradient_accumulation_steps": str(accumulation * micro // d)}
        for d in range(micro - 1, 0, -1)
        if micro % d == 0
    ]


def _sequence_parallel(resolved: Resolved) -> list:
    """Each sample's tokens over N ranks, the accumulation N times as many: the same global batch."""
    now = resolved.spec.deepspeed.sequence_parallel_size
    ranks, accumulation = resolved.world.world_size, resolved.plan.gradient_accumulation_steps
    return [
        {"deepspeed.sequence_parallel_size": str(n), "train.gradient_accumulation_steps": str(accumulation * n // now)}
        for n in range(now + 1, ranks + 1)
        if ranks % n == 0 and n % now == 0
    ]


def _optimizer_offload(resolved: Resolved) -> list:
    zero = resolved.ds_config.get("zero_optimization", {})
    if zero.get("offload_optimizer", {}).get("device", "none") != "none":
        return []
    stage = {} if int(zero.get("stage", 0)) >= 1 else {"deepspeed.zero_stage": "1"}
    return [{**stage, "deepspeed.offload_optimizer": "cpu"}]


def _parameter_offload(resolved: Resolved) -> list:
    zero = resolved.ds_config.get("zero_optimization", {})
    if zero.get("offload_param", {}).get("device", "none") != "none":
        return []
    optimizer = zero.get("offload_optimizer", {}).get("device", "none")
    return [
        {
            **({} if int(zero.get("stage", 0)) == 3 else {"deepspeed.zero_stage": "3"}),
            "deepspeed.offload_param": "cpu",
            **({"deepspeed.offload_optimizer": "cpu"} if optimizer == "none" else {}),
        }
    ]


def _activation_offload(resolved: Resolved) -> list:
    """Checkpointed blocks' inputs held in host memory (it needs gradient checkpointing: turned on with it)."""
    model = resolved.spec.model
    if getattr(model, "activation_offload", None) != "none":  # on already, or a family without it
        return []
    checkpointing = {} if model.gradient_checkpointing else {"model.gradient_checkpointing": "true"}
    return [{**checkpointing, "model.activation_offload": "cpu"}]


def _text_encoder_offload(resolved: Resolved) -> list:
    """The text encoders in host memory while they build the text cache (it needs the text cache: turned on with it;
    where they would run beyond it, the spec's rules refuse the combination)."""
    if getattr(resolved.spec.model, "text_encoder_offload", None) != "none":  # on already, or a family without it
        return []
    cache = {} if resolved.spec.data.cache.text_embeddings else {"data.cache.text_embeddings": "true"}
    return [{**cache, "model.text_encoder_offload": "cpu"}]


def _quantized_base(resolved: Resolved) -> list:
    """int8 and nf4; under ZeRO-3 int8 only (nf4 cannot be partitioned: validate refuses it)."""
    model = resolved.spec.model
    if getattr(model, "train", "full") != "lora" or getattr(model, "base_precision", "x") is not None:
        return []
    zero3 = int(resolved.ds_config.get("zero_optimization", {}).get("stage", 0)) == 3
    return [{"model.base_precision": name} for name in (("int8",) if zero3 else ("int8", "nf4"))]


def _lora(resolved: Resolved) -> list:
    return [{"model.train": "lora"}] if getattr(resolved.spec.model, "train", "lora") == "full" else []


def _frames(resolved: Resolved) -> list:
    """Shorter clips: about 3/4, 1/2 and 1/4 of the frames, at 8k + 1 (a count every video VAE takes)."""
    video = getattr(resolved.spec.data, "video", None)
    frames = getattr(video, "frames", None)
    if not isinstance(frames, int) or frames <= 9:
        return []
    counts = sorted({1 + max(1, round((frames - 1) * f / 8)) * 8 for f in (0.75, 0.5, 0.25)}, reverse=True)
    return [{"data.video.frames": str(n)} for n in counts if n < frames]


def _resolution(resolved: Resolved) -> list:
    """A lower resolution: about 3/4 and 1/2 of the side, in multiples of 64 pixels."""
    data = resolved.spec.data
    if data.resolution is None or (data.buckets.enabled and data.buckets.sizes):
        return []
    sides = sorted({max(64, int(data.resolution * f) // 64 * 64) for f in (0.75, 0.5)}, reverse=True)
    return [{"data.resolution": str(side)} for side in sides if side < data.resolution]


def _clip_seconds(resolved: Resolved) -> list:
    """Speech: a shorter longest clip, about 3/4 and 1/2 of it (the longer clips are left out)."""
    data = resolved.spec.data
    if resolved.spec.model.family not in AUDIO_FAMILIES:
        return []
    return [{"data.max_clip_seconds": f"{data.max_clip_seconds * f:g}"} for f in (0.75, 0.5)]


# Cheapest first: the search tries them in this order, and ranks a combination by its most costly row.
LEVERS = (
    Lever("samples", "no samples during training", _no_samples),
    Lever(
        "text cache",
        "captions encoded once before training (changing one rebuilds its entry); the text encoders load on one "
        "rank per node and leave once the cache is built",
        _flag("data.cache.text_embeddings"),
    ),
    Lever(
        "text encoder offload",
        "the text encoders' weights in host memory while they build the text cache, each layer copied to the GPU "
        "for its forward: a slower cache build (the whole encoder crosses the host link once per chunk of "
        "captions), the same embeddings bitwise; training is not slowed",
        _text_encoder_offload,
    ),
    Lever(
        "latent cache",
        "images (clips) encoded by the VAE once before training; one centre crop per image",
        _latent_cache,
    ),
    Lever("codec cache", "clips encoded by the codec once before training", _flag("data.cache.codec_tokens")),
    Lever(
        "VAE tiling",
        "the VAE encodes and decodes through its own tiles: latents and samples differ from untiled ones",
        _flag("model.vae_tiling"),
    ),
    Lever(
        "ZeRO stage",
        "more communication per step (stage 2 partitions the gradients, stage 3 the parameters too)",
        _zero_stage,
    ),
    Lever(
        "gradient checkpointing",
        "each block's forward runs again in backward: about a third slower steps",
        _flag("model.gradient_checkpointing"),
    ),
    Lever(
        "activation offload",
        "each checkpointed block's inputs copied to host memory in forward and back in backward (host RAM holds "
        "them): slower steps, the same training bitwise",
        _activation_offload,
    ),
    Lever("micro batch", "the same global batch in smaller micro batches: more, shorter passes", _micro_batch),
    Lever(
        "sequence parallelism",
        "each sample's tokens split over N ranks (attention all-to-alls in every block); N times fewer data-parallel "
        "ranks, so N times the accumulation for the same global batch",
        _sequence_parallel,
    ),
    Lever(
        "optimizer offload",
        "the optimizer step runs on the CPU (host RAM holds the states): slower steps",
        _optimizer_offload,
    ),
    Lever(
        "parameter offload",
        "every layer's parameters fetched from host memory for each use: much slower steps",
        _parameter_offload,
    ),
    Lever(
        "quantized base",
        "the frozen base held in 8 (4) bits: the adapters train against the quantized weights",
        _quantized_base,
    ),
    Lever("LoRA", "adapters train instead of every weight of the model", _lora),
    Lever("frames", "shorter training clips", _frames),
    Lever("resolution", "training at a lower resolution", _resolution),
    Lever("clip length", "speech clips longer than this are left out of the training", _clip_seconds),
)


@dataclass(frozen=True)
class Planned:
    resolved: Resolved
    memory: dict

    @property
    def peak(self) -> float:
        return self.memory["peak_per_gpu_bytes"]


class Search:
    """Re-plans of one spec (cached by their lines) and the combinations built from the levers."""

    def __init__(self, spec_path, overrides, world: World, num_samples, accelerator: str, gpu_bytes: float):
        self.spec_path, self.overrides, self.world = spec_path, list(overrides), world
        self.num_samples, self.accelerator, self.gpu_bytes = num_samples, accelerator, gpu_bytes
        self._plans: dict = {}

    def plan(self, lines: Lines, world: Optional[World] = None) -> Optional[Planned]:
        """The spec with these --set lines, validated and planned; None where its rules refuse it."""
        world = world or self.world
        key = (tuple(lines.items()), world.world_size)
        if key not in self._plans:
            self._plans[key] = self._plan(lines, world)
        return self._plans[key]

    def _plan(self, lines: Lines, world: World) -> Optional[Planned]:
        try:
            resolved = load_and_validate(
                self.spec_path,
                self.overrides + [f"{key}={value}" for key, value in lines.items()],
                world=world,
                num_samples=self.num_samples,
                accelerator=self.accelerator,
                check_files=False,
            )
        except (SpecError, WorldError):  # ResolveError is a SpecError
            return None
        accelerator = "cpu" if self.accelerator == "cpu" else "cuda"
        memory = plan_memory(
            resolved.spec, resolved.plan, resolved.ds_config, self.gpu_bytes, accelerator, resolved.clips
        )
        return None if memory.get("per_gpu") is None else Planned(resolved, memory)

    def combine(self, combination: tuple) -> Optional[tuple[Lines, Planned]]:
        """(lever index, option index) pairs applied in order, each lever's options read from the spec as the
        earlier ones left it (a lever with nothing left to set is skipped); its lines and its plan."""
        lines: Lines = {}
        planned = self.plan({})
        for lever, option in combination:
            choices = LEVERS[lever].options(planned.resolved)
            if not choices:
                continue
            lines = {**lines, **choices[min(option, len(choices) - 1)]}
            planned = self.plan(lines)
            if planned is None:
                return None
        return lines, planned


def _fits(planned: Optional[Planned], gpu_bytes: float) -> bool:
    return planned is not None and planned.peak <= gpu_bytes


def _greedy(search: Search, excluded: frozenset) -> tuple[tuple, Optional[Planned]]:
    """Each lever in cost order, at the option that lowers the peak most, while the run does not fit."""
    chosen: tuple = ()
    current = search.plan({})
    for lever in range(len(LEVERS)):
        if lever in excluded or _fits(current, search.gpu_bytes):
            continue
        best = None
        for option in range(len(LEVERS[lever].options(current.resolved))):
            found = search.combine(chosen + ((lever, option),))
            if found and found[1].peak < (best or current).peak:
                best, best_option = found[1], option
        if best is not None:
            chosen, current = chosen + ((lever, best_option),), best
    return chosen, current


def _minimal(search: Search, chosen: tuple) -> tuple:
    """Without the levers the fit does not need (the costliest tried first), each at its mildest option that fits."""
    for item in sorted(chosen, key=lambda pair: -pair[0]):
        fewer = tuple(pair for pair in chosen if pair != item)
        found = search.combine(fewer)
        if found and _fits(found[1], search.gpu_bytes):
            chosen = fewer
    for position, (lever, option) in enumerate(chosen):
        for milder in range(option):
            trial = chosen[:position] + ((lever, milder),) + chosen[position + 1 :]
            found = search.combine(trial)
            if found and _fits(found[1], search.gpu_bytes):
                chosen = trial
                break
    return chosen


def _keys(resolved: Resolved, lever: int) -> set:
    return {key for lines in LEVERS[lever].options(resolved) for key in lines}


def _sharing(resolved: Resolved, lever: int) -> frozenset:
    """The lever and every lever that sets one of its keys (text encoder offload turns the text cache on): an
    alternative without the lever is without them too."""
    keys = _keys(resolved, lever)
    return frozenset(other for other in range(len(LEVERS)) if other == lever or keys & _keys(resolved, other))


def _cost(combination: tuple) -> tuple:
    """Cheapest first: by the costliest lever, then the next, ...; fewer levers before more."""
    return tuple(sorted((lever for lever, _ in combination), reverse=True))


def _suggestion(search: Search, combination: tuple, relieves: str) -> dict:
    lines, planned = search.combine(combination)
    memory = planned.memory
    return {
        "change": " ".join(f"{key}={value}" for key, value in lines.items()),
        "set": [f"{key}={value}" for key, value in lines.items()],
        "costs": [f"{LEVERS[lever].name}: {LEVERS[lever].cost}" for lever, _ in combination],
        "per_gpu_total_bytes": int(memory["peak_per_gpu_bytes"]),
        "relieves": relieves,
        "peak_phase": memory["peak_phase"],
    }


def _worlds_with_more_gpus(world: World) -> list[World]:
    per_node = max(world.ranks_per_node)
    return [
        World(
            world.world_size * factor,
            world.num_nodes * factor,
            tuple(world.ranks_per_node) * factor,
            tuple(f"node{i}" for i in range(world.num_nodes * factor)),
            f"{world.num_nodes * factor} nodes of {per_node} GPUs",
        )
        for factor in MORE_GPU_FACTORS
    ]


def more_gpus(search: Search, now: Planned) -> Optional[dict]:
    """The fewest more GPUs (whole nodes like these) at which the spec as it is fits: only where more GPUs lower
    the per-GPU peak that much (what ZeRO partitions shrinks with the ranks; activations, a replicated frozen base
    and the encoders do not)."""
    for world in _worlds_with_more_gpus(search.world):
        planned = search.plan({}, world)
        if _fits(planned, search.gpu_bytes) and planned.peak < now.peak:
            return {
                "num_gpus": world.world_size,
                "world": world.source,
                "per_gpu_total_bytes": int(planned.peak),
                "peak_phase": planned.memory["peak_phase"],
            }
    return None


def _why_nothing_fits(search: Search, strongest: Planned, used: tuple) -> str:
    """What still does not fit with every lever that lowered the peak, and its largest parts."""
    memory = strongest.memory
    phase = memory["phases"][memory["peak_phase"]]
    parts = sorted(phase["parts"].items(), key=lambda item: -item[1])[:3]
    names = ", ".join(LEVERS[lever].name for lever, _ in used) or "none lowers it"
    offloaded = getattr(strongest.resolved.spec.model, "text_encoder_offload", "none") == "cpu"
    on_gpu = {name: n for name, n in memory["parameters"]["companions"].items() if not (offloaded and text_part(name))}
    frozen = sorted(on_gpu.items(), key=lambda item: -item[1])[:2]
    named = ", ".join(f"{name} {count / 1e9:.3g} B parameters" for name, count in frozen)

    def part(label: str, value: float) -> str:  # the frozen parts named: the largest two
        return f"{label} {value / 1e9:.3g} GB" + (f" ({named})" if label.startswith("frozen parts") and named else "")

    largest = "; ".join(part(label, value) for label, value in parts)
    return (
        f"with every setting that lowers the peak ({names}) the {memory['peak_phase']} phase still needs "
        f"{memory['peak_per_gpu_bytes'] / 1e9:.3g} GB per GPU, over {search.gpu_bytes / 1e9:.3g} GB; its largest "
        f"parts: {largest}"
    )


def advise(
    spec_path,
    overrides,
    world: World,
    num_samples: Optional[int],
    accelerator: str,
    gpu_bytes: float,
) -> dict:
    """For a spec whose peak does not fit gpu_bytes per GPU: `suggestions` (the cheapest combinations that fit,
    at most MAX_SUGGESTIONS, each re-planned), `more_gpus` (None unless more GPUs make it fit), `nothing_fits` (why,
    where no combination fits)."""
    search = Search(spec_path, overrides, world, num_samples, accelerator, gpu_bytes)
    now = search.plan({})
    if now is None or _fits(now, gpu_bytes):
        return {"suggestions": [], "more_gpus": None, "nothing_fits": None}
    relieves = now.memory["peak_phase"]
    found: set = set()
    for lever in range(len(LEVERS)):  # single settings, mildest option that fits
        for option in range(len(LEVERS[lever].options(now.resolved))):
            single = search.combine(((lever, option),))
            if single and _fits(single[1], gpu_bytes):
                found.add(((lever, option),))
                break
    chosen, strongest = _greedy(search, frozenset())
    if _fits(strongest, gpu_bytes):
        first = _minimal(search, chosen)
        found.add(first)
        for lever, _ in first:  # the alternatives without each of its levers (and those that would set it again)
            other, planned = _greedy(search, _sharing(now.resolved, lever))
            if _fits(planned, gpu_bytes):
                found.add(_minimal(search, other))
    suggestions = [_suggestion(search, c, relieves) for c in sorted(found, key=_cost)[:MAX_SUGGESTIONS]]
    return {
        "suggestions": suggestions,
        "more_gpus": more_gpus(search, now),
        "nothing_fits": None if suggestions else _why_nothing_fits(search, strongest, chosen),
    }
