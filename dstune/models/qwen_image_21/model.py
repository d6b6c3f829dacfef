"""Qwen-Image 2.1's training step (its card: dstune.models.qwen_image_21.card), as diffusers'
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
be its length, which its card checks).

The pipeline's `processor` is a Qwen3VLProcessor; transformers cannot build one without torchvision, so a folder
whose `processor` is a plain tokenizer (builtin:tiny-qwen-image-21) gets TextProcessor around it, which does what
the text-to-image pipeline asks of a processor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component
from dstune.families.flow_model import FlowModel
from dstune.families.folders import read_model_index
from dstune.hf import quiet_hf_libraries


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


class QwenImage21(FlowModel):
    def load_text_encoders(self) -> tuple[dict, dict]:
        from transformers import Qwen3VLForConditionalGeneration

        encoder = load_component(self.folder, "text_encoder", Qwen3VLForConditionalGeneration.from_pretrained)
        return {"text_encoder": self.place_text(encoder, self.frozen_dtype)}, self.load_tokenizers()

    def load_tokenizers(self) -> dict:
        return {"processor": load_processor(self.folder)}

    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        limit = self.max_sequence_length
        with torch.no_grad(), quiet_hf_libraries():
            embeds, mask, _ = self.pipeline().encode_prompt(list(captions), device=self.device)
        if mask is None:  # the pipeline drops a mask of all ones
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        for caption, tokens in zip(captions, mask.sum(dim=1).tolist()):
            if tokens > limit:
                raise FamilyError(
                    f"the caption {caption[:80]!r}{'...' if len(caption) > 80 else ''} is {tokens} tokens in "
                    f"{self.card.name}'s prompt template, more than model.max_sequence_length {limit} (every caption "
                    "is padded to it): raise model.max_sequence_length or shorten the caption"
                )
        padding = limit - embeds.shape[1]
        embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], padding, embeds.shape[2])], dim=1)
        mask = torch.cat([mask.long(), mask.new_zeros(mask.shape[0], padding).long()], dim=1)
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        batch, channels, height, width = noisy.shape
        mask = conditions["encoder_attention_mask"]
        length = int(mask.sum(dim=1).max())  # the batch's longest caption, as the example pads a batch
        embeds, mask = conditions["encoder_hidden_states"][:, :length], mask[:, :length]
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

    def sample_grid(self) -> list | None:
        """The folder's own sampling sigmas (a Turbo folder's), or None."""
        return self.model_index.get("sample_sigmas")

    def pipeline_class_and_parts(self, transformer) -> tuple[type, dict]:
        """QwenImage21Pipeline with the folder's sample_sigmas (the pipeline is built from parts, not the folder)."""
        with quiet_hf_libraries():
            from diffusers import QwenImage21Pipeline
        return QwenImage21Pipeline, {"sample_sigmas": self.sample_grid()}

    def sample_guidance(self, sample_spec, prompts: list[str]) -> dict:
        """Unguided by default (true_cfg_scale 1, the pipeline's and the example's); sample.guidance > 1 is true
        classifier-free guidance against the card's negative prompt. A Turbo folder samples its own grid."""
        grid = self.sample_grid()
        if grid is not None and sample_spec.steps != len(grid):
            raise FamilyError(
                f"sample.steps {sample_spec.steps}: {self.folder / 'model_index.json'} samples on its own {len(grid)} "
                f"sigmas (sample_sigmas, a Turbo folder); set sample.steps: {len(grid)}"
            )
        if sample_spec.guidance <= 1.0:
            return {"true_cfg_scale": 1.0}
        return {
            "true_cfg_scale": sample_spec.guidance,
            "negative_prompt": [self.card.negative_caption()] * len(prompts),
        }

    def sample_arguments(self, pipeline, sample_spec, arguments: dict) -> dict:
        """QwenImage21Pipeline's __call__ takes no max_sequence_length."""
        return {key: value for key, value in arguments.items() if key != "max_sequence_length"}
