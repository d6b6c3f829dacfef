"""The torch-free facts of the krea2 unit: its rows of the flow core's table (dstune.families.flow_facts), told by the transformer class."""

from __future__ import annotations

from dstune.families.flow_facts import FlowModel, joint_blocks

FLOW_MODELS = {
    "Krea2Transformer2DModel": FlowModel(
        "Krea 2",
        "krea2",
        joint_blocks,
        "text_hidden_dim",
        text_layers_key="num_text_layers",
        lora_formats=("diffusers",),
        lora_loader="Krea2Pipeline.load_lora_weights",
        samples_from_cached_text=True,  # its recipe's Sampling.cached_text
    ),
}
