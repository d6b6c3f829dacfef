"""HunyuanVideo 1.5's training step (its card: dstune.models.hunyuan_video15.card), as its official train.py trains it.
- latents: clips (B, 3, frames, H, W) in [-1, 1] through AutoencoderKLHunyuanVideo15 (16x spatial, 4x temporal, 32
  channels) times the VAE config's scaling_factor (as the pipeline divides by it before decoding); patch 1x1x1;
- text: HunyuanVideo15Pipeline.encode_prompt: Qwen2.5-VL's third hidden state from the end over the chat template,
  the template's first 108 tokens cropped, padded to max_sequence_length (the pipeline's 1000) with its mask; and
  the ByT5 glyph encoder over the quoted text of the caption (zeros and an empty mask when it quotes none), 256
  tokens: four tensors per caption, all of them cached by data.cache.text_embeddings;
- the transformer reads cat([x_t, condition latents, mask]) and a SigLIP image embedding: text-to-video gives zeros
  for all three, as HunyuanVideo15Pipeline does; image-to-video (HunyuanVideo15ImageToVideoPipeline folders) the
  first frame's (dstune.models.hunyuan_video15.i2v);
- tables: a FlowMatchEulerDiscreteScheduler with shift 3.0 (the official trainer's train_timestep_shift; the
  folder's scheduler shift, 5.0 to 9.0, is its sampling shift), model.shift replaces it;
- the loss is the official trainer's velocity loss (no preconditioning);
- samples: the folder's pipeline with its ClassifierFreeGuidance guider at sample.guidance.
Differences from the official trainer's loss are listed in docs/family-hunyuan-video15.md.
"""

from __future__ import annotations

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component
from dstune.families.flow_model import FlowModel
from dstune.hf import quiet_hf_libraries
from dstune.models.hunyuan_video15 import i2v
from dstune.models.hunyuan_video15 import split
from dstune.models.hunyuan_video15.card import TRAIN_SHIFT, VISION_TOKENS, is_image_to_video

# HunyuanVideo15Pipeline has no LoRA loader in diffusers 0.42: the file is written as HunyuanVideoPipeline's
# (HunyuanVideoLoraLoaderMixin: "transformer."-prefixed PEFT keys), which transformer.load_lora_adapter reads
LORA_PIPELINE = "HunyuanVideoPipeline"


class HunyuanVideo15(FlowModel):
    # ------------------------------------------------------------------------------------- loading

    def load_vae(self) -> torch.nn.Module:
        vae = super().load_vae()
        vae.enable_slicing()  # diffusers 0.42's VAE attention mask fits one clip: encode a batch clip by clip
        return vae

    def load_parts(self) -> dict:
        """The guider (samples) and, for an image-to-video folder, SigLIP with its image processor (frozen); the
        mode: whether the run trains image-to-video."""
        import transformers

        with quiet_hf_libraries():
            from diffusers import ClassifierFreeGuidance

            parts = {"guider": ClassifierFreeGuidance.from_pretrained(self.folder / "guider")}
        self.mode = is_image_to_video(self.model_index)
        if not self.mode:
            return parts
        loader = transformers.SiglipVisionModel.from_pretrained
        encoder = load_component(self.folder, "image_encoder", loader, torch_dtype=self.frozen_dtype)
        with quiet_hf_libraries():
            try:
                extractor = transformers.AutoImageProcessor.from_pretrained(self.folder / "feature_extractor")
            except (OSError, ValueError) as err:
                raise FamilyError(
                    f"{self.folder / 'feature_extractor'}: cannot load the SigLIP image processor ({err}); an "
                    "image-to-video folder needs feature_extractor/ as diffusers saves it."
                ) from None
        encoder = encoder.to(self.device).eval().requires_grad_(False)
        return {**parts, "image_encoder": encoder, "feature_extractor": extractor}

    def train_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A FlowMatchEulerDiscreteScheduler at model.shift (the official trainer's 3.0 when None), not the folder
        scheduler's sampling shift."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        shift = TRAIN_SHIFT if self.model_spec.shift is None else float(self.model_spec.shift)
        table = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=self.scheduler.config.num_train_timesteps, shift=shift
        )
        return table.timesteps.clone().float(), table.sigmas.clone().float()

    # ------------------------------------------------------------------------------------- the step

    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        """encode_prompt's caption and glyph states with their masks, the caption padded to max_sequence_length."""
        pipeline = self.pipeline()
        pipeline.tokenizer_max_length = self.max_sequence_length
        with torch.no_grad(), quiet_hf_libraries():
            tensors = pipeline.encode_prompt(list(captions), device=self.device, batch_size=len(captions))
        return dict(zip(self.card.text_tensors, tensors))

    def latent_patch(self) -> tuple[int, int]:
        return (self.transformer_config["patch_size"],) * 2

    def spatial_factor(self) -> int:
        return self.vae.config.spatial_compression_ratio

    def encode_conditions(self, batch: dict, dtype) -> dict:
        return i2v.encode_conditions(self, batch, dtype)

    def condition_tensors(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        return i2v.condition_tensors(self, pixels)

    def model_conditions(self, encoded: dict, dtype) -> dict:
        return i2v.model_inputs(self, encoded, dtype)

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        """The transformer on cat([x_t, condition latents, mask]) and an image embedding: the first frame's for
        image-to-video, zeros for text-to-video (as HunyuanVideo15Pipeline feeds them)."""
        batch, channels, frames, height, width = noisy.shape
        condition = conditions.get("condition_latents")
        if condition is None:
            condition = noisy.new_zeros(batch, channels + 1, frames, height, width)
        image_embeds = conditions.get("image_embeds")
        if image_embeds is None:
            image_embeds = noisy.new_zeros(batch, VISION_TOKENS, self.transformer_config["image_embed_dim"])
        return forward(
            hidden_states=torch.cat([noisy, condition.to(noisy.dtype)], dim=1).to(dtype),
            timestep=timesteps.to(dtype),
            encoder_hidden_states=conditions["encoder_hidden_states"].to(dtype),
            encoder_attention_mask=conditions["encoder_attention_mask"],
            encoder_hidden_states_2=conditions["encoder_hidden_states_2"].to(dtype),
            encoder_attention_mask_2=conditions["encoder_attention_mask_2"],
            image_embeds=image_embeds.to(dtype),
            return_dict=False,
        )[0]

    def own_split_plan(self, size: int) -> dict:
        """diffusers 0.42 gives the class no context-parallel plan: dstune's (dstune.models.hunyuan_video15.split)."""
        return split.prepare_split(self.trainable, size)

    def lora_pipeline_class(self) -> str:
        return LORA_PIPELINE

    # ------------------------------------------------------------------------------------- samples

    def pipeline_class_and_parts(self, transformer) -> tuple[type, dict]:
        """The folder's pipeline (text- or image-to-video) with its guider and, for image-to-video, SigLIP; the VAE
        always (its encode_prompt reads the VAE's config, even for the text-only pipeline)."""
        import diffusers

        return getattr(diffusers, self.model_index["_class_name"]), {**self.parts, "vae": self.vae}

    def sample_guidance(self, sample_spec, prompts: list[str]) -> dict:
        return {}  # the guider's (sample_arguments)

    def sample_arguments(self, pipeline, sample_spec, arguments: dict) -> dict:
        """The pipeline's text length is its tokenizer_max_length, the guidance its guider's (rebuilt at
        sample.guidance from the folder's guider). The image-to-video pipeline takes no size either: it renders at
        the transformer's target_size in the first frame's aspect ratio."""
        pipeline.tokenizer_max_length = self.max_sequence_length
        if sample_spec.guidance is not None:
            pipeline.guider = type(pipeline.guider).from_config(
                {**pipeline.guider.config, "guidance_scale": float(sample_spec.guidance)}
            )
        dropped = ("max_sequence_length", "guidance_scale") + (("height", "width") if self.mode else ())
        return {k: v for k, v in arguments.items() if k not in dropped}

    def side_multiple(self) -> int:
        return self.vae.config.spatial_compression_ratio * self.transformer_config["patch_size"]

    def sample_sources(self, sample_spec, prompts: list[str]):
        return i2v.sample_sources(self, sample_spec, prompts)
