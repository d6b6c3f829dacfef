"""The torch-free facts of the sd3_flux unit: its rows of the flow core's table (dstune.families.flow_facts), told by the transformer class."""

from __future__ import annotations

from dstune.families.flow_facts import FlowModel, joint_blocks, two_streams

FLOW_MODELS = {
    "SD3Transformer2DModel": FlowModel(
        "SD3",
        "sd3",
        joint_blocks,
        "joint_attention_dim",
        clip_tokens=77,  # T5's 77 tokens after CLIP's 77
        default_text_tokens=77,
        samples_from_cached_text=True,  # its recipes' Sampling.cached_text
    ),
    "FluxTransformer2DModel": FlowModel(
        "Flux.1", "flux1", two_streams, "joint_attention_dim", samples_from_cached_text=True
    ),
}
