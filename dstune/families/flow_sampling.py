"""The flow core's samples (sample.prompts during training): each model's own diffusers pipeline around the live
transformer (no weight copy), from the prompts or, on a rank without text encoders (dstune.text_once), from the
prompts' cached text (the card's cached_text_* fields).

    render(model, transformer_module, prompts, sample_spec, resolution) -> images, or clips (lists of frames)
"""

from __future__ import annotations

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import inputs_cast_to
from dstune.families.flow_distilled import with_trained_lora
from dstune.families.precision import compute_dtype
from dstune.families.randomness import sample_generator
from dstune.hf import quiet_hf_libraries


def render(model, transformer_module: torch.nn.Module, prompts: list[str], sample_spec, resolution: int) -> list:
    """One image (a video model: one clip) per prompt with the model's own pipeline around `transformer_module`.
    Prompt i starts from the noise of (sample_spec.seed, i), so samples of different steps are comparable. A model
    with sources renders each prompt from its source (sample.control_images), one call per prompt; so does a video
    model (its pipeline takes one generator)."""
    if not prompts:
        return []
    sources = model.sample_sources(sample_spec, prompts)
    factor = model.side_multiple()
    side = max(factor, resolution // factor * factor)
    generators = [sample_generator(sample_spec.seed, 0, number, "sample") for number in range(len(prompts))]
    sampling = model.sampling_denoiser
    if sampling is not None:  # another folder's transformer with the trained LoRA (flow_distilled)
        transformer_module = with_trained_lora(sampling, transformer_module)
    was_training = transformer_module.training
    transformer_module.eval()
    try:
        with (
            model.experts_loaded(),
            inputs_cast_to(transformer_module, compute_dtype(transformer_module)),
            quiet_hf_libraries(),
            _sampling_folder(model),
        ):
            pipeline = model.pipeline(transformer_module, model.vae, model.sample_scheduler())
            frames = {"num_frames": model.model_spec.sample_frames} if model.modality == "video" else {}
            common = dict(
                height=side,
                width=side,
                **frames,
                **model.sample_guidance(sample_spec, prompts),
                num_inference_steps=sample_spec.steps,
                output_type="pil",
                max_sequence_length=model.max_sequence_length,
            )
            common = model.sample_arguments(pipeline, sample_spec, common)
            cached = not any(encoder is not None for encoder in model.text_encoders.values())
            if cached:  # the negative prompt's cached text replaces the string the sampling options pass
                common.pop("negative_prompt", None)
            if sources is None and model.modality != "video":
                text = cached_prompts(model, pipeline, list(prompts)) if cached else {"prompt": list(prompts)}
                return pipeline(**text, generator=generators, **common).images
            text_side = None if cached else model.pipeline()
            outputs = []
            for prompt, generator, source in zip(prompts, generators, sources or [None] * len(prompts)):
                inputs = (
                    {"prompt": prompt}
                    if sources is None
                    else model.sample_inputs(text_side, prompt, source, sample_spec, side)
                )
                if cached:  # no text encoder here: the prompt's cached text, as the pipeline takes it
                    inputs.pop("prompt", None)
                    inputs.update(cached_prompts(model, pipeline, [prompt]))
                outputs.append(model.rendered(pipeline(**inputs, generator=generator, **common)))
            return outputs
    finally:
        transformer_module.train(was_training)


class _sampling_folder:
    """While samples render with another folder's transformer (sample.pretrained), the model reads that folder's
    model_index.json and scheduler (its pipeline settings, its sampling schedule)."""

    def __init__(self, model):
        self.model, self.saved = model, None

    def __enter__(self):
        sampling = self.model.sampling_denoiser
        if sampling is not None:
            self.saved = (self.model.folder, self.model.model_index, self.model.scheduler)
            self.model.folder, self.model.model_index = sampling.folder, sampling.model_index
            self.model.scheduler = sampling.scheduler
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.model.folder, self.model.model_index, self.model.scheduler = self.saved
        return False


def cached_prompts(model, pipeline, prompts: list[str]) -> dict:
    """The pipeline call's prompt arguments from the prompts' cached text tensors, stacked (B, ...) in order, and as
    many copies of those of the negative prompt (the card's negative_caption: "", which every pipeline here encodes
    when given none, or the one the sampling options pass), by the model's cached_text_arguments. Cached text
    tensors of one run all have one shape (training batches stack them)."""
    negative = model.card.negative_caption()
    missing = [caption for caption in [*prompts, negative] if caption not in model.prompt_text]
    if not model.card.samples_from_cached_text or missing:
        raise FamilyError(
            f"samples: no cached text for {missing[:1] or prompts[:1]} and no text encoder on this rank "
            f"({model.card.pipeline_class}); this is a bug of dstune's start-up "
            "(dstune.families.denoiser_facts.text_once_per_node)"
        )

    def stacked(captions: list[str]) -> dict:
        names = model.prompt_text[captions[0]]
        return {
            name: torch.stack([model.prompt_text[caption][name] for caption in captions]).to(model.device)
            for name in names
        }

    return model.cached_text_arguments(pipeline, stacked(prompts), stacked([negative] * len(prompts)))
