"""The torch-free facts of the flux2 unit: its rows of the flow core's table (dstune.families.flow_facts), told by the transformer class."""

from __future__ import annotations

from dstune.families.flow_facts import FlowModel, two_streams

FLOW_MODELS = {
    "Flux2Transformer2DModel": FlowModel(
        "FLUX.2", "flux2", two_streams, "joint_attention_dim", samples_from_cached_text=True
    ),
}
