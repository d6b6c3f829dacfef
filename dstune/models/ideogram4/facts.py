"""The torch-free facts of the ideogram4 unit: its rows of the flow core's table (dstune.families.flow_facts), told by the transformer class."""

from __future__ import annotations

from dstune.families.flow_facts import FlowModel
from dstune.memory.activations import ModelShape


def one_stream(config: dict) -> ModelShape:
    """Ideogram 4: one stream of blocks over the padded text and the image tokens, its MLP width its own key."""
    return ModelShape(
        config["num_attention_heads"] * config["attention_head_dim"],
        {"layers": config["num_layers"]},
        ffn=config["intermediate_size"],
    )


FLOW_MODELS = {
    "Ideogram4Transformer2DModel": FlowModel(
        "Ideogram 4",
        "ideogram4",
        one_stream,
        "llm_features_dim",
        default_text_tokens=2048,
        sampling_parts=("unconditional_transformer",),
        draws_sigma=True,
    ),
}
