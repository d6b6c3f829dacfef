"""Built-in tiny Qwen-Image-Edit: `builtin:tiny-qwen-image-edit`, a real QwenImageEditPipeline folder with tiny
components, and `builtin:tiny-qwen-image-edit-plus`, a QwenImageEditPlusPipeline folder (Qwen-Image-Edit-2509: several
references per sample) of the same components.

The transformer, text encoder and tokenizer are builtin:tiny-qwen-image's (same classes and configs, own seed), plus
what the edit pipeline adds: a Qwen2VLProcessor (Qwen2VLImageProcessor + the byte-level tokenizer) that puts the
source image into the instruction's prompt as vision tokens, built in memory and saved in `processor/`.

The VAE is an AutoencoderKLQwenImage with three downsampling stages (8 px per latent, as the real VAE), not
tiny-qwen-image's one-stage VAE: both pipelines always resize a source image to about 1024 x 1024 px
before encoding it, which a 2 px-per-latent VAE would turn into 65536 control tokens (minutes per render on a CPU);
at 8 px it is 4096 tokens and about 6 s. The image processor's pixel bounds are tiny (28x28 to 112x112 px, 1 to 16
vision tokens) so the vision tower stays cheap; the real model's processor allows up to 12.8 M pixels. The VAE is
random, not trained: renders are noise-like images, which is all the tests need.
"""

from __future__ import annotations

import json
from pathlib import Path

from dstune.builtin.common import BUILD_THREADS, BuiltinModel, deterministic_cpu, save_pipeline
from dstune.builtin.parts import QWEN_SCHEDULER, tiny_qwen_tokenizer
from dstune.models.qwen_image.builtin import TINY_QWEN_TRANSFORMER, tiny_qwen_vl_encoder
from dstune.models.qwen_image.model import image_only_processor
from dstune.hf import quiet_hf_libraries

_SEED = 21
# len(dim_mult) == len(temperal_downsample) + 1; spatial factor 2 ** len(temperal_downsample) = 8, as the real VAE
TINY_QWEN_EDIT_VAE = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)
# the vision tower's patching (patch 14, 2x2 merge, 2 frames per patch) with small pixel bounds
TINY_IMAGE_PROCESSOR = dict(
    patch_size=14, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112}
)


def tiny_qwen_vl_processor(tokenizer):
    """Qwen2VLProcessor parts over the byte-level tokenizer (its `<|image_pad|>` is the image token), in the
    image-only processor that needs no torchvision (dstune.models.qwen_image.model.image_only_processor)."""
    with quiet_hf_libraries():
        from transformers import Qwen2VLImageProcessor

        return image_only_processor(Qwen2VLImageProcessor(**TINY_IMAGE_PROCESSOR), tokenizer)


def build_tiny_qwen_image_edit(out: Path, needs: dict, pipeline_class: str = "QwenImageEditPipeline") -> dict:
    """builtin:tiny-qwen-image-edit: a QwenImageEditPipeline folder (or, built by the next function, a
    QwenImageEditPlusPipeline one of the same components)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    with quiet_hf_libraries():
        import diffusers
    tokenizer = tiny_qwen_tokenizer()
    processor = tiny_qwen_vl_processor(tokenizer)
    with deterministic_cpu(_SEED, BUILD_THREADS):
        text_encoder = tiny_qwen_vl_encoder(tokenizer)
        vae = AutoencoderKLQwenImage(**TINY_QWEN_EDIT_VAE)
        transformer = QwenImageTransformer2DModel(**TINY_QWEN_TRANSFORMER)
    pipeline = getattr(diffusers, pipeline_class)(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )
    facts = save_pipeline(pipeline, out, transformer)
    _name_the_processor_as_diffusers_does(out)
    return facts


def build_tiny_qwen_image_edit_plus(out: Path, needs: dict) -> dict:
    """builtin:tiny-qwen-image-edit-plus: a QwenImageEditPlusPipeline folder (Qwen-Image-Edit-2509's layout: the
    same component classes as the edit pipeline, a transformer without zero_cond_t)."""
    return build_tiny_qwen_image_edit(out, needs, "QwenImageEditPlusPipeline")


def _name_the_processor_as_diffusers_does(out: Path) -> None:
    """The saved folder names its processor Qwen2VLProcessor (transformers), as a real Qwen-Image-Edit folder does,
    not the image-only subclass it was built with: the files are the same, and where torchvision is installed
    QwenImageEditPipeline.from_pretrained then loads it by itself."""
    index_path, config_path = out / "model_index.json", out / "processor" / "processor_config.json"
    index, config = json.loads(index_path.read_text()), json.loads(config_path.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    config["processor_class"] = "Qwen2VLProcessor"
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


TINY_QWEN_IMAGE_EDIT = BuiltinModel(
    name="tiny-qwen-image-edit",
    folder_name="tiny-qwen-image-edit-v1",
    family="flow",
    description="Qwen-Image-Edit pipeline: 2-layer QwenImage transformer, Qwen2.5-VL text encoder (one 32-wide "
    "layer, a one-block vision tower) with its processor, random 16-channel Qwen-Image VAE (8 px per "
    "latent)",
    build=build_tiny_qwen_image_edit,
)

TINY_QWEN_IMAGE_EDIT_PLUS = BuiltinModel(
    name="tiny-qwen-image-edit-plus",
    folder_name="tiny-qwen-image-edit-plus-v1",
    family="flow",
    description="Qwen-Image-Edit-2509 pipeline (QwenImageEditPlusPipeline, several references per sample): the "
    "components of tiny-qwen-image-edit",
    build=build_tiny_qwen_image_edit_plus,
)
