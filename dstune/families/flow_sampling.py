"""The flow core's samples (sample.prompts during training): each recipe's own diffusers pipeline around the live
transformer (no weight copy), from the prompts or, on a rank without text encoders (dstune.text_once), from the
prompts' cached text through the recipe's Sampling.cached_text.

    sample(built, transformer_module, prompts, sample_spec, resolution) -> images, or clips (lists of frames)
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import inputs_cast_to
from dstune.families.flow_core import FlowBuilt, pipeline_of
from dstune.families.flow_distilled import with_trained_lora
from dstune.families.flow_recipe import vae_spatial_factor
from dstune.families.flow_sound import rendered_clip
from dstune.families.randomness import sample_generator
from dstune.hf import quiet_hf_libraries


def _sample_scheduler(built: FlowBuilt):
    from diffusers import FlowMatchEulerDiscreteScheduler

    if built.recipe.sampling.scheduler:
        return built.recipe.sampling.scheduler(built)
    return FlowMatchEulerDiscreteScheduler.from_config(built.scheduler.config)


def sample(
    built: FlowBuilt, transformer_module: torch.nn.Module, prompts: list[str], sample_spec, resolution: int
) -> list:
    """One image (a video model: one clip, a list of model.sample_frames PIL frames) per prompt with the folder's
    own pipeline class around `transformer_module` (no weight copy). Prompt i starts from the noise of
    (sample_spec.seed, i), so samples of different steps are comparable. A conditioned model renders each prompt
    from its source (sample.control_images), one call per prompt; so does a video model (its pipeline takes one
    generator)."""
    if not prompts:
        return []
    recipe, sampling, conditioning = built.recipe, built.recipe.sampling, built.recipe.conditioning
    sources = (
        conditioning.sample_sources(built, sample_spec, prompts)
        if conditioning and conditioning.sample_sources
        else None
    )
    factor = sampling.side_multiple(built) if sampling.side_multiple else vae_spatial_factor(built.vae.config) * 2
    side = max(factor, resolution // factor * factor)
    generators = [sample_generator(sample_spec.seed, 0, number, "sample") for number in range(len(prompts))]
    experts = recipe.experts.other_loaded(built) if recipe.experts else contextlib.nullcontext()
    if built.sampling is not None:  # another folder's transformer with the trained LoRA (flow_distilled)
        transformer_module = with_trained_lora(built.sampling, transformer_module)
        built = replace(
            built,
            folder=built.sampling.folder,
            model_index=built.sampling.model_index,
            scheduler=built.sampling.scheduler,
            sampling=None,
        )
    was_training = transformer_module.training
    transformer_module.eval()
    try:
        with (
            experts,
            inputs_cast_to(transformer_module, next(transformer_module.parameters()).dtype),
            quiet_hf_libraries(),
        ):
            pipeline = pipeline_of(built, transformer_module, built.vae, _sample_scheduler(built))
            guidance = (
                sampling.options(built, sample_spec, prompts)
                if sampling.options
                else {"guidance_scale": sample_spec.guidance}
            )
            frames = {"num_frames": built.settings.sample_frames} if recipe.latents.frames else {}
            common = dict(
                height=side, width=side, **frames, **guidance, num_inference_steps=sample_spec.steps, output_type="pil"
            )
            if sampling.takes_max_sequence_length:
                common["max_sequence_length"] = built.max_sequence_length
            common = sampling.call(built, pipeline, sample_spec, common) if sampling.call else common
            cached = not any(encoder is not None for encoder in built.text_encoders.values())
            if cached:  # the negative prompt's cached text replaces the string the sampling options pass
                common.pop("negative_prompt", None)
            if sources is None and not recipe.latents.frames:
                text = cached_prompts(built, pipeline, list(prompts)) if cached else {"prompt": list(prompts)}
                return pipeline(**text, generator=generators, **common).images
            text_side = None if cached else pipeline_of(built)
            outputs = []
            for prompt, generator, source in zip(prompts, generators, sources or [None] * len(prompts)):
                inputs = (
                    {"prompt": prompt}
                    if sources is None
                    else conditioning.sample_inputs(built, text_side, prompt, source, sample_spec)
                )
                if cached:  # no text encoder here: the prompt's cached text, as the pipeline takes it
                    inputs.pop("prompt", None)
                    inputs.update(cached_prompts(built, pipeline, [prompt]))
                result = pipeline(**inputs, generator=generator, **common)
                outputs.append(rendered_clip(built, result) if recipe.latents.frames else result.images[0])
            return outputs
    finally:
        transformer_module.train(was_training)


def cached_prompts(built: FlowBuilt, pipeline, prompts: list[str]) -> dict:
    """The pipeline call's prompt arguments from the prompts' cached text tensors, stacked (B, ...) in order, and as
    many copies of those of the negative prompt (Sampling.negative_caption: "", which every pipeline here encodes
    when given none, or the one the sampling options pass), by the recipe's Sampling.cached_text. Cached text
    tensors of one run all have one shape (training batches stack them)."""
    hook, negative = built.recipe.sampling.cached_text, built.recipe.sampling.negative_caption
    missing = [caption for caption in [*prompts, negative] if caption not in built.prompt_text]
    if hook is None or missing:
        raise FamilyError(
            f"samples: no cached text for {missing[:1] or prompts[:1]} and no text encoder on this rank "
            f"({built.recipe.pipeline_class}); this is a bug of dstune's start-up "
            "(dstune.families.denoiser_facts.text_once_per_node)"
        )

    def stacked(captions: list[str]) -> dict:
        names = built.prompt_text[captions[0]]
        return {
            name: torch.stack([built.prompt_text[caption][name] for caption in captions]).to(built.device)
            for name in names
        }

    return hook(built, pipeline, stacked(prompts), stacked([negative] * len(prompts)))
