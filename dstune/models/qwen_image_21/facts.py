"""The torch-free facts of the qwen_image_21 unit: its rows of the flow core's table (dstune.families.flow_facts), told by the transformer class."""

from __future__ import annotations

from dstune.families.flow_facts import FlowModel
from dstune.memory.activations import ModelShape


def one_stream_ratio(config: dict) -> ModelShape:
    """Qwen-Image 2.1: one stream of blocks over the caption and the image tokens, its MLP mlp_ratio x the width."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return ModelShape(width, {"transformer_blocks": config["num_layers"]}, ffn=config.get("mlp_ratio", 3) * width)


FLOW_MODELS = {
    "QwenImage21Transformer2DModel": FlowModel(
        "Qwen-Image 2.1", "qwen-image-21", one_stream_ratio, "context_in_dim", side_px=32, samples_from_cached_text=True
    ),
}
