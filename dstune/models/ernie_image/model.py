"""ERNIE-Image's training step (its card: dstune.models.ernie_image.card), ErnieImageTransformer2DModel fed as
ErnieImagePipeline feeds it and as kohya-ss/musubi-tuner's ernie_image_train_network.py trains it:
- text: ErnieImagePipeline.encode_prompt (the Mistral3 text encoder's second-to-last hidden states of the caption,
  one tensor per caption of its own length), padded with zeros to model.max_sequence_length so that a caption's
  tensors have one shape (the text cache), with the mask of its tokens; the transformer is given the mask's sum as
  text_lens, so the padding is never attended and the image tokens' positions are those of the unpadded caption;
- latents: the AutoencoderKLFlux2 posterior's mode, patchified 2x2 with the pipeline's _patchify_latents and
  normalised with the VAE's batch-norm running statistics and eps 1e-5, exactly what the pipeline's decode undoes
  (its constant, not vae.config.batch_norm_eps: the released config's 1e-4 is not the trained value): the model
  space is (B, 4C, H/2, W/2), where noise, x_t and the target live;
- the transformer takes those latents as they are (patch_size 1), the timestep as the scheduler's (sigma x 1000,
  as the pipeline passes it) and predicts noise - x0, the flow core's target.
"""

from __future__ import annotations

import torch

from dstune.families.base import FamilyError
from dstune.families.flow_model import FlowModel
from dstune.hf import quiet_hf_libraries

BATCH_NORM_EPS = 1e-5  # ErnieImagePipeline's decode: bn_std = sqrt(running_var + 1e-5)


def _pipeline_class():
    with quiet_hf_libraries():
        from diffusers import ErnieImagePipeline
    return ErnieImagePipeline


class ErnieImage(FlowModel):
    def _caption_tokens(self, pipeline, caption: str) -> int:
        """A caption's tokens as encode_prompt tokenizes it (special tokens added; an empty caption is one)."""
        return max(1, len(pipeline.tokenizer(caption, add_special_tokens=True, truncation=True)["input_ids"]))

    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        """encode_prompt's per-caption hidden states, zero-padded to max_sequence_length, and their tokens' mask."""
        pipeline, limit = self.pipeline(), self.max_sequence_length
        for caption in captions:  # the pipeline has no length limit; the text cache needs one shape per caption
            tokens = self._caption_tokens(pipeline, caption)
            if tokens > limit:
                raise FamilyError(
                    f"the caption {caption[:80]!r}{'...' if len(caption) > 80 else ''} is {tokens} tokens, more than "
                    f"model.max_sequence_length {limit} (every caption is padded to it): raise "
                    "model.max_sequence_length or shorten the caption"
                )
        with torch.no_grad(), quiet_hf_libraries():
            hiddens = pipeline.encode_prompt(list(captions), device=self.device)
        embeds = hiddens[0].new_zeros(len(hiddens), limit, hiddens[0].shape[-1])
        mask = torch.zeros(len(hiddens), limit, dtype=torch.long, device=embeds.device)
        for row, hidden in enumerate(hiddens):
            embeds[row, : hidden.shape[0]] = hidden
            mask[row, : hidden.shape[0]] = 1
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}

    def to_model_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) posterior mode -> patchified, batch-norm-normalised (B, 4C, H/2, W/2)."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(sample.device, sample.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + BATCH_NORM_EPS).to(sample.device, sample.dtype)
        return (_pipeline_class()._patchify_latents(sample) - mean) / std

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        """The transformer on the model-space latents; text_lens from the mask, so padded text is not attended."""
        return forward(
            hidden_states=noisy.to(dtype),
            timestep=timesteps.to(dtype),
            text_bth=conditions["encoder_hidden_states"],
            text_lens=conditions["encoder_attention_mask"].sum(dim=1),
            return_dict=False,
        )[0]

    def sample_arguments(self, pipeline, sample_spec, arguments: dict) -> dict:
        """ErnieImagePipeline's __call__ takes no max_sequence_length (it encodes each prompt unpadded)."""
        return {key: value for key, value in arguments.items() if key != "max_sequence_length"}
