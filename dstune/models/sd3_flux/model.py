"""The training steps of SD3-class and Flux-class models (their cards: dstune.models.sd3_flux.card), as diffusers'
examples/dreambooth/train_dreambooth_sd3.py and train_dreambooth_flux.py feed them:
    SD3   prompt embeds: both CLIPs' penultimate hidden states side by side, zero-padded to the T5 width, then T5's
          along the sequence; pooled: both CLIP projections side by side; a 16-channel VAE with shift_factor and
          scaling_factor.
    Flux  T5's embeds and CLIP's pooled vector; latents packed 2x2 into tokens, with img_ids / txt_ids positions and
          a guidance embedding when the transformer has guidance_embeds.

FLUX.1 Kontext (an edit model on Flux.1's transformer), as diffusers' train_dreambooth_lora_flux_kontext.py feeds
it: Flux's text; the target's and the source's latents both from the VAE posterior's mode (the script's
--vae_encode_mode default), both shifted and scaled; the sequence is [target tokens | source tokens] with the
source's img_ids those of its own grid with the first axis set to 1; only the target tokens of the output are the
prediction. The source image is resized and cropped to the target's size by the dataset (dstune.data).
"""

from __future__ import annotations

import torch

from dstune.families.flow_matching import image_ids, pack_latents, unpack_latents
from dstune.families.flow_edit import edit_sample_sources, source_latents
from dstune.families.samples import sized_as_trained
from dstune.families.flow_model import FlowModel, normalised_latents
from dstune.hf import quiet_hf_libraries
from dstune.models.sd3_flux.card import CLIP_TOKENS


class SD3(FlowModel):
    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        with torch.no_grad(), quiet_hf_libraries():
            embeds, _, pooled, _ = self.pipeline().encode_prompt(
                captions,
                captions,
                captions,
                device=self.device,
                do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
            )
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def text_tokens(self) -> int:
        return CLIP_TOKENS + self.max_sequence_length

    def latent_patch(self) -> tuple[int, int]:
        return 1, 1  # the transformer patchifies the latents itself

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        return forward(
            hidden_states=noisy.to(dtype),
            timestep=timesteps,
            encoder_hidden_states=conditions["encoder_hidden_states"],
            pooled_projections=conditions["pooled_projections"],
            return_dict=False,
        )[0]


def flux_text(model: FlowModel, captions: list[str]) -> dict[str, torch.Tensor]:
    """T5's embeds and CLIP's pooled vector through the pipeline's encode_prompt (Flux.1 and Kontext)."""
    with torch.no_grad(), quiet_hf_libraries():
        embeds, pooled, _ = model.pipeline().encode_prompt(
            captions, captions, device=model.device, max_sequence_length=model.max_sequence_length
        )
    return {"encoder_hidden_states": embeds, "pooled_projections": pooled}


def flux_guidance(model: FlowModel, batch: int, device, dtype) -> torch.Tensor | None:
    """model.guidance for every sample when the transformer has a guidance embedding (dev), else None (schnell)."""
    if not model.transformer_config.get("guidance_embeds", False):
        return None
    return torch.full((batch,), float(model.model_spec.guidance), device=device, dtype=dtype)


class Flux(FlowModel):
    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        return flux_text(self, captions)

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        batch, _, height, width = noisy.shape
        embeds = conditions["encoder_hidden_states"]
        prediction = forward(
            hidden_states=pack_latents(noisy).to(dtype),
            timestep=(timesteps / 1000).to(dtype),
            guidance=flux_guidance(self, batch, noisy.device, dtype),
            pooled_projections=conditions["pooled_projections"],
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=dtype),
            img_ids=image_ids(height, width, dtype, noisy.device),
            return_dict=False,
        )[0]
        return unpack_latents(prediction, height, width)


class FluxKontext(FlowModel):
    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        return flux_text(self, captions)

    def encode_conditions(self, batch: dict, dtype) -> dict:
        """The source images' posterior mode (cached, or encoded now), unscaled (B, C, h, w)."""
        return {"control_latent": source_latents(self, batch)[1]}

    def model_conditions(self, encoded: dict, dtype) -> dict:
        """The source's latents, shifted and scaled like the target's (no noise: it is the condition)."""
        return {"control_latents": normalised_latents(self.vae.config, encoded["control_latent"]).to(dtype)}

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        batch, _, height, width = noisy.shape
        source, embeds = conditions["control_latents"], conditions["encoder_hidden_states"]
        source_ids = image_ids(source.shape[-2], source.shape[-1], dtype, noisy.device)
        source_ids[:, 0] = 1  # the source's tokens: its own grid, told apart from the target's by the first axis
        prediction = forward(
            hidden_states=torch.cat([pack_latents(noisy), pack_latents(source)], dim=1).to(dtype),
            timestep=(timesteps / 1000).to(dtype),
            guidance=flux_guidance(self, batch, noisy.device, dtype),
            pooled_projections=conditions["pooled_projections"],
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=dtype),
            img_ids=torch.cat([image_ids(height, width, dtype, noisy.device), source_ids]),
            return_dict=False,
        )[0]
        target_tokens = (height // 2) * (width // 2)
        return unpack_latents(prediction[:, :target_tokens], height, width)

    def sample_sources(self, sample_spec, prompts: list[str]) -> list:
        """sample.control_images as RGB images."""
        return edit_sample_sources(sample_spec)

    def sample_inputs(self, text_pipeline, prompt: str, source, sample_spec, side: int) -> dict:
        """The source sized as training sized it beside a target of the sample's size (the pipeline's own
        auto-resize, to about 1 MP, is off: sample_arguments)."""
        return {"prompt": prompt, "image": sized_as_trained([source], side)[0]}

    def sample_arguments(self, pipeline, sample_spec, arguments: dict) -> dict:
        """The sample's area is the training resolution's (FluxKontextPipeline would rescale height x width to its
        max_area, 1 MP by default), and so is its source's: the pipeline's auto-resize (to its preferred resolution
        of about 1 MP) is off, so the source keeps the size training gave it beside its target."""
        return {**arguments, "max_area": arguments["height"] * arguments["width"], "_auto_resize": False}
