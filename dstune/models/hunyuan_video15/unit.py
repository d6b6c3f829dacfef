"""The HunyuanVideo 1.5 (text- and image-to-video) unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, lora, video

UNIT = ModelUnit(
    name="hunyuan_video15",
    title="HunyuanVideo 1.5 (text- and image-to-video)",
    docs="docs/family-hunyuan-video15.md",
    names=r"hunyuan\w*",
    recipes={'wan': ('dstune.models.hunyuan_video15.video:VIDEO_MODEL',)},
    builtins=('dstune.models.hunyuan_video15.builtin:TINY_HUNYUAN_VIDEO15', 'dstune.models.hunyuan_video15.builtin:TINY_HUNYUAN_VIDEO15_I2V'),
    presets=(
        ModelPreset("hunyuan-video15", "HunyuanVideo 1.5 480p text-to-video (8.3 B; Qwen2.5-VL + ByT5)", "wan",
                    "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", "tiny-hunyuan-video15",
                    video(480, 121, 24, 6.0, **lora(), **{"model.timestep_sampling": "logit_normal"})),
        ModelPreset("hunyuan-video15-i2v", "HunyuanVideo 1.5 480p image-to-video (SigLIP first-frame embedding)", "wan",
                    "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v", "tiny-hunyuan-video15-i2v",
                    video(480, 121, 24, 6.0, **lora(), **{"model.timestep_sampling": "logit_normal",
                                                            "sample.prompts": []})),
    ),
)
