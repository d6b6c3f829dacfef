"""The training step of FLUX.2 [klein] and [dev] (their cards: dstune.models.flux2.card), as diffusers'
examples/dreambooth/train_dreambooth_lora_flux2_klein.py feeds Flux2Transformer2DModel:
- text: the pipeline's encode_prompt ([klein]: Qwen3's hidden states of layers 9, 18 and 27 of the chat-templated
  caption; [dev]: Mistral3's of layers 10, 20 and 30 under FLUX.2's system message; padded to max_sequence_length by
  the tokenizer, stacked side by side), one shape per caption; the 4-axis text position ids come from the
  pipeline's _prepare_text_ids;
- latents: the AutoencoderKLFlux2 posterior's mode (the example's latent_dist.mode()), patchified 2x2 into 4x the
  channels and normalised with the VAE's batch-norm running mean and std: the model space is (B, 4C, H/2, W/2),
  where noise, x_t and the target live;
- the transformer sees those latents flattened into tokens with 4-axis position ids, timestep / 1000, and a
  guidance value when it has a guidance embedding; its output is unpacked with the same ids.

Image-to-image (a reference per target, data.control_dir), as examples/dreambooth/train_dreambooth_lora_flux2_img2img.py
feeds it: the reference's posterior mode patchified and normalised like the target's; its tokens after the noisy
target's, with the ids the pipeline gives its first reference image (_prepare_image_ids: time coordinate 10, its own
grid); only the target's tokens of the output are the prediction.
"""

from __future__ import annotations

from typing import Optional

import torch

from dstune.families.flow_edit import edit_sample_sources, source_latents
from dstune.families.flow_model import FlowModel
from dstune.hf import quiet_hf_libraries


def _pipeline_class():
    """Klein's and dev's pipelines share these static helpers (_patchify_latents, _pack_latents, ids)."""
    with quiet_hf_libraries():
        from diffusers import Flux2KleinPipeline
    return Flux2KleinPipeline


class Flux2(FlowModel):
    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        with torch.no_grad(), quiet_hf_libraries():
            embeds, _ = self.pipeline().encode_prompt(
                list(captions), device=self.device, max_sequence_length=self.max_sequence_length
            )
        return {"encoder_hidden_states": embeds}

    def to_model_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) posterior mode -> patchified, batch-norm-normalised (B, 4C, H/2, W/2)."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(sample.device, sample.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(
            sample.device, sample.dtype
        )
        return (_pipeline_class()._patchify_latents(sample) - mean) / std

    def encode_conditions(self, batch: dict, dtype) -> dict:
        """Image-to-image: the references' posterior mode (cached, or encoded now); nothing for text-to-image."""
        if "control_values" not in batch:
            return {}
        return {"control_latent": source_latents(self, batch)[1]}

    def model_conditions(self, encoded: dict, dtype) -> dict:
        """The references in the target's model space (patchified, batch-norm normalised; no noise)."""
        if "control_latent" not in encoded:
            return {}
        return {"control_latents": self.to_model_latents(encoded["control_latent"]).to(dtype)}

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        pipeline = _pipeline_class()
        embeds = conditions["encoder_hidden_states"]
        latent_ids = pipeline._prepare_latent_ids(noisy).to(noisy.device)
        packed = pipeline._pack_latents(noisy).to(dtype)
        ids = latent_ids
        if "control_latents" in conditions:  # [target tokens | reference tokens], the reference at time 10
            reference = conditions["control_latents"]
            reference_ids = pipeline._prepare_image_ids([reference[:1]]).expand(len(reference), -1, -1)
            ids = torch.cat([latent_ids, reference_ids.to(latent_ids)], dim=1)
            packed = torch.cat([packed, pipeline._pack_latents(reference).to(dtype)], dim=1)
        guidance = None
        if self.transformer_config.get("guidance_embeds", False):
            guidance = torch.full((noisy.shape[0],), float(self.model_spec.guidance), device=noisy.device, dtype=dtype)
        prediction = forward(
            hidden_states=packed,
            timestep=(timesteps / 1000).to(dtype),
            guidance=guidance,
            encoder_hidden_states=embeds,
            txt_ids=pipeline._prepare_text_ids(embeds).to(noisy.device),
            img_ids=ids,
            return_dict=False,
        )[0]
        return pipeline._unpack_latents_with_ids(prediction[:, : latent_ids.shape[1]], latent_ids)

    def sample_sources(self, sample_spec, prompts: list[str]) -> Optional[list]:
        """Image-to-image: sample.control_images, one reference per prompt (Flux2Pipeline's `image`); else None."""
        return edit_sample_sources(sample_spec) if sample_spec.control_images else None
