"""The spec's `sample` section: what renders (or speaks) before, during and after training."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import Field, model_validator

from dstune.spec.section import Section


class SampleSpec(Section):
    prompts: list[str] = Field(
        default_factory=list,
        description="Prompts rendered before, during (sample.every_steps) and after training: a PNG grid for an image "
        "model, animated clips for a video model, WAV files for a speech model (none: no samples).",
    )
    every_steps: Optional[int] = Field(
        None, gt=0, description="Also sample every N optimizer steps (before and after always)."
    )
    steps: int = Field(20, gt=0, description="Denoising steps per sample.")
    guidance: float = Field(
        5.0,
        ge=0,
        description="Classifier-free guidance scale (the pipeline's guidance_scale, true_cfg_scale or "
        "guidance embedding value, as the model's pipeline calls it). Omitted: the default of the model's own "
        "pipeline (each model's: the table at the top of this page; 0 for a distilled folder that samples without "
        "guidance); with sample.pretrained, that folder's pipeline decides; `validate` prints the value and why.",
    )
    seed: int = Field(0, ge=0, description="Sampling seed, so grids from different steps are comparable.")
    pretrained: Optional[str] = Field(
        None,
        description="model.family flow with train: lora: a second pipeline folder (or hub id, builtin:) of the "
        "same model whose transformer the samples use, with the trained LoRA on it: train on a base checkpoint "
        "and sample with its distilled one. Its transformer must have the trained one's "
        "class and shapes. Omitted: the trained transformer itself (without model.training_adapter).",
    )
    control_images: list[Union[str, list[str]]] = Field(
        default_factory=list,
        description="Edit models: the source image of each prompt, one path per prompt in the same order; each "
        "sample edits its source as the prompt says. A model that takes several references per sample "
        "(data.control_dir a list: docs/data.md) takes a list of paths per prompt, as many as it "
        "trains with, in data.control_dir's order. Image-to-video (model.image_to_video): the first frame of each "
        "prompt's clip. Video models trained on reference clips (data.control_dir): each prompt's reference clip "
        "(a video, or an image); with image-to-video too, a list [reference clip, first frame] per prompt. Other "
        "models: none.",
    )

    @property
    def control_image_paths(self) -> list[str]:
        """Every file sample.control_images names (a prompt's several references flattened)."""
        return [path for one in self.control_images for path in ([one] if isinstance(one, str) else one)]

    voice_prompts: list[str] = Field(
        default_factory=list,
        description="Speech models that continue a reference voice (model.family "
        "tts_codebooks, a class that takes one: docs/tts.md): one reference clip per prompt (WAV, FLAC, OGG), in "
        "the prompts' order, its transcript in a .txt file of the same name beside it (speaker tags included); each "
        "sample speaks its prompt after that clip, in its voice. Omitted: the prompts alone.",
    )

    @model_validator(mode="after")
    def _one_source_per_prompt(self) -> "SampleSpec":
        if self.control_images and len(self.control_images) != len(self.prompts):
            raise ValueError(
                f"sample.control_images has {len(self.control_images)} image(s) for "
                f"{len(self.prompts)} prompt(s): give one source image per prompt, in the prompts' order"
            )
        if self.voice_prompts and len(self.voice_prompts) != len(self.prompts):
            raise ValueError(
                f"sample.voice_prompts has {len(self.voice_prompts)} clip(s) for {len(self.prompts)} "
                "prompt(s): give one reference clip per prompt, in the prompts' order"
            )
        return self
