"""Kandinsky 6's training step (its card: dstune.models.kandinsky6.card): text- and image-to-video with sound, as the
musubi-tuner fork that trains it does (AkaneTendo25/musubi-tuner, kandinsky6_train_network.py). Its loss is
`Kandinsky6.loss`, read top to bottom below.
- latents: clips (B, 3, frames, H, W) in [-1, 1] through AutoencoderKLHunyuanVideo (8x spatial, 4x temporal, 16
  channels), the posterior's mean times the VAE's scaling_factor (the pipeline divides by it before decoding); the
  transformer reads them (B, F, H, W, C) and patches them 1x2x2;
- text: the pipeline's _get_prompt_embeds: Qwen2.5-VL's last hidden state over its chat template, the template's
  first 129 tokens cropped, padded to max_sequence_length with its mask, and CLIP's pooled vector: three tensors per
  caption, all of them cached by data.cache.text_embeddings;
- sound: the clip's track at the audio VAE's rate (44.1 kHz) made mono, through MMAudioVAE's log-mel encoder, the
  posterior's mean times its scaling_factor, (B, T, C) for the transformer; a clip without sound carries the
  encoding of silence and adds nothing to the loss;
- sigma: u uniform in [0, 1), sigma = s u / (1 + (s - 1) u) with s = model.shift (the fork's --scheduler_scale, 1.0
  by default), timestep sigma x 1000; the sound draws its own u (the fork's independent_time, on by default) and
  the transformer's audio branch gets its own timestep (its audio_time_embeddings are fed the sound's);
- x_t = (1 - sigma) x0 + sigma noise for the video and the sound each, target noise - x0; the loss is the video's
  squared error averaged over the batch plus the sound's averaged over the clips that have sound;
- image-to-video (model.image_to_video: true): the clip's first latent frame, clean, appended after the noisy frames
  as the pipeline appends its reference image's latent (the mask channel 1 there, token type 1, the temporal RoPE
  position 0); the prediction is cut back to the clip's frames, all of which are in the loss;
- samples: the folder's Kandinsky6TI2VAPipeline, saved with the sound its vocoder renders.
Differences from the fork are listed in docs/family-kandinsky6.md.
"""

from __future__ import annotations

import contextlib

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component
from dstune.families.flow_model import FlowModel, noisy_at
from dstune.families.loss_terms import parted_loss
from dstune.families.precision import at_least_float32, compute_dtype
from dstune.families.randomness import per_sample_randn, sample_generator
from dstune.families.samples import ClipWithSound, first_frames
from dstune.hf import quiet_hf_libraries
from dstune.models.kandinsky6 import split
from dstune.models.kandinsky6.card import DEFAULT_FPS, DEFAULT_SHIFT, TEXT_TENSORS

# Kandinsky6TI2VAPipeline has no LoRA loader in diffusers 0.42: the file is written as Kandinsky 5's
# ("transformer."-prefixed PEFT keys), which Kandinsky6Transformer3DModel.load_lora_adapter reads
LORA_PIPELINE = "Kandinsky5T2VPipeline"


def shifted_sigma(uniform: torch.Tensor, shift: float) -> torch.Tensor:
    """The fork's rational shift of a uniform flow time: s u / (1 + (s - 1) u)."""
    return shift * uniform / (1.0 + (shift - 1.0) * uniform)


@contextlib.contextmanager
def audio_timestep(transformer: torch.nn.Module, timesteps: torch.Tensor):
    """While in the block, the transformer's audio branch embeds `timesteps` in place of the timestep its forward
    gets (which the video branch keeps): the fork's (video_time, audio_time) on diffusers' class, whose forward
    takes one."""
    module = transformer.audio_time_embeddings
    handle = module.register_forward_pre_hook(lambda _module, args: (timesteps.to(args[0].dtype),))
    try:
        yield
    finally:
        handle.remove()


def float32_front_end(audio_vae: torch.nn.Module) -> torch.nn.Module:
    """The audio VAE with its log-mel front end (the filter bank and window buffers) in float32: diffusers' front end
    computes the spectrum's magnitude in float32 and multiplies it by the filter bank, which a bf16 (or float64) VAE
    would hold in its own dtype and fail; the mel is cast to the VAE's dtype after it."""
    audio_vae.mel_converter.float()
    return audio_vae


class Kandinsky6(FlowModel):
    # ------------------------------------------------------------------------------------- loading

    def load_parts(self) -> dict:
        """The audio VAE and the vocoder (frozen; samples render with both); the mode: model.image_to_video."""
        with quiet_hf_libraries():
            from diffusers import MMAudioVAE, MMAudioVocoder

        self.mode = bool(self.model_spec.image_to_video)
        loaders = {"audio_vae": MMAudioVAE.from_pretrained, "vocoder": MMAudioVocoder.from_pretrained}
        # MMAudio's magnitude-preserving layers normalise in float32 and refuse float64 input: at most float32
        dtype = torch.float32 if self.frozen_dtype == torch.float64 else self.frozen_dtype
        parts = {name: load_component(self.folder, name, loader, torch_dtype=dtype) for name, loader in loaders.items()}
        parts = {name: part.to(self.device).eval().requires_grad_(False) for name, part in parts.items()}
        return {**parts, "audio_vae": float32_front_end(parts["audio_vae"])}

    @property
    def sound_rate(self) -> int:
        """The sample rate (Hz) the audio VAE takes: the dataset resamples each clip's sound track to it."""
        return self.parts["audio_vae"].config.sample_rate

    def latent_parts(self) -> tuple[str, ...]:
        return (*super().latent_parts(), "audio_vae")

    def shift(self) -> float:
        return DEFAULT_SHIFT if self.model_spec.shift is None else float(self.model_spec.shift)

    # ------------------------------------------------------------------------------------- encoding

    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        """The pipeline's Qwen2.5-VL token states (cropped after its template, padded), CLIP's pooled vector and
        the mask (all True where the pipeline gives None: no caption padded)."""
        pipeline = self.pipeline()
        with torch.no_grad(), quiet_hf_libraries():
            embeds, pooled, mask = pipeline._get_prompt_embeds(
                list(captions),
                pipeline.tokenizer,
                pipeline.text_encoder,
                pipeline.tokenizer_2,
                pipeline.text_encoder_2,
                self.max_sequence_length,
                self.device,
            )
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        return dict(zip(TEXT_TENSORS, (embeds, pooled, mask)))

    def encode_sound(self, sound: torch.Tensor) -> torch.Tensor:
        """Stereo waveforms (B, 2, samples) at sound_rate -> mono -> the audio VAE posterior's means (B, C, T)."""
        audio_vae = self.parts["audio_vae"]
        with torch.no_grad():
            posterior = audio_vae.encode(sound.mean(dim=1).float()).latent_dist
        return at_least_float32(posterior.mean)

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The core's encoded batch with the clips' sound latents (cached, or encoded from the batch's sound:
        silence's for a clip without) and which clips have sound."""
        encoded = super().encode_batch(batch, dtype)
        if "has_sound" not in batch:
            raise FamilyError(
                "Kandinsky 6 trains each clip's sound, but the batch carries none: the latent cache was built "
                "without it; delete data.cache.dir (or choose another) to re-encode the clips with their sound"
            )
        heard = batch["has_sound"].to(self.device).reshape(-1).bool()
        if "sound_latent" in batch:
            latent = batch["sound_latent"].to(self.device).float()
        else:
            latent = self.encode_sound(batch["sound"].to(self.device))
        return {**encoded, "sound_latent": latent, "has_sound": heard}

    def latent_patch(self) -> tuple[int, int]:
        return tuple(self.transformer_config["patch_size"][1:])

    def spatial_factor(self) -> int:
        return self.vae.config.spatial_compression_ratio

    def model_conditions(self, encoded: dict, dtype) -> dict:
        """Image-to-video: the reference frame's latent, the clip's first latent frame (B, H, W, C) clean in the
        transformer's scale (a causal VAE encodes it as the pipeline encodes the image alone)."""
        if not self.mode:
            return {}
        first = self.to_model_latents(encoded["latent_mean"][:, :, 0])
        return {"reference_latent": first.permute(0, 2, 3, 1).to(dtype)}

    # ------------------------------------------------------------------------------------- the loss

    def sigma_draw(self, latents: torch.Tensor, seed: int, step: int, indices: list[int]) -> torch.Tensor:
        return self.shifted_draw(seed, step, indices, "timestep")

    def shifted_draw(self, seed: int, step: int, indices: list[int], purpose: str) -> torch.Tensor:
        """Each sample's sigma of its own uniform u (generator of `purpose`), shifted."""
        uniform = torch.cat([torch.rand((1,), generator=sample_generator(seed, step, i, purpose)) for i in indices])
        return shifted_sigma(uniform, self.shift())

    def sound_tokens(self, encoded: dict) -> torch.Tensor:
        """The clips' sound latents (B, C, T) in the transformer's scale and layout (B, T, C)."""
        scale = self.parts["audio_vae"].config.scaling_factor
        return (encoded["sound_latent"] * scale).transpose(1, 2)

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The video's flow-matching error averaged over the batch plus the sound's averaged over the clips with
        sound (the fork's compute_loss), each at its own sigma; with data.sets the roles' weighted means
        (dstune.families.loss_terms.batch_loss)."""
        latents = self.model_latents(encoded, seed, step)
        indices = self.indices(encoded)
        noise = per_sample_randn(latents.shape[1:], seed, step, indices, "noise").to(latents.device)
        timesteps, sigma = self.draw_sigmas(latents, seed, step, indices)
        sigmas, noisy = noisy_at(latents, noise, sigma)
        sound = self.sound_tokens(encoded)
        sound_noise = per_sample_randn(sound.shape[1:], seed, step, indices, "audio_noise").to(sound.device)
        sound_sigma = self.shifted_draw(seed, step, indices, "audio_timestep").to(sound.device)
        _, noisy_sound = noisy_at(sound, sound_noise, sound_sigma)
        dtype = compute_dtype(self.trainable)
        conditions = self.conditions(encoded, dtype)
        video, predicted = self.forward_streams(
            forward, noisy, timesteps, conditions, dtype, noisy_sound, sound_sigma * 1000
        )
        video_error = self.flow_error(video, noisy, latents, noise, sigmas, encoded.get("loss_mask"))
        sound_error = (at_least_float32(predicted) - (sound_noise - sound)).pow(2).mean(dim=(1, 2))
        heard = encoded["has_sound"].to(sound_error.dtype)
        # the fork's sum over the clips with sound / their count, as a per-clip term of the batch's mean
        sound_error = sound_error * heard * len(heard) / heard.sum().clamp(min=1)
        loss, self.last_loss_parts = parted_loss({"video": video_error, "audio": sound_error}, encoded)
        return loss

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        """The video velocity without sound (the fused blocks run their video path only)."""
        return self.forward_streams(forward, noisy, timesteps, conditions, dtype)[0]

    def forward_streams(self, forward, noisy, timesteps, conditions: dict, dtype, sound=None, sound_timesteps=None):
        """The transformer on the noisy clip (B, C, F, H, W) and sound tokens (B, T, C) at their own timesteps ->
        (the video velocity in the latent layout, the sound's (B, T, C) or None). The visual input is
        [latent | zeros | mask] where the transformer takes conditioning channels, the reference frame appended in
        image-to-video as the pipeline appends it."""
        clip = noisy.permute(0, 2, 3, 4, 1)  # (B, F, H, W, C)
        batch, frames = clip.shape[:2]
        reference = conditions.get("reference_latent")
        token_types = positions = None
        if reference is not None:
            clip = torch.cat([clip, reference[:, None].to(clip.dtype)], dim=1)
            token_types = torch.zeros(batch, frames + 1, dtype=torch.long, device=clip.device)
            token_types[:, -1] = 1
            patch_t, patch_h, patch_w = self.transformer_config["patch_size"]
            positions = (
                torch.cat([torch.arange(frames // patch_t), torch.zeros(1, dtype=torch.long)]).to(clip.device),
                torch.arange(clip.shape[2] // patch_h, device=clip.device),
                torch.arange(clip.shape[3] // patch_w, device=clip.device),
            )
        if self.transformer_config["visual_cond"]:
            mask = clip.new_zeros(*clip.shape[:-1], 1)
            if reference is not None:
                mask[:, -1] = 1
            clip = torch.cat([clip, torch.zeros_like(clip), mask], dim=-1)
        streams = audio_timestep(self.trainable, sound_timesteps) if sound is not None else contextlib.nullcontext()
        with streams:
            outputs = forward(
                hidden_states=clip.to(dtype),
                encoder_hidden_states=conditions["encoder_hidden_states"].to(dtype),
                pooled_projections=conditions["pooled_projections"].to(dtype),
                timestep=timesteps,
                audio_hidden_states=None if sound is None else sound.to(dtype),
                visual_rope_pos=positions,
                encoder_attention_mask=conditions["encoder_attention_mask"].bool(),
                visual_token_type_ids=token_types,
                return_dict=False,
            )
        video = outputs[0][:, :frames].permute(0, 4, 1, 2, 3)
        return video, (outputs[1] if sound is not None else None)

    def lora_pipeline_class(self) -> str:
        return LORA_PIPELINE

    def own_split_plan(self, size: int) -> dict:
        """diffusers 0.42 gives the class no context-parallel plan: dstune's (dstune.models.kandinsky6.split)."""
        return split.prepare_split(self.trainable, size)

    # ------------------------------------------------------------------------------------- samples

    def side_multiple(self) -> int:
        return self.vae.config.spatial_compression_ratio * max(self.transformer_config["patch_size"][1:])

    def sample_arguments(self, pipeline, sample_spec, arguments: dict) -> dict:
        """The frame rate the sound's length follows: the released models' 24."""
        return {**arguments, "frame_rate": DEFAULT_FPS}

    def sample_sources(self, sample_spec, prompts: list[str]):
        """Image-to-video: sample.control_images, one first frame per prompt; text-to-video: None."""
        return first_frames(sample_spec, prompts) if self.mode else None

    def rendered(self, result):
        """A rendered clip's frames with the sound its vocoder rendered, at the frame rate it was rendered at."""
        rate = self.parts["audio_vae"].config.sample_rate
        return ClipWithSound(list(result.frames[0]), result.audio[0][None].float().cpu().numpy(), rate, DEFAULT_FPS)
