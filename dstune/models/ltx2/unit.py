"""The LTX-2 (text- and image-to-video, with the clips' sound) unit: what dstune.models.registry lists of it. Torch-free."""

from __future__ import annotations

from dstune.models.unit import VIDEO_FAMILY, ModelPreset, ModelUnit, lora, video

UNIT = ModelUnit(
    name="ltx2",
    title="LTX-2 (text- and image-to-video with sound)",
    docs="docs/family-ltx2.md",
    names=r"ltx\w*",
    recipes={VIDEO_FAMILY: ("dstune.models.ltx2.video:VIDEO_MODEL",)},
    video_facts=("dstune.models.ltx2.facts:VIDEO_FACTS",),
    summary="LTX-2 (LTX2VideoTransformer3DModel, Gemma 3 with its text connectors): text- and image-to-video "
    "(model.image_to_video), audio+video on clips with sound",
    pipelines={"LTX2Pipeline": 3.0},
    spec_notes={"model.max_sequence_length": "1024 (LTX-2: Gemma 3 tokens)"},
    activation_cases=("dstune.models.ltx2.builtin:ACTIVATION_CASES",),
    builtins={"tiny-ltx2": "dstune.models.ltx2.builtin:TINY_LTX2"},
    presets=(
        ModelPreset(
            "ltx2",
            "LTX-2 text-to-video with sound (19 B audio+video transformer; Gemma 3 12B)",
            VIDEO_FAMILY,
            "Lightricks/LTX-2",
            "tiny-ltx2",
            video(512, 121, 24, 3.0, **lora(), **{"model.timestep_sampling": "shifted_logit_normal"}),
        ),
    ),
)
