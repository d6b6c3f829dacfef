"""LTX-2's training step (its card: dstune.models.ltx2.card): text- and image-to-video, audio+video on clips with sound,
as Lightricks' ltx-trainer trains it. Its loss is `Ltx2.loss`, read top to bottom below.
- latents: clips (B, 3, frames, H, W) in [-1, 1] through AutoencoderKLLTX2Video (32x spatial, 8x temporal, 128
  channels); the posterior's mean (ltx-trainer's video encoder returns the normalised means), normalised per channel
  with the VAE's latents_mean / latents_std buffers and scaling_factor as LTX2Pipeline normalises them; packed into
  (B, F x H x W, C) tokens (patch 1x1x1);
- text: LTX2Pipeline.encode_prompt (every Gemma 3 hidden state stacked, left-padded to max_sequence_length, 1024 by
  default), then the folder's LTX2TextConnectors: the video and audio text embeddings and their mask, the three
  tensors data.cache.text_embeddings stores (the connectors are frozen, as in ltx-trainer, which caches their
  outputs too);
- sound: the clip's sound track at the audio VAE's rate, its log-mel (dstune.models.ltx2.audio), the audio VAE
  posterior's means packed (B, T, C x M) and normalised per feature; noised at the clip's sigma with noise of its own
  (purpose `audio_noise`), target noise - x0, its mean squared error added to the video's per sample;
- the transformer is fed the video tokens with the timestep sigma x 1000 (its timestep_scale_multiplier) and the
  RoPE coordinates of (num_frames, height, width) at 24 fps; a clip with sound also its audio tokens at the same
  timestep, with cross-modal attention; a clip without gets one zero audio token and isolate_modalities (no
  cross-modal attention), which is what ltx-trainer's transformer runs without an audio modality;
- sigma is drawn continuously as ltx-trainer's samplers draw it (shifted_logit_normal: a logit-normal whose mean
  follows the clip's token count, stretched to [0, 1], with 10% uniform draws; uniform), each sample from its own
  generator; x_t = (1 - sigma) x0 + sigma noise, target noise - x0, the squared error averaged per sample;
- image-to-video (model.image_to_video: true): the clip's first latent frame given clean at timestep 0, the loss over
  the other frames, as ltx-trainer's first-frame conditioning (dstune.models.ltx2.i2v);
- samples: the folder's LTX2Pipeline (LTX2ImageToVideoPipeline from sample.control_images for image-to-video), saved
  with the sound its vocoder renders.
Differences from ltx-trainer's loss are listed in docs/family-ltx2.md.
"""

from __future__ import annotations

from typing import Optional

import torch

from dstune.families.diffusion import load_component
from dstune.families.flow_model import FlowModel, noisy_at
from dstune.families.loss_terms import batch_loss, parted_loss
from dstune.families.precision import at_least_float32, compute_dtype
from dstune.families.randomness import per_sample_randn, sample_generator
from dstune.families.samples import ClipWithSound
from dstune.hf import quiet_hf_libraries
from dstune.models.ltx2 import i2v, ic_lora, split
from dstune.models.ltx2.audio import audio_tokens, sound_latents
from dstune.models.ltx2.card import DEFAULT_FPS, SPATIAL, TEXT_ENCODERS, TEXT_TENSORS, VOCODERS

# ltx-trainer's ShiftedLogitNormalTimestepSampler: the logit mean goes linearly from 0.95 at 1024 video tokens to
# 2.05 at 4096; draws are stretched between the normal's 0.5th and 99.9th percentiles, reflected at eps, and
# replaced by uniform ones with probability 0.1
SHIFT_TOKENS, SHIFT_VALUES = (1024, 4096), (0.95, 2.05)
PERCENTILE_LOW, PERCENTILE_HIGH = -2.5758, 3.0902
SIGMA_EPS, UNIFORM_PROBABILITY = 1e-3, 0.1


def shifted_logit_normal(tokens: int, normal: torch.Tensor, uniform: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """ltx-trainer's shifted logit-normal sigma of standard normal, uniform [0, 1) and mixing draws (one each per
    sample), for a clip of `tokens` video tokens."""
    slope = (SHIFT_VALUES[1] - SHIFT_VALUES[0]) / (SHIFT_TOKENS[1] - SHIFT_TOKENS[0])
    mean = SHIFT_VALUES[0] + slope * (tokens - SHIFT_TOKENS[0])
    low, high = torch.sigmoid(torch.tensor(mean + PERCENTILE_LOW)), torch.sigmoid(torch.tensor(mean + PERCENTILE_HIGH))
    stretched = (torch.sigmoid(normal + mean) - low) / (high - low)
    stretched = torch.where(stretched >= SIGMA_EPS, stretched, 2 * SIGMA_EPS - stretched).clamp(0, 1)
    return torch.where(mix > UNIFORM_PROBABILITY, stretched, (1 - SIGMA_EPS) * uniform + SIGMA_EPS)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, F x H x W, C): LTX-2's 1x1x1 patches, frame-major as the pipeline packs them."""
    return latents.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return tokens.transpose(1, 2).reshape(like.shape)


def once_per_group(error: torch.Tensor, split_size: int) -> torch.Tensor:
    """`error` with its gradient divided by the split size (its value unchanged): every rank of a sequence group
    computes it whole, and the group sums the gradients."""
    return error if split_size == 1 else error / split_size + (error - error / split_size).detach()


class Ltx2(FlowModel):
    # ------------------------------------------------------------------------------------- loading

    def listed_class(self, name: str, choices: tuple[str, ...]) -> str:
        """The class model_index.json lists for component `name`, one of `choices` (the card checked it)."""
        listed = (self.model_index.get(name) or [None, None])[1]
        return listed if listed in choices else choices[0]

    def load_text_encoders(self) -> tuple[dict, dict]:
        """The folder's Gemma (3 for LTX-2.0 and 2.3, 4 for 2.5) and its tokenizer, and the text connectors beside
        them (with 2.3's and 2.5's per-modality projections): frozen, so the text cache can store their outputs."""
        import transformers

        with quiet_hf_libraries():
            from diffusers.pipelines.ltx2 import LTX2TextConnectors

        encoders, tokenizers = super().load_text_encoders()
        gemma = getattr(transformers, self.listed_class("text_encoder", TEXT_ENCODERS)).from_pretrained
        encoders["text_encoder"] = self.place_text(
            load_component(self.folder, "text_encoder", gemma), self.frozen_dtype
        )
        loader = LTX2TextConnectors.from_pretrained
        connectors = load_component(self.folder, "connectors", loader, torch_dtype=self.frozen_dtype)
        encoders["connectors"] = self.place_text(connectors, None)
        return encoders, tokenizers

    def load_parts(self) -> dict:
        """The audio VAE and the vocoder (frozen): the pipeline that renders samples needs both; the mode: whether
        the run trains image-to-video (model.image_to_video, dstune.models.ltx2.i2v)."""
        with quiet_hf_libraries():
            from diffusers import AutoencoderKLLTX2Audio
            from diffusers.pipelines.ltx2 import vocoder

        self.mode = bool(self.model_spec.image_to_video)
        vocoder_class = getattr(vocoder, self.listed_class("vocoder", VOCODERS))
        loaders = {"audio_vae": AutoencoderKLLTX2Audio.from_pretrained, "vocoder": vocoder_class.from_pretrained}
        parts = {
            name: load_component(self.folder, name, loader, torch_dtype=self.frozen_dtype)
            for name, loader in loaders.items()
        }
        return {name: part.to(self.device).eval().requires_grad_(False) for name, part in parts.items()}

    @property
    def sound_rate(self) -> int:
        """The sample rate (Hz) the audio VAE takes: the dataset resamples each clip's sound track to it."""
        return self.parts["audio_vae"].config.sample_rate

    def latent_parts(self) -> tuple[str, ...]:
        return (*super().latent_parts(), "audio_vae")

    # ------------------------------------------------------------------------------------- encoding

    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        """The connectors' video and audio text embeddings and mask of LTX2Pipeline's Gemma 3 prompt embeds."""
        pipeline = self.pipeline()
        with torch.no_grad(), quiet_hf_libraries():
            embeds, mask, _, _ = pipeline.encode_prompt(
                list(captions),
                do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
                device=self.device,
            )
            video, audio, mask = pipeline.connectors(embeds, mask, padding_side=pipeline.tokenizer.padding_side)
        return dict(zip(TEXT_TENSORS, (video, audio, mask)))

    def encode_sound(self, sound: torch.Tensor) -> torch.Tensor:
        """Stereo waveforms (B, 2, samples) at sound_rate -> the audio VAE posterior's means, no random draw."""
        return sound_latents(self.parts["audio_vae"], sound)

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The core's encoded batch, with the clips' sound latents (cached, or encoded from the batch's sound) and
        which clips have sound; a batch that carries no sound (a cache built without it) trains the video alone."""
        encoded = super().encode_batch(batch, dtype)
        if "has_sound" not in batch:
            return encoded
        heard = batch["has_sound"].to(self.device).reshape(-1).bool()  # (B,), or (B, 1) from the latent cache
        if "sound_latent" in batch:
            return {**encoded, "sound_latent": batch["sound_latent"].to(self.device).float(), "has_sound": heard}
        if not heard.any():  # the loss trains these clips' video alone: their silence is not encoded
            return {**encoded, "has_sound": heard}
        return {**encoded, "sound_latent": self.encode_sound(batch["sound"].to(self.device)), "has_sound": heard}

    def to_model_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """(latents - latents_mean) x scaling_factor / latents_std per channel: LTX2Pipeline._normalize_latents with
        the VAE's own statistics (buffers of the VAE, not config values)."""
        shape = (1, -1) + (1,) * (sample.ndim - 2)
        mean = self.vae.latents_mean.view(shape).to(sample.device, sample.dtype)
        std = self.vae.latents_std.view(shape).to(sample.device, sample.dtype)
        return (sample - mean) * self.vae.config.scaling_factor / std

    def latent_patch(self) -> tuple[int, int]:
        return 1, 1

    def spatial_factor(self) -> int:
        return self.vae.config.spatial_compression_ratio or SPATIAL

    def encode_conditions(self, batch: dict, dtype) -> dict:
        """IC-LoRA: the reference clips' posterior means (dstune.models.ltx2.ic_lora); nothing otherwise."""
        return ic_lora.encode(self, batch)

    def model_conditions(self, encoded: dict, dtype) -> dict:
        return {**i2v.model_inputs(self, encoded, dtype), **ic_lora.model_inputs(self, encoded)}

    def clean_frames(self) -> int:
        return i2v.clean_frames(self)

    # ------------------------------------------------------------------------------------- the loss

    def sigma_draw(self, latents: torch.Tensor, seed: int, step: int, indices: list[int]) -> torch.Tensor:
        """Each sample's sigma, from its own generators: model.timestep_sampling shifted_logit_normal (ltx-trainer's
        default) or uniform (its uniform sampler: sigma = u)."""

        def draws(purpose: str, normal: bool = False) -> torch.Tensor:
            make = torch.randn if normal else torch.rand
            return torch.cat([make((1,), generator=sample_generator(seed, step, i, purpose)) for i in indices])

        if self.model_spec.timestep_sampling == "uniform":  # the card refused the others
            return draws("timestep")
        tokens = latents.shape[2] * latents.shape[3] * latents.shape[4]
        return shifted_logit_normal(
            tokens, draws("timestep", normal=True), draws("timestep_uniform"), draws("timestep_mix")
        )

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The mean over the micro batch of each clip's loss (with data.sets the train and regularization clips'
        weighted means: dstune.families.loss_terms.batch_loss): the video's flow-matching error (its first frame
        excluded in image-to-video; over its loss mask where the batch has one) plus, for a clip with sound, the
        sound's (never masked: a mask weights the picture), both at the clip's sigma."""
        latents = self.model_latents(encoded, seed, step)
        indices = self.indices(encoded)
        noise = per_sample_randn(latents.shape[1:], seed, step, indices, "noise").to(latents.device)
        timesteps, sigma = self.draw_sigmas(latents, seed, step, indices)
        sigmas, noisy = noisy_at(latents, noise, sigma)
        dtype = compute_dtype(self.trainable)
        conditions = self.conditions(encoded, dtype)
        heard, mask = encoded.get("has_sound"), encoded.get("loss_mask")  # the mask weights the video, not the sound
        if heard is None or not heard.any():  # no clip with sound: the video alone, one call
            prediction = self.predict(forward, noisy, timesteps, conditions, dtype)
            loss = batch_loss(self.flow_error(prediction, noisy, latents, noise, sigmas, mask), encoded)
            self.last_loss_parts = {"video": float(loss.detach()), "audio": 0.0}
            return loss
        sound = audio_tokens(self.parts["audio_vae"], encoded["sound_latent"])
        sound_noise = per_sample_randn(sound.shape[1:], seed, step, indices, "audio_noise").to(sound.device)
        video = (noisy, timesteps, latents, noise, sigmas, mask)
        order, video_errors, sound_errors = [], [], []
        echoed = conditions.get(ic_lora.REFERENCE_HEARD, torch.zeros_like(heard)).to(heard.device)
        kinds = (heard & echoed, heard & ~echoed, ~heard)  # with the reference's sound, with its own only, silent
        for kind, rows in enumerate(group.nonzero().flatten() for group in kinds):  # one transformer call per kind
            if len(rows) == 0:
                continue

            def pick(value, rows=rows):  # the rows of a per-clip tensor; anything else as it is
                per_clip = torch.is_tensor(value) and value.ndim and len(value) == len(heard)
                return value[rows] if per_clip else value

            clip_noisy, clip_timesteps, clip_latents, clip_noise, clip_sigmas, clip_mask = (pick(t) for t in video)
            given = {name: pick(value) for name, value in conditions.items()}
            if kind != 0:  # the reference's sound joins only the sound of a clip that trains its own
                given.pop(ic_lora.REFERENCE_SOUND, None)
            if heard[rows[0]]:
                sigma_tokens = clip_sigmas.reshape(-1, 1, 1)
                clean, drawn = pick(sound), pick(sound_noise)
                noisy_sound = (1.0 - sigma_tokens) * clean + sigma_tokens * drawn
                prediction, predicted = self.forward_streams(
                    forward, clip_noisy, clip_timesteps, given, dtype, noisy_sound
                )
                sound_error = (at_least_float32(predicted) - at_least_float32(drawn - clean)).pow(2).mean(dim=(1, 2))
                video_errors.append(
                    self.flow_error(prediction, clip_noisy, clip_latents, clip_noise, clip_sigmas, clip_mask)
                )
                sound_errors.append(once_per_group(sound_error, self.sequence_split))
            else:
                prediction = self.predict(forward, clip_noisy, clip_timesteps, given, dtype)
                video_errors.append(
                    self.flow_error(prediction, clip_noisy, clip_latents, clip_noise, clip_sigmas, clip_mask)
                )
                sound_errors.append(torch.zeros_like(video_errors[-1]))  # adds exactly nothing to a silent clip
            order.append(rows)
        back = torch.argsort(torch.cat(order))  # the clips in the batch's order again
        video_error, sound_error = torch.cat(video_errors)[back], torch.cat(sound_errors)[back]
        # the loss (the mean, or with data.sets the roles' means) and the two parts the log shows beside it
        loss, self.last_loss_parts = parted_loss({"video": video_error, "audio": sound_error}, encoded)
        return loss

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        """A clip without sound: the video velocity, the audio stream cut off."""
        return self.forward_streams(forward, noisy, timesteps, conditions, dtype)[0]

    def forward_streams(self, forward, noisy, timesteps, conditions: dict, dtype, audio: Optional[torch.Tensor] = None):
        """The transformer on the packed clip and `audio` tokens (B, T, D), every token at the clip's timestep (in
        image-to-video the first frame's clean, at 0: i2v.conditioned); without audio the audio stream runs on one
        zero token, cut off from the video (isolate_modalities). Returns (video velocity in the latent layout, audio
        velocity tokens)."""
        batch, _, frames, height, width = noisy.shape
        isolated = audio is None
        if isolated:
            audio = noisy.new_zeros(batch, 1, self.transformer_config["audio_in_channels"])
        noisy, video_timesteps = i2v.conditioned(self, noisy, timesteps, conditions)
        tokens, positions, references = pack(noisy), {}, 0
        joined = ic_lora.joined(
            self.trainable, tokens, video_timesteps, conditions, (frames, height, width), DEFAULT_FPS
        )
        if joined is not None:  # IC-LoRA: [reference | target] tokens, the reference clean at timestep 0
            tokens, video_timesteps, coords, references = joined
            positions = {"video_coords": coords}
        timesteps, audio_timesteps, heard_references = timesteps.to(dtype), timesteps.to(dtype), 0
        with_sound = None if isolated else ic_lora.joined_sound(self.trainable, audio, timesteps, conditions)
        if with_sound is not None:  # audio-to-audio: [reference | target] sound tokens, the reference's at 0
            audio, audio_timesteps, audio_coords, heard_references = with_sound
            positions["audio_coords"] = audio_coords
            audio_timesteps = audio_timesteps.to(dtype)
        video, audio_velocity = forward(
            hidden_states=tokens.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=conditions["encoder_hidden_states"].to(dtype),
            audio_encoder_hidden_states=conditions["audio_encoder_hidden_states"].to(dtype),
            timestep=video_timesteps.to(dtype),
            audio_timestep=audio_timesteps,
            sigma=timesteps,
            encoder_attention_mask=conditions["encoder_attention_mask"],
            audio_encoder_attention_mask=conditions["encoder_attention_mask"],
            num_frames=frames,
            height=height,
            width=width,
            fps=DEFAULT_FPS,
            audio_num_frames=audio.shape[1],
            isolate_modalities=isolated,
            return_dict=False,
            **positions,
        )
        # the target's tokens (video and sound): IC-LoRA's loss is theirs
        return unpack(video[:, references:], noisy), audio_velocity[:, heard_references:]

    def own_split_plan(self, size: int) -> dict:
        """diffusers 0.42's plan splits the masked caption, which fails: dstune's (dstune.models.ltx2.split)."""
        return split.prepare_split(self.trainable, size)

    # ------------------------------------------------------------------------------------- samples

    def pipeline_class_and_parts(self, transformer) -> tuple[type, dict]:
        """LTX2InContextPipeline for IC-LoRA samples (from reference clips), else as dstune.models.ltx2.i2v says."""
        name = ic_lora.pipeline_class(getattr(self, "references_sampled", False), transformer)
        if name is None:
            return i2v.pipeline(self, transformer)
        import diffusers

        return getattr(diffusers, name), self.parts

    def sample_sources(self, sample_spec, prompts: list[str]):
        """Image-to-video: the first frames; with sample.control_images in text-to-video, or as [reference, first
        frame] pairs in image-to-video (an IC-LoRA run: model_spec_issues allows them only with data.control_dir):
        the reference clips; else None."""
        paired = any(not isinstance(one, str) for one in sample_spec.control_images)  # image-to-video IC-LoRA
        self.references_sampled = (not self.mode or paired) and bool(sample_spec.control_images)
        if self.references_sampled:
            return ic_lora.sample_sources(sample_spec)
        return i2v.sample_sources(self, sample_spec, prompts)

    def sample_inputs(self, text_pipeline, prompt: str, source, sample_spec, side: int) -> dict:
        if self.references_sampled:
            return ic_lora.sample_inputs(prompt, source)
        return super().sample_inputs(text_pipeline, prompt, source, sample_spec, side)

    def side_multiple(self) -> int:
        return self.vae.spatial_compression_ratio

    def sample_arguments(self, pipeline, sample_spec, arguments: dict) -> dict:
        """The frame rate RoPE was trained at; the rest as the core passes it."""
        return {**arguments, "frame_rate": DEFAULT_FPS}

    def cached_text_arguments(self, pipeline, prompt: dict, negative: dict) -> dict:
        """LTX2Pipeline runs Gemma's stacked hidden states through its connectors; the cache holds the connectors'
        outputs, so the pipeline gets a stand-in for them and a placeholder of the embeddings' batch (never read)."""
        object.__setattr__(pipeline, "connectors", CachedConnectors(prompt, negative))  # not a folder component
        return super().cached_text_arguments(pipeline, prompt, negative)

    def rendered(self, result):
        """A rendered clip's frames with the sound its vocoder rendered, at the frame rate it was rendered at."""
        rate = self.parts["vocoder"].config.output_sampling_rate
        return ClipWithSound(list(result.frames[0]), result.audio[0].float().cpu().numpy(), rate, DEFAULT_FPS)


class CachedConnectors(torch.nn.Module):
    """Stands in for the pipeline's text connectors on a rank without the text side: their cached outputs (what
    the text cache stores) for the prompt, or under guidance for ("", prompt), in the order the pipeline
    concatenates its negative and positive embeddings. What it is given in their place is not read."""

    def __init__(self, prompt: dict, negative: dict):
        super().__init__()
        self.prompt, self.negative = prompt, negative

    @property
    def device(self) -> torch.device:  # what the pipeline asks of each of its modules
        return self.prompt[TEXT_TENSORS[0]].device

    @property
    def dtype(self) -> torch.dtype:
        return self.prompt[TEXT_TENSORS[0]].dtype

    def forward(self, embeds, mask, padding_side: str = "left") -> tuple:
        order = [self.negative, self.prompt] if embeds.shape[0] == 2 else [self.prompt]
        return tuple(torch.cat([tensors[name] for tensors in order]) for name in TEXT_TENSORS)
