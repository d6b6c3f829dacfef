"""The training steps of Qwen-Image and Qwen-Image-Edit (their cards: dstune.models.qwen_image.card).

Qwen-Image, as diffusers' examples/dreambooth/train_dreambooth_lora_qwen_image.py feeds QwenImageTransformer2DModel:
- text: QwenImagePipeline.encode_prompt (the Qwen2.5-VL text encoder's last hidden states under the pipeline's
  prompt template, the template's first tokens dropped), zero-padded to model.max_sequence_length with an attention
  mask of ones over the caption's tokens, so every caption's tensors have one shape (the text cache);
- latents: AutoencoderKLQwenImage's one-frame posterior (B, C, 1, H, W), normalised per channel with the VAE's
  latents_mean / latents_std;
- the transformer sees the latents packed 2x2 into tokens with img_shapes [(1, H/2, W/2)] per sample, the prompt
  embeds with their mask, and timestep / 1000; its output is unpacked back to (B, C, H, W).

Qwen-Image-Edit: a target image trained from a source (control) image and an instruction, fed as diffusers'
QwenImageEditPipeline feeds it:
- text: QwenImageEditPipeline.encode_prompt with the source image: the instruction under the pipeline's edit
  template, the image put into it as Qwen2.5-VL vision tokens by the folder's Qwen2VLProcessor, the last hidden
  states with the template's first 64 tokens dropped, padded to the batch's longest with a mask. The length depends
  on the image, so there is no fixed text length and no text cache (its card refuses it);
- control latents: the source's VAE posterior mode (as the pipeline's `_encode_vae_image`), normalised per channel
  like the target's; the source is resized and cropped to the target's size by the dataset (dstune.data);
- the transformer sees [target tokens | control tokens] (both packed 2x2), img_shapes [(1, h/2, w/2), (1, h/2, w/2)]
  per sample and timestep / 1000; only the target tokens of its output are the prediction.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from dstune.families.base import FamilyError
from dstune.families.flow_matching import pack_latents, unpack_latents
from dstune.spec.data_sections import reference_key
from dstune.families.flow_edit import edit_sample_references, edit_sample_sources, reference_latents, source_latents
from dstune.families.flow_model import FlowModel, normalised_latents
from dstune.hf import quiet_hf_libraries
from dstune.models.qwen_image.card import CONDITION_PX


class QwenImage(FlowModel):
    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        with torch.no_grad(), quiet_hf_libraries():
            embeds, mask = self.pipeline().encode_prompt(
                captions, device=self.device, max_sequence_length=self.max_sequence_length
            )
        if mask is None:  # the pipeline drops a mask of all ones
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        padding = self.max_sequence_length - embeds.shape[1]
        embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], padding, embeds.shape[2])], dim=1)
        mask = torch.cat([mask, mask.new_zeros(mask.shape[0], padding)], dim=1)
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        batch, _, height, width = noisy.shape
        prediction = forward(
            hidden_states=pack_latents(noisy).to(dtype),
            encoder_hidden_states=conditions["encoder_hidden_states"],
            encoder_hidden_states_mask=conditions["encoder_attention_mask"],
            timestep=(timesteps / 1000).to(dtype),
            img_shapes=[(1, height // 2, width // 2)] * batch,
            return_dict=False,
        )[0]
        return unpack_latents(prediction, height, width)

    def sample_guidance(self, sample_spec, prompts: list[str]) -> dict:
        """No guidance embedding: sample.guidance > 1 is true classifier-free guidance against the card's negative
        prompt (QwenImagePipeline's true_cfg_scale), as its model card samples."""
        if sample_spec.guidance <= 1.0:
            return {"true_cfg_scale": 1.0}
        negative = self.card.negative_caption()
        return {"true_cfg_scale": sample_spec.guidance, "negative_prompt": [negative] * len(prompts)}


# ------------------------------------------------------------------------------------------------ the edit model


@lru_cache(maxsize=1)
def _image_only_processor_class():
    """Qwen2VLProcessor without its video processor. transformers 5 builds a Qwen2VLProcessor only when torchvision
    is installed (its video processor needs it, and the constructor checks every sub-processor's class even when it
    is None: transformers issues #43986, #48556); the edit pipeline only ever gives it images. This subclass leaves
    the video processor out of the processor's parts, which is all it changes."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageOnlyQwen2VLProcessor


def image_only_processor(image_processor, tokenizer):
    """A Qwen2VLProcessor of these parts that needs no video processor (nor torchvision)."""
    return _image_only_processor_class()(image_processor=image_processor, tokenizer=tokenizer)


def load_processor(folder: Path):
    """The folder's `processor` (a Qwen2VLProcessor): loaded as saved, or where transformers cannot build one (no
    torchvision) the same image processor and tokenizer in an image-only processor. FamilyError if neither loads."""
    import transformers

    path = Path(folder) / "processor"
    with quiet_hf_libraries():
        try:
            return transformers.Qwen2VLProcessor.from_pretrained(path)
        except (AttributeError, ImportError, OSError, TypeError, ValueError) as err:  # the torchvision gap, above
            first = err
        try:
            image_processor = transformers.Qwen2VLImageProcessor.from_pretrained(path)
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise FamilyError(
                f"{path}: cannot load the Qwen2VLProcessor ({first}), nor its image processor and tokenizer ({err}). "
                "A QwenImageEditPipeline folder needs processor/ as diffusers saves it."
            ) from None
        return image_only_processor(image_processor, tokenizer)


def control_images(pixels: torch.Tensor) -> list:
    """Control pixels (B, 3, H, W) in [-1, 1] -> the RGB PIL images they were made from (exact for 8-bit images),
    which is what the pipeline gives the processor."""
    from PIL import Image

    values = ((pixels.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(value.permute(1, 2, 0).numpy()) for value in values]


class QwenImageEdit(FlowModel):
    def load_parts(self) -> dict:
        return {"processor": load_processor(self.folder)}

    def encode_text(self, captions: list[str], controls: torch.Tensor = None, **inputs) -> dict[str, torch.Tensor]:
        with torch.no_grad(), quiet_hf_libraries():
            embeds, mask = self.pipeline().encode_prompt(
                list(captions), image=control_images(controls), device=self.device
            )
        if mask is None:  # the pipeline drops a mask of all ones
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}

    def text_tokens(self) -> None:
        return None  # the source image's vision tokens join the text: no fixed length

    def encode_conditions(self, batch: dict, dtype) -> dict:
        """The source images: the pixels (the text side reads them) and the posterior mode of their latents (cached,
        or encoded now), unscaled (B, C, h, w)."""
        pixels, mean = source_latents(self, batch)
        return {"control_values": pixels.float(), "control_latent": mean}

    def text_inputs(self, conditions: dict) -> dict:
        return {"controls": conditions["control_values"]}

    def model_conditions(self, encoded: dict, dtype) -> dict:
        """Each reference's latents, normalised like the target's (no noise: they are the condition)."""
        found, number = [], 0
        while reference_key("control_latent", number) in encoded:
            latent = encoded[reference_key("control_latent", number)]
            found.append(normalised_latents(self.vae.config, latent).to(dtype))
            number += 1
        return {"control_latents": found}

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        """[target tokens | reference 1's tokens | ...], img_shapes listing each picture; only the target's tokens of
        the output are the prediction."""
        batch, _, height, width = noisy.shape
        references = conditions["control_latents"]
        target_tokens = (height // 2) * (width // 2)
        shapes = [(1, height // 2, width // 2)] + [(1, one.shape[-2] // 2, one.shape[-1] // 2) for one in references]
        hidden = torch.cat([pack_latents(noisy)] + [pack_latents(one) for one in references], dim=1).to(dtype)
        prediction = forward(
            hidden_states=hidden,
            encoder_hidden_states=conditions["encoder_hidden_states"],
            encoder_hidden_states_mask=conditions["encoder_attention_mask"],
            timestep=(timesteps / 1000).to(dtype),
            img_shapes=[shapes] * batch,
            return_dict=False,
        )[0]
        return unpack_latents(prediction[:, :target_tokens], height, width)

    def sample_guidance(self, sample_spec, prompts: list[str]) -> dict:
        """As Qwen-Image (true classifier-free guidance against the negative prompt above 1), for the edit
        pipeline's one-prompt calls; the sources are sample.control_images."""
        if sample_spec.guidance <= 1.0:
            return {"true_cfg_scale": 1.0}
        return {"true_cfg_scale": sample_spec.guidance, "negative_prompt": self.card.negative_caption()}

    def sample_sources(self, sample_spec, prompts: list[str]) -> list:
        """sample.control_images as RGB images."""
        return edit_sample_sources(sample_spec)


# ------------------------------------------------------------------------------------------ the multi-image edit


def condition_image(image, pipeline):
    """A reference as QwenImageEditPlusPipeline gives it to the text encoder: resized to CONDITION_PX squared
    pixels at its own aspect ratio, sides multiples of 32 (the pipeline's calculate_dimensions)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    width, height = calculate_dimensions(CONDITION_PX * CONDITION_PX, image.width / image.height)
    return pipeline.image_processor.resize(image, height, width)


class QwenImageEditPlus(FlowModel):
    """Qwen-Image-Edit-2509 / 2511: QwenImageEdit with several references per sample (its processor, reference
    latents, token layout and guidance are QwenImageEdit's; the references and their text are its own)."""

    load_parts = QwenImageEdit.load_parts
    text_tokens = QwenImageEdit.text_tokens
    model_conditions = QwenImageEdit.model_conditions
    predict = QwenImageEdit.predict
    sample_guidance = QwenImageEdit.sample_guidance

    def encode_conditions(self, batch: dict, dtype) -> dict:
        """Each reference's pixels and the posterior mode of its latents (cached, or encoded now), unscaled, keyed
        as the batch keys them (control_values, control_values_2, ...)."""
        found = {}
        for number, (pixels, mean) in enumerate(reference_latents(self, batch)):
            found[reference_key("control_values", number)] = pixels.float()
            found[reference_key("control_latent", number)] = mean
        return found

    def text_inputs(self, conditions: dict) -> dict:
        count = sum(1 for name in conditions if name.startswith("control_values"))
        return {"controls": [conditions[reference_key("control_values", number)] for number in range(count)]}

    def encode_text(self, captions: list[str], controls: list = None, **inputs) -> dict[str, torch.Tensor]:
        """Each caption with its own references (the pipeline's encode_prompt takes one prompt's images), at the
        pipeline's condition size; padded to the batch's longest with a mask."""
        pipeline = self.pipeline()
        per_reference = [control_images(values) for values in controls]
        rows = []
        with torch.no_grad(), quiet_hf_libraries():
            for number, caption in enumerate(captions):
                images = [condition_image(images[number], pipeline) for images in per_reference]
                embeds, mask = pipeline.encode_prompt([caption], image=images, device=self.device)
                rows.append(embeds[0] if mask is None else embeds[0][mask[0].bool()])
        longest = max(row.shape[0] for row in rows)
        embeds = torch.stack([torch.cat([row, row.new_zeros(longest - row.shape[0], row.shape[1])]) for row in rows])
        mask = torch.stack([torch.arange(longest, device=embeds.device) < row.shape[0] for row in rows]).long()
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}

    def sample_sources(self, sample_spec, prompts: list[str]) -> list:
        """sample.control_images: each prompt's references as RGB images."""
        return edit_sample_references(sample_spec)
