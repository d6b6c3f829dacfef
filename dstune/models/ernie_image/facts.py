"""The torch-free facts of the ernie_image unit: its row of the flow core's table (dstune.families.flow_facts), told by
the transformer class."""

from __future__ import annotations

from dstune.families.flow_facts import FlowModel
from dstune.memory.activations import ModelShape

DEFAULT_TEXT_TOKENS = 512  # dstune's max_sequence_length default (the pipeline pads to the longest caption instead)


def shared_modulation_blocks(config: dict) -> ModelShape:
    """ERNIE-Image: one stream of blocks over the image and text tokens (one AdaLN modulation shared by all), its
    GELU-gated MLP width its own key."""
    return ModelShape(config["hidden_size"], {"layers": config["num_layers"]}, ffn=config["ffn_hidden_size"])


FLOW_MODELS = {
    "ErnieImageTransformer2DModel": FlowModel(
        "ERNIE-Image",
        "ernie-image",
        shared_modulation_blocks,
        "text_in_dim",
        default_text_tokens=DEFAULT_TEXT_TOKENS,
        lora_formats=("diffusers",),
        lora_loader="ErnieImagePipeline.load_lora_weights",
        samples_from_cached_text=True,  # its recipe's Sampling.cached_text
    ),
}
