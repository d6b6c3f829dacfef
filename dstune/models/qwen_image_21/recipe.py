"""The flow family's Qwen-Image 2.1 recipe (dstune.families.flow_recipe), as diffusers'
examples/dreambooth/train_dreambooth_lora_qwenimage21.py feeds QwenImage21Transformer2DModel:

- text: QwenImage21Pipeline.encode_prompt (the caption in the pipeline's raw template with its fixed system prompt,
  read by Qwen3-VL, the system prompt's tokens dropped, the last decoder layer's output before the final norm),
  zero-padded to model.max_sequence_length with a mask of ones over the caption's tokens so that every caption's
  tensors have one shape (the text cache); each batch is cut back to its longest caption before the transformer
  sees it, since the image's rotary position follows the text's length (the example pads a batch to its longest
  caption, and the pipeline samples one caption unpadded);
- latents: AutoencoderKLQwenImage21's one-frame posterior of the image as RGBA (opaque alpha, as the example
  converts every image), normalised per channel with the VAE's latents_mean / latents_std; the VAE is 16x, so
  pixel sides are multiples of 32 (the transformer's image slots are 2x2 latents);
- the transformer sees the latents unpatched, flattened row by row, img_mask over [caption tokens (False) | one
  slot per 2x2 latents (True)], img_shapes [[(1, h, w)]] per sample and timestep / 1000; the prediction's tail
  (the image) is the velocity, target noise - x0 (the core's), with u drawn uniformly over the scheduler's table.

A Qwen-Image 2.1 Turbo folder is the same pipeline class with `sample_sigmas` in its model_index.json (the few
sampling sigmas it was distilled for): training is the same; samples render on that grid (sample.steps must then
be its length, which dstune validate checks).

The pipeline's `processor` is a Qwen3VLProcessor; transformers cannot build one without torchvision, so a folder
whose `processor` is a plain tokenizer (builtin:tiny-qwen-image-21) gets TextProcessor around it, which does what
the text-to-image pipeline asks of a processor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component, read_model_index
from dstune.families.flow_recipe import (
    FlowRecipe,
    LatentSpace,
    Sampling,
    TextSide,
    embeds_and_mask,
    fixed_patch,
    read_config,
)
from dstune.hf import quiet_hf_libraries

TEXT_TENSORS = ("encoder_hidden_states", "encoder_attention_mask")
DEFAULT_TEXT_TOKENS = 512  # the example sets no limit; a caption's tokens after the dropped system prompt


class TextProcessor:
    """What QwenImage21Pipeline asks of its processor for text-to-image (call, apply_chat_template, .tokenizer),
    done by a tokenizer: the stand-in for a Qwen3VLProcessor where transformers cannot build one (no torchvision).
    Condition images need the real processor."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text=None, images=None, **kwargs):
        if images is not None:
            raise FamilyError(
                "condition images need the folder's Qwen3VLProcessor; this folder's processor is a text-only tokenizer"
            )
        return self.tokenizer(text=text, **kwargs)

    def apply_chat_template(self, conversation, tokenize=False, **kwargs):
        """As a processor answers: one conversation in, a batch of one out when tokenized."""
        kwargs.pop("return_dict", None)
        if not tokenize:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        return [self.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)]


def load_processor(folder: Path):
    """The folder's processor as QwenImage21Pipeline takes it: the Qwen3VLProcessor a real folder lists, or a
    TextProcessor around the tokenizer a folder lists instead."""
    import transformers

    listed = str((read_model_index(folder).get("processor") or [None, ""])[-1])
    if listed.endswith("Processor"):
        try:
            return load_component(folder, "processor", transformers.AutoProcessor.from_pretrained)
        except ImportError as err:  # Qwen3VLProcessor's video processor needs torchvision
            first_line = (str(err).strip().splitlines() or ["ImportError"])[0]
            raise FamilyError(
                f"{folder / 'processor'}: cannot load its {listed} ({first_line}): QwenImage21Pipeline "
                "encodes captions with it, and transformers builds it only with torchvision: install "
                "the torchvision release that matches your torch"
            ) from None
    return TextProcessor(load_component(folder, "processor", transformers.AutoTokenizer.from_pretrained))


def pipeline_from_parts(folder: Path):
    """QwenImage21Pipeline of a folder's components with load_processor's processor: for a folder whose processor is
    a tokenizer, which from_pretrained cannot put in a QwenImage21Pipeline (its __init__ asks a processor)."""
    with quiet_hf_libraries():
        from diffusers import (
            AutoencoderKLQwenImage21,
            FlowMatchEulerDiscreteScheduler,
            QwenImage21Pipeline,
            QwenImage21Transformer2DModel,
        )
        from transformers import Qwen3VLForConditionalGeneration

        pipeline = QwenImage21Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler"),
            vae=AutoencoderKLQwenImage21.from_pretrained(folder, subfolder="vae"),
            text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(folder, subfolder="text_encoder"),
            processor=load_processor(folder),
            transformer=QwenImage21Transformer2DModel.from_pretrained(folder, subfolder="transformer"),
            sample_sigmas=read_model_index(folder).get("sample_sigmas"),
        )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _load_text_side(folder: Path, recipe, device, dtype) -> tuple[dict, dict]:
    from transformers import Qwen3VLForConditionalGeneration

    encoder = load_component(folder, "text_encoder", Qwen3VLForConditionalGeneration.from_pretrained)
    encoder = encoder.to(device, dtype).eval().requires_grad_(False)
    return {"text_encoder": encoder}, {"processor": load_processor(folder)}


def _mismatches(folder: Path) -> list[str]:
    transformer, vae = read_config(folder, "transformer"), read_config(folder, "vae")
    text = read_config(folder, "text_encoder")
    width = (text.get("text_config") or {}).get("hidden_size", text.get("hidden_size"))
    checks = [
        ("in_channels", vae.get("z_dim", 64)),
        ("out_channels", vae.get("z_dim", 64)),
        ("context_in_dim", width),
        ("patch_size", 1),
    ]
    return [
        f"transformer {key} {transformer.get(key)} != {want} (from the VAE / text encoder configs; 2.1 reads "
        "latents unpatched)"
        for key, want in checks
        if transformer.get(key) != want
    ]


def _captions(pipeline, built, captions: list[str]) -> dict:
    limit = built.max_sequence_length
    with torch.no_grad(), quiet_hf_libraries():
        embeds, mask, _ = pipeline.encode_prompt(list(captions), device=built.device)
    if mask is None:  # the pipeline drops a mask of all ones
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    for caption, tokens in zip(captions, mask.sum(dim=1).tolist()):
        if tokens > limit:
            raise FamilyError(
                f"the caption {caption[:80]!r}{'...' if len(caption) > 80 else ''} is {tokens} tokens "
                f"in Qwen-Image 2.1's prompt template, more than model.max_sequence_length {limit} "
                "(every caption is padded to it): raise model.max_sequence_length or shorten the "
                "caption"
            )
    padding = limit - embeds.shape[1]
    embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], padding, embeds.shape[2])], dim=1)
    mask = torch.cat([mask.long(), mask.new_zeros(mask.shape[0], padding).long()], dim=1)
    return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}


def _predict(built, forward, noisy, timesteps, text: dict, dtype) -> torch.Tensor:
    batch, channels, height, width = noisy.shape
    mask = text["encoder_attention_mask"]
    length = int(mask.sum(dim=1).max())  # the batch's longest caption, as the example pads a batch
    embeds, mask = text["encoder_hidden_states"][:, :length], mask[:, :length]
    image_slots = (height * width) // 4
    img_mask = torch.cat(
        [
            torch.zeros(batch, length, dtype=torch.bool, device=noisy.device),
            torch.ones(batch, image_slots, dtype=torch.bool, device=noisy.device),
        ],
        dim=1,
    )
    tokens = noisy.reshape(batch, channels, height * width).transpose(1, 2)
    prediction = forward(
        hidden_states=tokens.to(dtype),
        encoder_hidden_states=embeds,
        encoder_hidden_states_mask=None if bool(mask.all()) else mask,
        timestep=(timesteps / 1000).to(dtype),
        img_shapes=[[(1, height, width)]] * batch,
        img_mask=img_mask,
        return_dict=False,
    )[0]
    return prediction[:, -height * width :].transpose(1, 2).reshape(batch, channels, height, width)


def sample_grid(built) -> list | None:
    """The folder's own sampling sigmas (a Turbo folder's), or None."""
    return built.model_index.get("sample_sigmas")


def _sampling_pipeline(built, transformer):
    """QwenImage21Pipeline with the folder's sample_sigmas (pipeline_of builds it from parts, not from the folder)."""
    with quiet_hf_libraries():
        from diffusers import QwenImage21Pipeline
    return QwenImage21Pipeline, {"sample_sigmas": sample_grid(built)}


def _guidance(built, sample_spec, prompts: list[str]) -> dict:
    """Unguided by default (true_cfg_scale 1, the pipeline's and the example's); sample.guidance > 1 is true
    classifier-free guidance against an empty negative prompt. A Turbo folder samples its own grid."""
    grid = sample_grid(built)
    if grid is not None and sample_spec.steps != len(grid):
        raise FamilyError(
            f"sample.steps {sample_spec.steps}: {built.folder / 'model_index.json'} samples on its "
            f"own {len(grid)} sigmas (sample_sigmas, a Turbo folder); set sample.steps: {len(grid)}"
        )
    if sample_spec.guidance <= 1.0:
        return {"true_cfg_scale": 1.0}
    return {"true_cfg_scale": sample_spec.guidance, "negative_prompt": [NEGATIVE] * len(prompts)}


NEGATIVE = " "  # the negative prompt of true classifier-free guidance, as the model card samples

QWEN_IMAGE_21 = FlowRecipe(
    kind="qwen_image_21",
    transformer_class="QwenImage21Transformer2DModel",
    pipeline_class="QwenImage21Pipeline",
    components={"text_encoder": "Qwen3VLForConditionalGeneration", "processor": None},
    text=TextSide(
        TEXT_TENSORS,
        _captions,
        lambda built: built.max_sequence_length,
        DEFAULT_TEXT_TOKENS,
        load=_load_text_side,
        load_tokenizers=lambda folder, recipe: {"processor": load_processor(folder)},
    ),
    predict=_predict,
    config_mismatches=_mismatches,
    latents=LatentSpace(vae_class="AutoencoderKLQwenImage21", patch=fixed_patch(2)),
    sampling=Sampling(
        options=_guidance,
        pipeline=_sampling_pipeline,
        takes_max_sequence_length=False,
        cached_text=embeds_and_mask,
        negative_caption=NEGATIVE,
    ),
)
