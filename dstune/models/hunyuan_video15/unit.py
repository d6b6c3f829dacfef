"""The HunyuanVideo 1.5 (text- and image-to-video) unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import VIDEO_FAMILY, ModelPreset, ModelUnit, lora, video

UNIT = ModelUnit(
    name="hunyuan_video15",
    title="HunyuanVideo 1.5 (text- and image-to-video)",
    docs="docs/family-hunyuan-video15.md",
    names=r"hunyuan\w*|hv15\w*",
    recipes={VIDEO_FAMILY: ("dstune.models.hunyuan_video15.video:VIDEO_MODEL",)},
    video_facts=("dstune.models.hunyuan_video15.facts:VIDEO_FACTS",),
    summary="HunyuanVideo 1.5 (HunyuanVideo15Transformer3DModel, Qwen2.5-VL and ByT5): text- and image-to-video",
    pipelines={"HunyuanVideo15Pipeline": 6.0, "HunyuanVideo15ImageToVideoPipeline": 6.0},
    spec_notes={
        "model.max_sequence_length": "1000 (HunyuanVideo 1.5: Qwen2.5-VL tokens after its template; ByT5's glyph tokens stay 256)"
    },
    activation_cases=("dstune.models.hunyuan_video15.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-hunyuan-video15": "dstune.models.hunyuan_video15.builtin:TINY_HUNYUAN_VIDEO15",
        "tiny-hunyuan-video15-i2v": "dstune.models.hunyuan_video15.builtin:TINY_HUNYUAN_VIDEO15_I2V",
    },
    presets=(
        ModelPreset(
            "hunyuan-video15",
            "HunyuanVideo 1.5 480p text-to-video (8.3 B; Qwen2.5-VL + ByT5)",
            VIDEO_FAMILY,
            "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
            "tiny-hunyuan-video15",
            video(480, 121, 24, 6.0, **lora(), **{"model.timestep_sampling": "logit_normal"}),
        ),
        ModelPreset(
            "hunyuan-video15-i2v",
            "HunyuanVideo 1.5 480p image-to-video (SigLIP first-frame embedding)",
            VIDEO_FAMILY,
            "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v",
            "tiny-hunyuan-video15-i2v",
            video(480, 121, 24, 6.0, **lora(), **{"model.timestep_sampling": "logit_normal", "sample.prompts": []}),
        ),
    ),
)
