"""model.activation_offload in the memory plan: with gradient checkpointing, each checkpointed block's inputs wait in
(pinned) host memory until backward recomputes the block, which brings one block's back to the device at a time
(dstune.families.diffusion.offloaded_checkpoint). The counts (ModelCounts.offloaded_sample_bytes, the blocks' inputs
of one sample, and offload_block_bytes, the largest block's) come from each model's measured constants.
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
