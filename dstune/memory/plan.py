"""How many bytes a run holds per GPU and per node, before it is launched: the arithmetic of the memory plan.

    Setup.of(spec, plan, ds_config)      what the run does (ZeRO stage, offload, precision, optimizer, batch)
    estimate(counts, setup) -> Estimate  per GPU: parameters, gradients, optimizer states, frozen weights,
                                         activations, DeepSpeed buffers, EMA; per phase (load, cache, step,
                                         sample: dstune.memory.phases) and their peak; per node: host RAM and NVMe
    (the verdict, with the cheapest changes that make the peak fit: dstune.memory.verdict)

Torch-free: the parameter counts come in as ModelCounts (dstune.memory.counts counts them on the meta device, or
training counts the live model). The model-state part follows DeepSpeed's own estimators
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`; tests/unit/test_memory_plan.py
checks that they agree), mixed precision: 16-bit parameters and gradients, an fp32 gradient partition for the
step, fp32 master weights and the optimizer's fp32 states. docs/memory.md derives every term.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from dstune.memory.frozen_base import dequantized_copy, frozen_base_bytes
from dstune.memory.reserve import CPU_STARTUP_RESERVE_BYTES, runtime_reserve
from dstune.memory.offload import offload_sample_change, offloaded_activations, text_encoder_terms
from dstune.memory.phases import IN_FLIGHT, STEP_TEXT, STEP_VAE, TRANSIENTS, Phase, peak_phase, run_phases
from dstune.memory.sizes import parse_size  # noqa: F401 (validate's --gpu-memory reads it from here)
from dstune.memory.working import MAX_CHUNK_ENTRIES, text_part, working_terms
from dstune.spec.models import BASE_PRECISION_BYTES  # bytes per frozen base parameter, one table

MIXED = ("bf16", "fp16")
# fp32 bytes of optimizer state per trainable parameter, beyond the master copy. Adafactor keeps a factored second
# moment (a row and a column vector per matrix: far below a byte per parameter, counted as 0.1) when it sees whole
# matrices (ZeRO 0); under ZeRO >= 1 it sees flat partitions and keeps a full one (4 bytes).
# prodigy: two moments, its running sum s and the starting point p0; adamw_schedulefree: z and the second moment;
# adamw8bit: two 8-bit moments and one fp32 absmax per 256-element block of each (bitsandbytes' block-wise
# quantization; tensors under 4096 elements keep fp32 moments, which the flat ZeRO partitions never are); muon:
# DeepSpeed's Muon keeps one fp32 momentum per matrix element, and its Adam half two moments for the rest (biases,
# norms, embeddings: well under 1 % of a real model, all of LoRA's adapters are matrices), counted at the Muon rate.
OPTIMIZER_STATE_BYTES = {
    "adamw": 8.0,
    "adam": 8.0,
    "lion": 4.0,
    "prodigy": 16.0,
    "adamw_schedulefree": 8.0,
    "adamw8bit": 2.0 + 2 * 4.0 / 256,
    "muon": 4.0,
}
BF16_STATE_BYTES = 2.0 + 2.0 + 2.0  # deepspeed.bf16_optimizer_states: bf16 master weights and two bf16 moments
ADAFACTOR_FACTORED_BYTES = 0.1
# DeepSpeed's ZeRO-3 defaults, where the JSON does not set them (deepspeed.runtime.zero.config)
ZERO3_PERSISTENCE_THRESHOLD, ZERO3_MAX_REUSE_DISTANCE, ZERO3_MAX_LIVE_PARAMETERS = 100_000, 1_000_000_000, 1_000_000_000
# DeepSpeed's ZeRO documentation: overlap_comm uses 4.5 x allgather_bucket_size and reduce_bucket_size (elements, in
# the module's precision); its source allocates two reduce buffers where one serves without overlap.
OVERLAP_COMM_FACTOR = 4.5


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of one model and its per-sample activation estimate (bytes at 2 bytes per element)."""

    trainable_module: str  # "unet", "transformer", "lm", ...
    module_params: int  # the module's own parameters (LoRA adapters, added at start-up, not included)
    trainable_params: int  # module_params for full training; the adapters' count for LoRA
    largest_layer_params: int  # the module's largest layer (ZeRO-3 gathers one at a time)
    companions: dict = field(default_factory=dict)  # frozen components outside DeepSpeed: name -> parameters
    cached_companions: tuple = ()  # those the encoder cache replaces on the GPU (kept in host memory)
    activation_sample_bytes: int = 0  # one sample's activations without checkpointing, 16-bit
    checkpointed_sample_bytes: int = 0  # the same with gradient checkpointing
    default_lora_params: int = 0  # adapters of rank 16 on the default targets (the "LoRA" suggestion)
    cache_bytes: int = 0  # the encoder cache on disk for the whole dataset
    origin: str = ""
    builds_partitioned: bool = False  # under ZeRO-3 each rank reads only its share of the module (deepspeed.zero.Init)
    # frozen parts loaded only while samples render, whole on every rank (a two-expert model's untrained expert): name -> params
    sampling_companions: dict = field(default_factory=dict)
    expert: Optional[dict] = None  # two-expert models: which expert trains over which timesteps (validate prints it)
    # the module's parameter tensors up to SMALL_TENSOR_NUMEL elements (LoRA adapters included), as (numel, count)
    # pairs: ZeRO-3 keeps those under its persistence threshold whole on every rank; () where not counted
    small_tensors: tuple = ()
    # companions one rank per node loads (the text encoders, for the text cache) and drops once the cache is built
    # (dstune.families.denoiser_facts.text_once_per_node): counted once in a node's host RAM, on the GPU of that rank
    # in the load and cache phases, nowhere in the step and sample phases
    once_per_node: tuple = ()
    # where the text encoders load on every rank though the family could load them once per node: why (the reason
    # text_once_per_node gives: a spec setting)
    text_on_every_rank: str = ""
    # working memory beyond the weights and activations (dstune.memory.working), bytes in the run's precision: one
    # cache entry's VAE encode (the largest bucket; tiled: through the VAE's tiles, 0 where it has none), one caption
    # through the largest text encoder, one sample's VAE decode, one sampling forward of one sample, the samples a
    # pipeline call renders, and per training sample the backward's transients beyond the saved activations
    encode_entry_bytes: int = 0
    encode_entry_tiled_bytes: int = 0
    text_entry_bytes: int = 0
    text_pass_bytes: int = 0  # what the text encoders' pass holds once, whatever its captions (T5's position bias)
    decode_sample_bytes: int = 0
    decode_sample_tiled_bytes: int = 0
    sample_forward_bytes: int = 0
    samples_per_call: int = 1
    transient_sample_bytes: int = 0
    # of checkpointed_sample_bytes, the blocks' inputs (model.activation_offload's), the largest block's; 0: not counted
    offloaded_sample_bytes: int = 0
    offload_block_bytes: int = 0
    # the largest module's own parameters over the text encoders: what model.text_encoder_offload holds on the device
    text_offload_layer_params: int = 0
    linear_weights: tuple = (0, 0)  # (weights, output rows) of its nn.Linear layers (an int8 base's); 0: not counted

    @property
    def companions_on_every_rank(self) -> dict:
        """The companions every rank loads: all but once_per_node's."""
        return {name: n for name, n in self.companions.items() if name not in self.once_per_node}

    @property
    def frozen_base_params(self) -> int:
        """Under LoRA every parameter of the module stays, frozen, beside the adapters (counted apart)."""
        return self.module_params if self.trainable_params < self.module_params else 0


@dataclass(frozen=True)
class Setup:
    """What the run does, read from the compiled DeepSpeed JSON (so a user's deepspeed.config counts too)."""

    world_size: int
    ranks_per_node: int
    zero_stage: int
    offload_optimizer: str  # none | cpu | nvme
    offload_param: str
    precision: str  # fp32 | bf16 | fp16
    optimizer: str
    momentum: float
    micro_batch: int
    accumulation: int
    gradient_checkpointing: bool
    lora: bool
    reduce_bucket: int
    allgather_bucket: int
    prefetch_bucket: int
    overlap_comm: bool
    base_bytes_per_param: Optional[float] = None  # frozen base of a LoRA module; None: the compute precision's
    dequantized_layer_params: int = 0  # model.transformer_file: its largest layer, dequantized for its product
    accelerator: str = "cuda"
    samples: bool = False  # sample.prompts renders during training
    ema_device: Optional[str] = None  # train.ema.device (same | cpu); None: no EMA
    ema_in_samples: bool = False  # samples show the EMA (train.ema.export: ema): swapped into the model
    sequence_parallel: int = 1  # deepspeed.sequence_parallel_size: each rank holds 1/N of a sample's tokens
    all_to_all_bytes: float = 0.0  # the attention all-to-alls' buffers under sequence parallelism (validate's)
    persistence_threshold: int = ZERO3_PERSISTENCE_THRESHOLD  # ZeRO-3: tensors this small stay whole on every rank
    max_reuse_distance: int = ZERO3_MAX_REUSE_DISTANCE  # ZeRO-3: a gathered parameter reused within this stays
    max_live_parameters: int = ZERO3_MAX_LIVE_PARAMETERS  # ZeRO-3: the cap on gathered parameters
    bf16_states: bool = False  # deepspeed.bf16_optimizer_states: bf16 master weights, gradients and moments
    cache_chunk: int = MAX_CHUNK_ENTRIES  # entries per encoder pass of the cache (verdict.choose_encoding)
    vae_tiling: bool = False  # model.vae_tiling: the VAE encodes and decodes through its own tiles
    activation_offload: bool = False  # model.activation_offload cpu (with gradient checkpointing)
    text_encoder_offload: bool = False  # model.text_encoder_offload cpu (the text encoders build the cache only)
    compiled_blocks: bool = False  # train.compile blocks
    int8_partitioned: bool = False  # model.base_precision int8 under ZeRO-3: dstune's Int8Linear, partitioned

    @classmethod
    def of(
        cls, spec, plan, ds_config: dict, base_precision: Optional[str] = None, accelerator: str = "cuda"
    ) -> "Setup":
        zero = ds_config.get("zero_optimization", {})
        ema = spec.train.ema
        precision = (
            "bf16"
            if ds_config.get("bf16", {}).get("enabled")
            else "fp16"
            if ds_config.get("fp16", {}).get("enabled")
            else "fp32"
        )
        return cls(
            world_size=plan.world_size,
            ranks_per_node=max(plan.ranks_per_node),
            zero_stage=int(zero.get("stage", 0)),
            offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none"),
            offload_param=zero.get("offload_param", {}).get("device", "none"),
            precision=precision,
            optimizer=spec.train.optimizer.type,
            momentum=spec.train.optimizer.momentum,
            bf16_states=bool(ds_config.get("bf16", {}).get("bf16_optimizer_states")),
            micro_batch=plan.micro_batch_size,
            accumulation=plan.gradient_accumulation_steps,
            gradient_checkpointing=bool(getattr(spec.model, "gradient_checkpointing", False)),
            lora=getattr(spec.model, "train", "full") == "lora",
            vae_tiling=bool(getattr(spec.model, "vae_tiling", False)),
            activation_offload=getattr(spec.model, "activation_offload", "none") == "cpu",
            text_encoder_offload=getattr(spec.model, "text_encoder_offload", "none") == "cpu",
            compiled_blocks=spec.train.compile == "blocks",
            int8_partitioned=base_precision == "int8" and int(zero.get("stage", 0)) == 3,
            reduce_bucket=int(zero.get("reduce_bucket_size", 5e8)),
            allgather_bucket=int(zero.get("allgather_bucket_size", 5e8)),
            prefetch_bucket=int(zero.get("stage3_prefetch_bucket_size", 5e7)),
            overlap_comm=bool(zero.get("overlap_comm", False)),
            base_bytes_per_param=BASE_PRECISION_BYTES.get(base_precision) if base_precision else None,
            accelerator=accelerator,
            samples=bool(getattr(getattr(spec, "sample", None), "prompts", None)),
            ema_device=ema.device if ema is not None else None,
            ema_in_samples=ema is not None and ema.export == "ema",
            sequence_parallel=getattr(plan, "sequence_parallel_size", 1),
            persistence_threshold=int(zero.get("stage3_param_persistence_threshold", ZERO3_PERSISTENCE_THRESHOLD)),
            max_reuse_distance=int(zero.get("stage3_max_reuse_distance", ZERO3_MAX_REUSE_DISTANCE)),
            max_live_parameters=int(zero.get("stage3_max_live_parameters", ZERO3_MAX_LIVE_PARAMETERS)),
        )

    @property
    def weight_bytes(self) -> float:
        """Bytes of one parameter or gradient element as the module holds it."""
        return 2.0 if self.precision in MIXED else 4.0

    @property
    def master_grad_bytes(self) -> float:
        """Bytes of one element of the gradient partition the optimizer reads: fp32, bf16 with bf16 states."""
        return 2.0 if self.bf16_states else 4.0

    @property
    def frozen_bytes(self) -> float:
        """Bytes of one frozen companion parameter: bf16 under bf16, else fp32 (fp16 keeps them fp32: its loss
        scaling covers only the trainable module; dstune.engine.PRECISION_DTYPES)."""
        return 2.0 if self.precision == "bf16" else 4.0


@dataclass(frozen=True)
class Estimate:
    parameters: float
    gradients: float
    optimizer: float
    frozen: float
    activations: float
    buffers: float
    reserve: float
    host_per_rank: float
    ranks_per_node: int
    nvme_per_node: float
    cache_bytes: int
    sampling_extra: float = 0.0  # frozen parts on each GPU only while samples render (the other expert)
    ema: float = 0.0  # the EMA's fp32 share on each GPU (train.ema.device: same)
    phases: dict = field(default_factory=dict)  # name -> dstune.memory.phases.Phase
    step_temporaries: float = 0.0  # the optimizer step's temporaries beyond the activations (freed before it)
    host_once_per_node: float = 0.0  # what one rank per node adds to the node's host RAM (once_per_node_bytes)
    offloaded_activations: float = 0.0  # model.activation_offload: block inputs in a rank's host memory (GPU runs)

    @property
    def host_per_node(self) -> float:
        return self.host_per_rank * self.ranks_per_node + self.host_once_per_node

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        """The training step's bytes per GPU (its phase: the activations, the backward's transients and the
        weight gradients in flight, or the uncached encoders' passes before them, whichever is larger)."""
        return self.phases["step"].per_gpu

    @property
    def peak_phase(self) -> Phase:
        return peak_phase(self.phases)

    @property
    def peak(self) -> float:
        """The largest phase (load, cache, step, sample): what must fit."""
        return max(self.total, self.peak_phase.per_gpu)

    def per_gpu(self) -> dict:
        step = self.phases["step"].parts
        return {
            "total_bytes": int(self.total),
            "parameters_bytes": int(self.parameters),
            "gradients_bytes": int(self.gradients),
            "optimizer_bytes": int(self.optimizer),
            "frozen_bytes": int(self.frozen),
            "activations_bytes": int(self.activations),
            "backward_transients_bytes": int(step.get(TRANSIENTS, 0)),
            "gradients_in_flight_bytes": int(step.get(IN_FLIGHT, 0)),
            "encoders_working_bytes": int(max(step.get(STEP_VAE, 0), step.get(STEP_TEXT, 0))),
            "step_temporaries_bytes": int(self.step_temporaries),
            "buffers_bytes": int(self.buffers),
            "ema_bytes": int(self.ema),
            "runtime_reserve_bytes": int(self.reserve),
            **({"offloaded_activations_bytes": int(self.offloaded_activations)} if self.offloaded_activations else {}),
        }


def optimizer_state_bytes(setup: Setup) -> float:
    """State bytes per trainable parameter, master weights included under mixed precision."""
    return state_bytes_per_param(setup.optimizer, setup.precision, setup.zero_stage, setup.momentum, setup.bf16_states)


def state_bytes_per_param(
    optimizer: str, precision: str, zero_stage: int, momentum: float = 0.0, bf16_states: bool = False
) -> float:
    """optimizer_state_bytes from the settings themselves (validate's plan text prints it)."""
    if bf16_states:
        return BF16_STATE_BYTES
    master = 4.0 if precision in MIXED else 0.0
    if optimizer == "sgd":
        return master + (4.0 if momentum > 0 else 0.0)
    if optimizer == "adafactor":
        return master + (ADAFACTOR_FACTORED_BYTES if zero_stage == 0 else 4.0)
    return master + OPTIMIZER_STATE_BYTES[optimizer]


def model_states(counts: ModelCounts, setup: Setup) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) per GPU for the trainable parameters."""
    trainable, ranks, w = counts.trainable_params, setup.world_size, setup.weight_bytes
    layer = min(counts.largest_layer_params, trainable)
    fp32_grad_partition = 4.0 * trainable / ranks if setup.precision in MIXED else 0.0
    states = optimizer_state_bytes(setup) * trainable
    offloaded_optimizer = setup.zero_stage >= 1 and setup.offload_optimizer != "none"
    if setup.zero_stage == 0:  # mixed precision: DeepSpeed's bf16/fp16 optimizer keeps an fp32 gradient copy
        return w * trainable, w * trainable + (4.0 * trainable if setup.precision in MIXED else 0.0), states
    if setup.zero_stage in (1, 2):
        grads = (w * trainable if setup.zero_stage == 1 else w * trainable / ranks) + fp32_grad_partition
        return w * trainable, 0.0 if offloaded_optimizer else grads, 0.0 if offloaded_optimizer else states / ranks
    params = (0.0 if setup.offload_param != "none" else w * trainable / ranks) + w * layer
    # ZeRO-3 reduce-scatters each layer's 16-bit gradient straight into the fp32 partition (DeepSpeed's estimator
    # counts no 16-bit gradient partition there); without mixed precision that partition is the gradient itself
    grads = w * layer + (0.0 if offloaded_optimizer else fp32_grad_partition or w * trainable / ranks)
    return params, grads, 0.0 if offloaded_optimizer else states / ranks


def frozen_on_gpu(counts: ModelCounts, setup: Setup) -> float:
    """The frozen base of a LoRA module (partitioned under ZeRO-3, host-side with parameter offload) and the frozen
    companions the cache does not replace, in the compute precision (an int8 base: with one layer dequantized)."""
    base = frozen_base_bytes(counts, setup)
    if setup.zero_stage == 3:
        base = 0.0 if setup.offload_param != "none" else base / setup.world_size
    on_gpu = sum(n for name, n in counts.companions.items() if name not in counts.cached_companions)
    return base + dequantized_copy(counts, setup) + setup.frozen_bytes * on_gpu


def activations(counts: ModelCounts, setup: Setup) -> float:
    """The micro batch's activations on one rank: under sequence parallelism 1/N of each sample's (every
    activation between the all-to-alls is split by token; the few whole-sequence tensors are the buffers')."""
    per_sample = counts.checkpointed_sample_bytes if setup.gradient_checkpointing else counts.activation_sample_bytes
    per_sample += offload_sample_change(counts, setup)  # model.activation_offload
    return setup.micro_batch * per_sample * setup.weight_bytes / 2.0 / setup.sequence_parallel


def reduce_bucket_elements(counts: ModelCounts, setup: Setup) -> int:
    """The gradient reduce bucket in elements: the DeepSpeed JSON's, except under ZeRO-3 with sequence parallelism,
    where dstune's engine raises it to the largest trainable parameter (dstune.engine.sequence_parallel_bucket: a
    parameter past the bucket would take DeepSpeed's reduce-scatter path, which averages over every rank). Full
    training counts the largest layer (its weight, and its bias beside it: a few elements over). LoRA's adapter
    matrices (rank x one side of a layer) are counted at the JSON's bucket: they pass it only when it is set below
    rank x the widest layer side."""
    if setup.zero_stage == 3 and setup.sequence_parallel > 1 and not setup.lora:
        return max(setup.reduce_bucket, counts.largest_layer_params)
    return setup.reduce_bucket


def deepspeed_buffers(counts: ModelCounts, setup: Setup) -> float:
    """The gradient reduce bucket (two with overlap_comm under ZeRO-3), the ZeRO 1/2 all-gather bucket (with
    overlap_comm DeepSpeed's documented 4.5 x both), ZeRO-3's gathered parameters (zero3_gathered_bytes), in the
    module's precision. On a GPU a reduce buffer is allocated at its full size; in host memory only the part
    gradients fill is resident (at most the trainable parameters)."""
    trainable, w, reduce_bucket = counts.trainable_params, setup.weight_bytes, reduce_bucket_elements(counts, setup)
    bucket = reduce_bucket if setup.accelerator == "cuda" else min(reduce_bucket, trainable)
    if setup.zero_stage in (1, 2):
        allgather = min(setup.allgather_bucket, trainable)
        return (OVERLAP_COMM_FACTOR if setup.overlap_comm else 1.0) * (bucket + allgather) * w
    reduce = bucket * w * (2 if setup.overlap_comm else 1)
    if setup.zero_stage == 3:  # reduce_scatter_coalesced concatenates the bucket's gradients, interleaved per rank,
        # into a new flat tensor before the reduce-scatter (deepspeed/runtime/comm/coalesced_collectives.py): a copy
        # of the bucket's contents, at most the trainable parameters
        return reduce + min(reduce_bucket, trainable) * w + zero3_gathered_bytes(counts, setup)
    return reduce


def zero3_reduce_bucket(counts: ModelCounts, setup: Setup) -> float:
    """ZeRO-3's gradient bucket (two with overlap_comm), allocated at start-up and kept for the run; in host memory
    only the part gradients fill is resident."""
    elements = reduce_bucket_elements(counts, setup)
    bucket = elements if setup.accelerator == "cuda" else min(elements, counts.trainable_params)
    return bucket * setup.weight_bytes * (2 if setup.overlap_comm else 1)


SMALL_TENSOR_NUMEL = 1 << 20  # ModelCounts.small_tensors holds tensors up to this many elements


def persistent_params(counts: ModelCounts, setup: Setup) -> int:
    """ZeRO-3's persistent parameters: every tensor of at most stage3_param_persistence_threshold elements (DeepSpeed
    0.19.8, parameter_offload.mark_persistent_parameters), up to stage3_max_live_parameters in all; counted from the
    configs' tensor shapes (ModelCounts.small_tensors; thresholds above SMALL_TENSOR_NUMEL count to that)."""
    return min(
        sum(numel * count for numel, count in counts.small_tensors if numel <= setup.persistence_threshold),
        setup.max_live_parameters,
    )


def zero3_gathered_bytes(counts: ModelCounts, setup: Setup, forward_only: bool = False) -> float:
    """What ZeRO-3 holds gathered beyond the partitions and the largest layer (DeepSpeed 0.19.8): the persistent
    tensors, whole on every rank for the whole run (GPU: not offloaded with the parameters either), and the
    parameters kept for reuse. Once the first step has traced the module, a gathered parameter is released only when
    its next use lies more than stage3_max_reuse_distance elements ahead (partitioned_param_coordinator
    .__params_to_release); between a tensor's forward use and its backward use lie twice the parameters after it,
    so at the turn from forward to backward the last max_reuse_distance / 2 elements of the module stay gathered (a
    smaller module: all of it), at most stage3_max_live_parameters. The prefetch bucket fetches within that set.
    The largest layer (2L in DeepSpeed's estimator, in `parameters`) is part of it, so it is not counted twice.
    `forward_only` (samples: one denoising forward pass after another): a parameter's next use lies the whole
    module ahead, so all of a module within max_reuse_distance stays gathered, of a larger one nothing beyond the
    prefetch bucket."""
    persistent = persistent_params(counts, setup)
    module = counts.module_params + (counts.trainable_params if counts.frozen_base_params else 0)  # + adapters
    gathered = module - persistent
    if forward_only:
        kept = gathered if gathered < setup.max_reuse_distance else 0
    else:
        kept = min(gathered, setup.max_reuse_distance / 2)
    kept = max(min(kept, setup.max_live_parameters - persistent), min(setup.prefetch_bucket, module))
    return setup.weight_bytes * (persistent + max(kept - counts.largest_layer_params, 0.0))


def optimizer_step_temporaries(counts: ModelCounts, setup: Setup) -> float:
    """Working memory of the optimizer step beyond its states (torch 2.13's Adam and AdamW, dstune's adam and
    adamw): on a GPU the foreach implementation takes the square root of every second moment at once
    (torch._foreach_sqrt: 4 bytes per element it steps); on the CPU the single-tensor one makes two temporaries of
    the tensor it steps (the square root, then its quotient). DeepSpeed's ZeRO 1-3 and its bf16/fp16 optimizer step
    flat fp32 partitions (P/N; P under ZeRO-0 with mixed precision); ZeRO-0 in fp32 steps the module's own tensors
    (the largest at most a layer). The other optimizers update in place: 0; so does DeepSpeed's CPU Adam under
    optimizer offload."""
    if setup.zero_stage >= 1 and setup.offload_optimizer != "none":
        return 0.0
    if setup.optimizer in ("prodigy", "adamw_schedulefree"):  # one temporary: the denominator sqrt(v) + eps
        return 4.0 * (counts.trainable_params / setup.world_size if setup.zero_stage >= 1 else counts.trainable_params)
    if setup.optimizer not in ("adam", "adamw"):
        return 0.0
    trainable = counts.trainable_params
    flat = trainable / setup.world_size if setup.zero_stage >= 1 else trainable
    if setup.accelerator == "cuda":
        return 4.0 * flat
    own_tensors = setup.zero_stage == 0 and setup.precision not in MIXED
    return 8.0 * (min(counts.largest_layer_params, trainable) if own_tensors else flat)


def offloaded_to_host(counts: ModelCounts, setup: Setup) -> float:
    """What CPU offload puts in a rank's host memory: the optimizer states with the fp32 gradient partition and
    offload's pinned staging bucket (ZeRO >= 1), the parameter partitions (ZeRO-3)."""
    trainable, ranks = counts.trainable_params, setup.world_size
    held = 0.0
    if setup.zero_stage >= 1 and setup.offload_optimizer == "cpu":
        held += (setup.master_grad_bytes + optimizer_state_bytes(setup)) * trainable / ranks + min(
            reduce_bucket_elements(counts, setup), trainable
        ) * 4.0  # offload's pinned staging bucket
    if setup.zero_stage == 3 and setup.offload_param == "cpu":
        held += setup.weight_bytes * trainable / ranks + frozen_base_bytes(counts, setup) / ranks
    return held


def host_and_nvme(counts: ModelCounts, setup: Setup) -> tuple[float, float]:
    """(host bytes per rank, NVMe bytes per node). A rank's host peak is the larger of loading (the module read in
    fp32 before it is cast and moved, the frozen parts in the run's precision) and training (offloaded states and
    parameters, cache-replaced encoders, offload's pinned buffers). The parts one rank per node loads
    (counts.once_per_node) are not in it: once_per_node_bytes adds them to the node."""
    trainable, ranks, w, frozen = counts.trainable_params, setup.world_size, setup.weight_bytes, setup.frozen_bytes
    every_rank = counts.companions_on_every_rank
    loading = module_loading_bytes(counts, setup) + frozen * sum(every_rank.values())
    offloaded_states = (
        (setup.master_grad_bytes + optimizer_state_bytes(setup)) * trainable / ranks
    )  # fp32 gradients + states
    offloaded_params = w * trainable / ranks + frozen_base_bytes(counts, setup) / ranks
    training = frozen * sum(every_rank.get(name, 0) for name in counts.cached_companions)
    if setup.ema_device == "cpu":  # the rank's fp32 EMA share; sampling with it keeps the raw weights aside
        training += 4.0 * trainable / ranks + (ema_swap_bytes(counts, setup) if setup.samples else 0.0)
    training += offloaded_to_host(counts, setup) + offloaded_activations(counts, setup)
    nvme = 0.0
    if setup.offload_optimizer == "nvme":
        nvme += offloaded_states
    if setup.offload_param == "nvme":
        nvme += offloaded_params
    if setup.samples:  # read onto the host, then moved to the GPU, while samples render
        training += frozen * sum(counts.sampling_companions.values())
    return max(loading, training), nvme * setup.ranks_per_node


def once_per_node_bytes(counts: ModelCounts, setup: Setup) -> float:
    """The host bytes of the parts one rank per node loads (the text encoders for the text cache), counted once in
    the node's figure: the whole of them, in the frozen parts' precision, while that rank builds the cache."""
    return setup.frozen_bytes * sum(counts.companions.get(name, 0) for name in counts.once_per_node)


def module_loading_bytes(counts: ModelCounts, setup: Setup) -> float:
    """Host bytes a rank holds while it loads the module DeepSpeed wraps (read in fp32): all of it, or under a
    ZeRO-3 partitioned build its share plus the largest tensor in flight (a quantized base is loaded whole)."""
    if counts.builds_partitioned and setup.zero_stage == 3 and setup.base_bytes_per_param is None:
        return 4.0 * (counts.module_params / setup.world_size + counts.largest_layer_params)
    return 4.0 * counts.module_params


def ema_swap_bytes(counts: ModelCounts, setup: Setup) -> float:
    """While samples show the EMA (dstune.ema.Ema.weights_in_model): under ZeRO 0-2 the raw weights kept aside, a
    full copy (on the EMA's device), under ZeRO-3 this rank's partition of them (on the GPU)."""
    if setup.ema_device is None or not setup.ema_in_samples:
        return 0.0
    trainable = counts.trainable_params
    return setup.weight_bytes * (trainable / setup.world_size if setup.zero_stage == 3 else trainable)


def module_on_load(counts: ModelCounts, setup: Setup) -> float:
    """The trainable module on the GPU as the start-up places it, before DeepSpeed: in its training dtype, a
    quantized base quantized (dstune.engine.place_trainable); a ZeRO-3 partitioned build holds its share and one
    gathered layer; with parameter offload zero.Init keeps the shares in host memory. On the CPU accelerator the
    device is the host, where the module is read in fp32 first (module_loading_bytes)."""
    w = setup.weight_bytes
    partitioned = counts.builds_partitioned and setup.zero_stage == 3 and setup.base_bytes_per_param is None
    if setup.accelerator != "cuda":  # the host is the device: the module read in fp32; a partitioned build holds
        # its share, and rank 0 maps the whole weight file while it fills every parameter in turn (memory-mapped
        # safetensors, dstune.families.diffusion.load_partitioned): resident file pages until the file is closed
        return module_loading_bytes(counts, setup) + (4.0 * counts.module_params if partitioned else 0.0)
    # a quantized base (int8, a quantized file's layers) is partitioned from the host (zero.Init) as stored
    quantized = setup.zero_stage == 3 and (setup.int8_partitioned or bool(setup.dequantized_layer_params))
    if partitioned or quantized:
        stored = (
            frozen_base_bytes(counts, setup) + w * counts.trainable_params if quantized else w * counts.module_params
        )
        share = 0.0 if setup.offload_param != "none" else stored / setup.world_size
        return share + w * counts.largest_layer_params
    return w * counts.trainable_params + frozen_base_bytes(counts, setup)


def estimate(counts: ModelCounts, setup: Setup) -> Estimate:
    host, nvme = host_and_nvme(counts, setup)
    parameters, gradients, optimizer = model_states(counts, setup)
    on_gpu = setup.accelerator == "cuda"
    if not on_gpu:  # the host is the device: what offload moves to the host stays in the rank's memory
        optimizer += offloaded_to_host(counts, setup)
    reserve = runtime_reserve(counts, setup)
    sampling = setup.frozen_bytes * sum(counts.sampling_companions.values()) if setup.samples else 0.0
    ema = 4.0 * counts.trainable_params / setup.world_size if setup.ema_device == "same" else 0.0
    frozen, acts = frozen_on_gpu(counts, setup), activations(counts, setup)
    # the activations are freed by the backward pass, before the optimizer step's temporaries exist
    temporaries = max(optimizer_step_temporaries(counts, setup) - acts, 0.0)
    dequantized = setup.weight_bytes * setup.dequantized_layer_params  # a quantized file's one layer in use
    buffers = deepspeed_buffers(counts, setup) + setup.all_to_all_bytes + dequantized
    swap = ema_swap_bytes(counts, setup)
    base_on_gpu = frozen_on_gpu(replace(counts, companions={}), setup)
    companions_all, text_layer = text_encoder_terms(counts, setup, text_part)
    terms = {
        "parameters": parameters,
        "gradients": gradients,
        "optimizer": optimizer,
        "frozen": frozen,
        "frozen_base": base_on_gpu,
        "companions_all": companions_all,
        "text_offload_layer": text_layer,
        # samples render from cached prompt embeddings where the text encoders were loaded once per node and dropped
        "companions_in_samples": setup.frozen_bytes * sum(counts.companions_on_every_rank.values()),
        "module_on_load": module_on_load(counts, setup),
        "activations": acts,
        "buffers": buffers,
        "step_temporaries": temporaries,
        # samples under ZeRO-3: the forward passes' gathered parameters, and the reduce bucket, which stage 3
        # allocates once at start-up (stage3.py: ipg bucket buffers) and keeps
        "zero3_gathered": zero3_gathered_bytes(counts, setup, forward_only=True) + zero3_reduce_bucket(counts, setup)
        if setup.zero_stage == 3
        else 0.0,
        "ema": ema,
        "ema_swap": swap if setup.ema_device == "same" or setup.zero_stage == 3 else 0.0,
        "sampling_extra": sampling,
        "reserve": reserve,
        # a GPU holds its CUDA context from the start; the CPU's reserve is what the first step and samples add
        "start_reserve": reserve if on_gpu else CPU_STARTUP_RESERVE_BYTES,
        **working_terms(counts, setup),
    }
    return Estimate(
        parameters,
        gradients,
        optimizer,
        frozen,
        acts,
        buffers,
        reserve,
        host,
        setup.ranks_per_node,
        nvme,
        counts.cache_bytes,
        sampling,
        ema,
        run_phases(counts, setup, terms),
        temporaries,
        once_per_node_bytes(counts, setup),
        offloaded_activations(counts, setup),
    )
