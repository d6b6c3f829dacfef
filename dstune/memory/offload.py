"""model.activation_offload and model.text_encoder_offload in the memory plan.

model.activation_offload: with gradient checkpointing, each checkpointed block's inputs wait in
(pinned) host memory until backward recomputes the block, which brings one block's back to the device at a time
(dstune.families.diffusion.offloaded_checkpoint). The counts (ModelCounts.offloaded_sample_bytes, the blocks' inputs
of one sample, and offload_block_bytes, the largest block's) come from each model's measured constants.

model.text_encoder_offload: the text encoders' weights stay in host memory while they build the text cache, and each
layer's are copied to the device for its own forward (dstune.families.text_offload): the load and cache phases hold
the largest such layer (ModelCounts.text_offload_layer_params: the largest module's own parameters over the text
encoders, one at a time) instead of the encoders. On the CPU accelerator the host is the device: the encoders stay
counted whole and the layer's copy is added. The host figure does not change: the node's already counts the encoders
whole on the rank that loads them (once_per_node_bytes; the lever requires them loaded once per node).
"""

from __future__ import annotations


def offloads_activations(setup) -> bool:
    return setup.activation_offload and setup.gradient_checkpointing


def offload_sample_change(counts, setup) -> float:
    """What offload changes in one sample's activations on the device: the largest block's inputs back while it is
    recomputed, less every block's inputs on a GPU; on the CPU accelerator the host is the device, so the copies stay
    in the same memory and only the block brought back is added."""
    if not offloads_activations(setup):
        return 0.0
    return counts.offload_block_bytes - (counts.offloaded_sample_bytes if setup.accelerator == "cuda" else 0)


def offloaded_activations(counts, setup) -> float:
    """The checkpointed blocks' inputs a rank keeps in host memory during a step (GPU runs; 0 on the CPU
    accelerator, where `activations` counts them)."""
    if not offloads_activations(setup) or setup.accelerator != "cuda":
        return 0.0
    return setup.micro_batch * counts.offloaded_sample_bytes * setup.weight_bytes / 2.0 / setup.sequence_parallel


def text_encoder_terms(counts, setup, text_part) -> tuple[float, float]:
    """(the frozen parts on the device while the model loads and the cache is built, the text encoders' one layer
    copied there for its forward (0 without model.text_encoder_offload)); `text_part` tells a text encoder's name."""
    every = setup.frozen_bytes * sum(counts.companions.values())
    if not setup.text_encoder_offload:
        return every, 0.0
    layer = setup.frozen_bytes * counts.text_offload_layer_params
    if setup.accelerator != "cuda":
        return every, layer
    text = setup.frozen_bytes * sum(n for name, n in counts.companions.items() if text_part(name))
    return every - text, layer
