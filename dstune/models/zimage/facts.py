"""The torch-free facts of the zimage unit: its rows of the flow core's table (dstune.families.flow_facts), told by the transformer class."""

from __future__ import annotations

import math

from dstune.families.flow_facts import FlowModel
from dstune.memory.activations import ModelShape


def single_stream(config: dict) -> ModelShape:
    """Z-Image: one stream of n_layers, with refiners over the image tokens and over the caption before it."""
    refiners = config.get("n_refiner_layers", 0)
    return ModelShape(
        config["dim"], {"layers": config["n_layers"], "noise_refiner": refiners, "context_refiner": refiners}
    )


def padded_to_32(tokens: float) -> float:
    """Z-Image pads the image tokens and the caption's each to a multiple of 32."""
    return math.ceil(tokens / 32) * 32


FLOW_MODELS = {
    "ZImageTransformer2DModel": FlowModel(
        "Z-Image", "z-image", single_stream, "cap_feat_dim", pad_tokens=padded_to_32, samples_from_cached_text=True
    ),
}
