"""The memory plan per phase of a run: what one GPU holds while the model loads, while the encoder cache is built,
at a training step and while samples render. The run's peak is the largest of them, and that is what must fit.

    load    the trainable module on the GPU in its training dtype (a quantized base already quantized; under ZeRO-3
            a partitioned build holds its share and one gathered layer) beside every frozen part (text encoders
            loaded once per node: on that rank's GPU, the one this phase counts)
    cache   the same, while latents and text embeddings are encoded (only when data.cache replaces some encoders;
            dstune.training builds the caches before deepspeed.initialize, and the encoders they replace leave the
            GPU before DeepSpeed's states arrive)
    step    the training step: model states, the frozen parts the cache does not replace, activations, DeepSpeed's
            buffers, the EMA (deepspeed.initialize, the EMA and a resume hold less: the step without activations)
    sample  DeepSpeed's states beside every frozen part again (the cache-replaced encoders come back, except text
            encoders loaded once per node, which are dropped after the cache: samples read cached prompts), the parts
            that load only for sampling (a two-expert model's other expert) and, under ZeRO 0-2 with the EMA shown, the raw
            weights kept aside while the EMA sits in the model

Each phase also counts what runs in it beyond the weights (dstune.memory.working): the cache build the VAE's
encode of one chunk of entries, or the text encoders' pass over one chunk of captions (one after the other); the
step the backward's transients (a causal LM's fp32 logits gradient, attention masks a block rebuilds), the weight
gradient in flight under ZeRO 0-2 and, before the forward pass, the encoders the cache does not replace; the
samples the VAE decode or one sampling forward. Held-out evaluation (data.eval) runs the step's forward pass
without gradients, so it stays below the step. Torch-free; the byte terms come from dstune.memory.plan.
"""

from __future__ import annotations

from dataclasses import dataclass

PHASES = ("load", "cache", "step", "sample")
HOST_WARNING_BYTES = 512e9  # per node: past this, the plan says which changes lower host memory


@dataclass(frozen=True)
class Phase:
    name: str
    parts: dict  # what the GPU holds in this phase: label -> bytes per GPU
    # groups of parts that run one after another (the largest group counts): what each group makes is freed before
    # the next begins (the text encoders' pass after the VAE's; the encoders before the forward pass)
    one_at_a_time: tuple = ()

    @property
    def per_gpu(self) -> float:
        grouped = {label for group in self.one_at_a_time for label in group}
        held = sum(value for label, value in self.parts.items() if label not in grouped)
        largest = max((sum(self.parts.get(label, 0.0) for label in group) for group in self.one_at_a_time), default=0)
        return float(held + largest)


VAE_CHUNK, TEXT_CHUNK = "VAE encode of one chunk", "text encoders on one chunk"
ACTIVATIONS, TRANSIENTS, IN_FLIGHT = "activations", "backward transients", "weight gradients in flight"
STEP_VAE, STEP_TEXT = "VAE encode of the micro batch (latents not cached)", "text encoders on the micro batch"
DECODE, SAMPLING_FORWARD = "VAE decode of the samples", "one sampling forward"
STEP_HEAP = "the step's freed pages, still resident (CPU accelerator)"
TEXT_LAYER = "text encoders' largest layer, copied for its forward (weights in host memory: text_encoder_offload)"


def run_phases(counts, setup, terms: dict) -> dict[str, Phase]:
    """The phases this run goes through (cache only with an encoder cache, sample only with sample.prompts), from
    `terms`: the plan's per-GPU byte terms (see dstune.memory.plan.estimate; the working memory's from
    dstune.memory.working.working_terms)."""
    states = terms["parameters"] + terms["gradients"] + terms["optimizer"]
    every_frozen = terms["companions_all"]
    loaded = {
        "trainable module (training dtype, or its ZeRO-3 share)": terms["module_on_load"],
        "frozen parts (every encoder)": every_frozen,
        "runtime reserve": terms["start_reserve"],
    }
    phases = {"load": Phase("load", loaded)}
    if counts.cached_companions:  # built before the engine, so beside the placed module, not DeepSpeed's states
        encoding = {**loaded, VAE_CHUNK: terms["cache_vae"], TEXT_CHUNK: terms["cache_text"]}
        text_pass: tuple = (TEXT_CHUNK,)
        if terms["text_offload_layer"]:  # model.text_encoder_offload: a layer's copy while the text encoders run
            encoding[TEXT_LAYER] = terms["text_offload_layer"]
            text_pass = (TEXT_CHUNK, TEXT_LAYER)
        phases["cache"] = Phase("cache", encoding, ((VAE_CHUNK,), text_pass))
    phases["step"] = Phase(
        "step",
        {
            "model states": states,
            "EMA": terms["ema"],
            "frozen weights": terms["frozen"],
            ACTIVATIONS: terms["activations"],
            TRANSIENTS: terms["transients"],
            IN_FLIGHT: terms["in_flight"],
            STEP_VAE: terms["step_vae"],
            STEP_TEXT: terms["step_text"],
            "optimizer step temporaries (beyond the activations)": terms["step_temporaries"],
            "DeepSpeed buffers": terms["buffers"],
            "runtime reserve": terms["reserve"],
        },
        ((ACTIVATIONS, TRANSIENTS, IN_FLIGHT), (STEP_VAE,), (STEP_TEXT,)),
    )
    if setup.samples:
        phases["sample"] = Phase(
            "sample",
            {
                "model states": states,
                "EMA": terms["ema"],
                "EMA swap (raw weights kept aside)": terms["ema_swap"],
                "frozen base": terms["frozen_base"],
                "frozen parts (encoders back)": terms["companions_in_samples"],
                "sampling-only parts": terms["sampling_extra"],
                "ZeRO-3 gathered parameters and reduce bucket": terms["zero3_gathered"],
                DECODE: terms["sample_decode"],
                SAMPLING_FORWARD: terms["sample_forward"],
                "runtime reserve": terms["reserve"],
            },
            ((DECODE,), (SAMPLING_FORWARD,)),
        )
        if setup.accelerator != "cuda":  # the host is the device: what the step freed stays resident, glibc's heap
            held = phases["sample"].per_gpu  # keeps its pages (the samples' RSS starts where the step's ended)
            step_heap = max(phases["step"].per_gpu - held, 0.0)
            parts = {**phases["sample"].parts, STEP_HEAP: step_heap}
            phases["sample"] = Phase("sample", parts, phases["sample"].one_at_a_time)
    return phases


def peak_phase(phases: dict[str, Phase]) -> Phase:
    """The phase that holds the most; the step wins a tie (it is the one users look at first)."""
    return max(phases.values(), key=lambda phase: (phase.per_gpu, phase.name == "step"))


def host_warning(host_per_node: float, counts, setup) -> str | None:
    """A sentence when a node's host RAM figure passes HOST_WARNING_BYTES, naming the changes that lower it."""
    if host_per_node <= HOST_WARNING_BYTES:
        return None
    changes = []
    if counts.builds_partitioned and setup.zero_stage < 3 and setup.base_bytes_per_param is None:
        changes.append("deepspeed.zero_stage=3 (each rank then reads only its share of the module at load)")
    if setup.offload_optimizer == "cpu":
        changes.append("deepspeed.offload_optimizer=nvme (or none, with more GPUs)")
    if setup.offload_param == "cpu":
        changes.append("deepspeed.offload_param=nvme (or none)")
    if setup.ema_device == "cpu":
        changes.append("train.ema.device=same (the EMA share on the GPU)")
    if counts.text_on_every_rank:
        changes.append(
            f"the text encoders once per node (docs/caching.md; now on every rank: {counts.text_on_every_rank})"
        )
    if setup.ranks_per_node > 1:
        changes.append("fewer ranks per node (each rank loads the model in host memory)")
    return (
        f"host RAM per node {host_per_node / 1e9:.0f} GB is above {HOST_WARNING_BYTES / 1e9:.0f} GB; what lowers "
        "it: " + "; ".join(changes or ["more nodes with fewer ranks each"])
    )
