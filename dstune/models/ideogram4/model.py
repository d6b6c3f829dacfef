"""Ideogram 4's training step (its card: dstune.models.ideogram4.card), as diffusers'
examples/dreambooth/train_dreambooth_lora_ideogram4.py feeds Ideogram4Transformer2DModel:

- text: Ideogram4Pipeline.encode_prompt (the caption in the Qwen3-VL chat format, left-padded to
  max_sequence_length, the hidden states of 13 text layers concatenated per token, padding zeroed), encoded for an
  empty image grid so that a caption's tensors have one shape (the text cache); the mask marks its tokens, and the
  position, segment and indicator ids are rebuilt from it for each batch's grid with the pipeline's _prepare_ids;
- latents: the AutoencoderKLFlux2 posterior's mode, cut into 2x2 patches in the example's channel order (row,
  column, then VAE channel) and normalised with the VAE's batch-norm statistics: the model space is
  (B, 4C, H/2, W/2), where noise, x_t and the target live;
- sigma is drawn continuously (no scheduler table): logit-normal with the mean shifted by half the log of the
  image's pixels over 512^2 and a standard deviation of 1.5 unless the spec sets them;
- the transformer sees [zeros over the text positions | the noisy image tokens], the text features over
  [text | zeros], the model time 1 - sigma, and predicts x0 - noise, the negative velocity: predict negates it.

Samples render with Ideogram4Pipeline, whose asymmetric guidance needs the folder's frozen
`unconditional_transformer`: it is loaded only while samples render.
"""

from __future__ import annotations

import math

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component
from dstune.families.flow_matching import timestep_density
from dstune.families.flow_model import FlowModel, vae_spatial_factor
from dstune.hf import quiet_hf_libraries

LOGIT_STD = 1.5  # the example's --logit_std default (the pipeline's schedule std)
BASE_PIXELS = 512 * 512  # the resolution the example's logit mean is given for


def _pipeline_class():
    with quiet_hf_libraries():
        from diffusers import Ideogram4Pipeline
    return Ideogram4Pipeline


class Ideogram4(FlowModel):
    def _caption_tokens(self, pipeline, caption: str) -> int:
        messages = [{"role": "user", "content": [{"type": "text", "text": caption}]}]
        text = pipeline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(pipeline.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR

        pipeline, limit = self.pipeline(), self.max_sequence_length
        for caption in captions:  # the pipeline's own refusal names neither the caption nor the setting
            tokens = self._caption_tokens(pipeline, caption)
            if tokens > limit:
                raise FamilyError(
                    f"the caption {caption[:80]!r}{'...' if len(caption) > 80 else ''} is {tokens} tokens in "
                    f"Ideogram 4's chat format, more than model.max_sequence_length {limit} (every caption is "
                    "left-padded to it): raise model.max_sequence_length (the training example uses 2048) or shorten "
                    "the caption"
                )
        with torch.no_grad(), quiet_hf_libraries():
            embeds, _, _, indicator = pipeline.encode_prompt(
                list(captions), grid_h=0, grid_w=0, device=self.device, max_sequence_length=limit
            )
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": (indicator == LLM_TOKEN_INDICATOR).long()}

    def to_model_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) posterior mode -> (B, 4C, H/2, W/2): each 2x2 patch in the example's (row, column, channel)
        order as a token's features, normalised per channel with the VAE's batch-norm statistics."""
        batch, channels, height, width = sample.shape
        patches = sample.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 3, 5, 1, 2, 4)
        patches = patches.reshape(batch, 4 * channels, height // 2, width // 2)
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(sample.device, sample.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(
            sample.device, sample.dtype
        )
        return (patches - mean) / std

    def sigma_draw(self, latents: torch.Tensor, seed: int, step: int, indices: list[int]) -> torch.Tensor:
        """The example's sigma: u from compute_density_for_timestep_sampling, sigma = u (no shift); logit_normal
        about logit_mean + 0.5 log(pixels / 512^2) (the pipeline's resolution-aware mean) with logit_std 1.5 unless
        set; uniform and mode as in the other examples."""
        settings = self.model_spec
        pixels = (latents.shape[-2] * latents.shape[-1]) * (2 * vae_spatial_factor(self.vae.config)) ** 2
        mean = (settings.logit_mean or 0.0) + 0.5 * math.log(pixels / BASE_PIXELS)
        std = LOGIT_STD if settings.logit_std is None else settings.logit_std
        return timestep_density(settings.model_copy(update={"logit_mean": mean, "logit_std": std}), seed, step, indices)

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        batch, features, rows, columns = noisy.shape
        embeds, mask = conditions["encoder_hidden_states"], conditions["encoder_attention_mask"]
        length, images = embeds.shape[1], rows * columns
        position_ids, segment_ids, indicator = _pipeline_class()._prepare_ids(
            mask.sum(dim=1).tolist(), rows, columns, length, noisy.device
        )
        tokens = noisy.permute(0, 2, 3, 1).reshape(batch, images, features)
        hidden = torch.cat([tokens.new_zeros(batch, length, features), tokens], dim=1).to(dtype)
        text_features = torch.cat([embeds, embeds.new_zeros(batch, images, embeds.shape[-1])], dim=1).to(dtype)
        prediction = forward(
            hidden_states=hidden,
            timestep=(1.0 - timesteps / 1000).to(dtype),
            encoder_hidden_states=text_features,
            position_ids=position_ids,
            segment_ids=segment_ids,
            indicator=indicator,
            return_dict=False,
        )[0]
        velocity = -prediction[:, length:]  # the model predicts x0 - noise
        return velocity.reshape(batch, rows, columns, features).permute(0, 3, 1, 2)

    def pipeline_class_and_parts(self, transformer) -> tuple[type, dict]:
        """Ideogram4Pipeline with the folder's frozen unconditional transformer, loaded only while samples render (a
        text-only pipeline, no transformer, goes without it)."""
        cls = _pipeline_class()
        if transformer is None:
            return cls, {"unconditional_transformer": None}
        with quiet_hf_libraries():
            from diffusers import Ideogram4Transformer2DModel

            unconditional = load_component(
                self.folder,
                "unconditional_transformer",
                Ideogram4Transformer2DModel.from_pretrained,
                torch_dtype=self.frozen_dtype,
            )
        return cls, {"unconditional_transformer": unconditional.to(self.device).eval().requires_grad_(False)}

    def sample_guidance(self, sample_spec, prompts: list[str]) -> dict:
        return {"guidance_scale": sample_spec.guidance, "guidance_schedule": None}
