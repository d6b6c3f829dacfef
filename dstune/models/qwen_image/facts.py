"""The torch-free facts of the qwen_image unit: its rows of the flow core's table (dstune.families.flow_facts), told by the transformer class."""

from __future__ import annotations

from dstune.families.flow_facts import FlowModel, joint_blocks

FLOW_MODELS = {
    "QwenImageTransformer2DModel": FlowModel(
        "Qwen-Image",
        "qwen-image",
        joint_blocks,
        "joint_attention_dim",
        edit_pipelines=("QwenImageEditPipeline",),
        edit_vision_patch_px=28,  # the edit's source image: 28 px tokens
        samples_from_cached_text=True,  # Qwen-Image's recipe's Sampling.cached_text (an edit's text is not cached)
    ),
}
