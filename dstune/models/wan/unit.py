"""The Wan 2.1 / 2.2 (text-to-video, image-to-video, TI2V, two experts) unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import ModelPreset, ModelUnit, lora, video

UNIT = ModelUnit(
    name="wan",
    title="Wan 2.1 / 2.2 (text-to-video, image-to-video, TI2V, two experts)",
    docs="docs/family-wan.md",
    names=r"wan|wan2\.[12]|wan2[12]|wan_\w+",
    recipes={"wan": ("dstune.models.wan.video:VIDEO_MODEL",)},
    video_facts=("dstune.models.wan.facts:VIDEO_FACTS",),
    summary="Wan 2.1 / 2.2 (WanTransformer3DModel, AutoencoderKLWan, UMT5): text-to-video, image-to-video (Wan 2.1 I2V with its CLIP image encoder, Wan 2.2 I2V A14B) and Wan 2.2 TI2V 5B",
    pipelines={"WanPipeline": 5.0, "WanImageToVideoPipeline": 5.0},
    native_sizes={
        "WanPipeline": (480, "WanPipeline's default frames are 480x832; the shorter side"),
        "WanImageToVideoPipeline": (480, "WanImageToVideoPipeline's default frames are 480x832; the shorter side"),
    },
    spec_notes={"model.max_sequence_length": "512 (Wan: UMT5 tokens, zero-padded as WanPipeline pads them)"},
    activation_cases=("dstune.models.wan.builtin:ACTIVATION_CASES",),
    builtins={
        "tiny-wan": "dstune.models.wan.builtin:TINY_WAN",
        "tiny-wan-a14b": "dstune.models.wan.builtin:TINY_WAN_A14B",
        "tiny-wan-i2v": "dstune.models.wan.builtin:TINY_WAN_I2V",
        "tiny-wan22-ti2v": "dstune.models.wan.builtin:TINY_WAN22_TI2V",
    },
    presets=(
        ModelPreset(
            "wan21",
            "Wan 2.1 text-to-video 14B",
            "wan",
            "Wan-AI/Wan2.1-T2V-14B-Diffusers",
            "tiny-wan",
            video(480, 81, 16, 5.0, **lora(), **{"model.max_sequence_length": 512}),
        ),
        ModelPreset(
            "wan21-i2v",
            "Wan 2.1 image-to-video 14B 480P",
            "wan",
            "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
            "tiny-wan-i2v",
            video(480, 81, 16, 5.0, **lora(), **{"model.image_to_video": True, "sample.prompts": []}),
        ),
        ModelPreset(
            "wan22-a14b",
            "Wan 2.2 text-to-video A14B (two experts; the low-noise one trained here)",
            "wan",
            "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            "tiny-wan-a14b",
            video(480, 81, 16, 4.0, **lora(), **{"model.expert": "low_noise"}),
        ),
        ModelPreset(
            "wan22-ti2v",
            "Wan 2.2 TI2V 5B (text-to-video, 16x VAE)",
            "wan",
            "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
            "tiny-wan22-ti2v",
            video(704, 121, 24, 5.0, **lora()),
        ),
    ),
)
