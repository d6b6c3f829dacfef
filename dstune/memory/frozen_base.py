"""A LoRA module's frozen base in the memory plan, as stored: at the compute dtype, at model.base_precision's bytes per
parameter, or, for int8 under ZeRO-3, as dstune's Int8Linear (dstune.families.int8_partitioned) stores it: each linear
weight an int8 code with one scale per output row in the training dtype, every other parameter of the base (biases,
norms, convolutions, embeddings) as it was, all of it partitioned across the ranks. Pure functions of the plan's
ModelCounts and Setup (dstune.memory.plan)."""

from __future__ import annotations

from typing import Optional


def frozen_base_bytes(counts, setup) -> float:
    """The frozen base of a LoRA module, whole, as stored."""
    int8 = int8_base_bytes(counts, setup)
    if int8 is not None:
        return int8
    base_bytes = setup.base_bytes_per_param if setup.base_bytes_per_param is not None else setup.weight_bytes
    return base_bytes * counts.frozen_base_params


def int8_base_bytes(counts, setup) -> Optional[float]:
    """The whole frozen base as stored: a byte a linear weight, a scale a row and the rest at the compute dtype;
    None where the run has no int8 base under ZeRO-3 or the counts have no linear weights (counted otherwise)."""
    weights, rows = counts.linear_weights
    if not (setup.int8_partitioned and weights and counts.frozen_base_params):
        return None
    return weights + setup.weight_bytes * (rows + counts.frozen_base_params - weights)


def int8_codes_per_rank(counts, setup) -> float:
    """The bytes of int8 codes each rank stores: its 1 / N of every linear weight."""
    return counts.linear_weights[0] / setup.world_size if setup.int8_partitioned else 0.0


def dequantized_copy(counts, setup) -> float:
    """The gathered layer's dequantized copy (compute dtype), made in each forward and backward of the layer and
    freed after it; the gathered int8 layer itself is in zero3_gathered_bytes, counted there at the compute dtype."""
    return (
        setup.weight_bytes * counts.largest_layer_params if setup.int8_partitioned and counts.frozen_base_params else 0
    )
