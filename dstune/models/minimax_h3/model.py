"""MiniMax-H3's training step (its card: dstune.models.minimax_h3.card): text-to-video with stereo sound (t2va), and
with model.image_to_video first-frame-to-video with sound (fl2va: dstune.models.minimax_h3.keyframes), on the folder's
`transformer/` partition. Its loss is `MiniMaxH3.loss`, read top to bottom below; the objective is its
pipeline's denoising step inverted (docs/family-minimax-h3.md):
- latents: clips (B, 3, frames, H, W), the data layer's [-1, 1] mapped to the VAE's ImageNet-normalised [0, 1] (the
  card's pixel_range), through AutoencoderKLMiniMaxH3 (17k+5 frames -> 5k+2 latent frames, 16x spatial); the
  posterior's mode, normalised per channel (z - latents_mean) / latents_std; packed into 1x2x2 patches, frame-major
  (the pipeline's patchify);
- sound: the clip's stereo track at the audio VAE's 32 kHz, each channel through AutoencoderKLMiniMaxH3Audio (the
  posterior's mode, normalised per channel), channel-major rows, cut to the pipeline's count for the clip's length
  (frames / 24 x 40 a channel); a clip without sound gets zero rows in their place and no sound loss, as the
  published trainer does (its sound rows still shape the video's attention, as they do when it samples);
- text: the caption tokenized verbatim (no special tokens), the Qwen3-VL hidden state after decoder layer 50 (the
  card's text_layer), unpadded; the cache stores it padded to max_sequence_length with its mask; fl2va: after the
  first frame's label and vision block (their rows tagged), never cached;
- fl2va's keyframe: the clip's first frame through the VAE as the pipeline encodes a keyframe (cached beside the
  posterior), its rows noised to t = 0.999 with their own draw;
- sigma: u from model.timestep_sampling, through the video scheduler's shift 12 (sigma = 12u / (1 + 11u)) and the
  audio scheduler's shift 3 at the same u (the two step together); x_t = (1 - sigma) x0 + sigma noise per stream;
- the forward: one packed sequence per clip, [text | keyframe (fl2va) | audio | video], as the pipeline's layout step
  builds it (MiniMaxH3PrepareLayoutStep.build_packed_sequence: rows, tags, the fp64 rotary grid), every row at its
  stream's timestep 1 - sigma (text rows at the video's, keyframe rows at max(1 - sigma, 0.999):
  build_row_timesteps), so a micro batch of B clips is B forwards;
- the target: the transformer predicts v = x0 - noise (data-ward); the video's prediction on the target rows (not the
  keyframe's), negated, enters the core's flow_error against noise - x0 (the same squared error; loss masks and
  weightings apply), the sound's squared error is added for a clip with sound; the mean over the micro batch
  (data.sets: the roles' means).
Samples: the folder's modular pipeline (its blocks around the loaded parts) without its text block: the class hands
it each prompt's rows (cached or encoded here; fl2va: after the prompt's first frame, which the pipeline's fl2va
workflow encodes as its keyframe), so no Qwen3VLProcessor is loaded.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import batch_field, load_component
from dstune.families.flow_matching import timestep_density
from dstune.families.flow_model import FlowModel, noisy_at
from dstune.families.loss_terms import parted_loss
from dstune.families.modular import modular_pipeline
from dstune.families.precision import at_least_float32, compute_dtype
from dstune.families.randomness import per_sample_randn
from dstune.families.samples import ClipWithSound, first_frames
from dstune.hf import quiet_hf_libraries
from dstune.models.minimax_h3 import keyframes
from dstune.models.minimax_h3 import split
from dstune.models.minimax_h3.card import (
    AUDIO_SHIFT,
    AUDIO_TAG,
    FPS,
    KEYFRAME_LEVEL,
    KEYFRAME_TENSORS,
    TEXT_LAYER,
    TEXT_TAG,
    TEXT_TENSORS,
    VIDEO_SHIFT,
    VIDEO_TAG,
    audio_rows,
)

STEREO = 2


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The MiniMaxH3Scheduler's shift of a sigma (here u): shift u / (1 + (shift - 1) u)."""
    return shift * u / (1 + (shift - 1) * u)


def patchify(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """(1, C, F, H, W) -> (rows, C x pt x ph x pw): the pipeline's packing, frame-major then row-major."""
    pt, ph, pw = patch
    _, channels, frames, height, width = latents.shape
    rows = latents.reshape(1, channels, frames // pt, pt, height // ph, ph, width // pw, pw)
    return rows.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(-1, channels * pt * ph * pw)


def unpatchify(rows: torch.Tensor, like: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """The inverse of patchify for a clip shaped `like` (1, C, F, H, W)."""
    pt, ph, pw = patch
    _, channels, frames, height, width = like.shape
    rows = rows.reshape(1, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(like.shape)


class MiniMaxH3(FlowModel):
    # ------------------------------------------------------------------------------------- loading

    def scheduler_class(self):
        from diffusers import MiniMaxH3Scheduler

        return MiniMaxH3Scheduler

    def train_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """No table: each clip's sigma is u through the shifts (draw_pair)."""
        return torch.empty(0), torch.empty(0)

    def load_parts(self) -> dict:
        """The audio VAE (frozen: it encodes the clips' sound and decodes the samples') and the audio scheduler."""
        with quiet_hf_libraries():
            from diffusers import AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler

        loader = AutoencoderKLMiniMaxH3Audio.from_pretrained
        audio_vae = load_component(self.folder, "audio_vae", loader, torch_dtype=self.frozen_dtype)
        return {
            "audio_vae": audio_vae.to(self.device).eval().requires_grad_(False),
            "audio_scheduler": load_component(self.folder, "audio_scheduler", MiniMaxH3Scheduler.from_pretrained),
        }

    @property
    def sound_rate(self) -> int:
        """The audio VAE's rate: the dataset resamples each clip's sound to it."""
        return self.parts["audio_vae"].config.sampling_rate

    def latent_parts(self) -> tuple[str, ...]:
        return (*super().latent_parts(), "audio_vae")

    def patch(self) -> tuple[int, int, int]:
        return tuple(self.transformer_config["patch_size"])

    def latent_patch(self) -> tuple[int, int]:
        return self.patch()[1], self.patch()[2]

    def spatial_factor(self) -> int:
        return self.vae.spatial_compression_ratio

    def side_multiple(self) -> int:
        return self.vae.spatial_compression_ratio * self.patch()[2]

    # ------------------------------------------------------------------------------------- encoding

    @property
    def anchors(self) -> tuple[str, ...]:
        """The keyframes a clip trains with: its first frame under model.image_to_video (fl2va), none for t2va."""
        return ("first",) if self.model_spec.image_to_video else ()

    def prompt_rows(self, caption: str, images: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """One caption's rows (tokens, width) and their modality tags: the hidden state after decoder layer 50 of the
        presentation (the pipeline's get_qwen3vl_prompt_embeds): the caption tokenized verbatim, cut to
        max_sequence_length tokens, after each keyframe's label and vision block (fl2va: keyframes.presentation)."""
        tokenizer, encoder = self.tokenizers["tokenizer"], self.text_encoders["text_encoder"]
        caption_ids = tokenizer(caption, add_special_tokens=False)["input_ids"][: self.max_sequence_length]
        processor = self.keyframe_processor() if images else None
        ids, tags, vision = keyframes.presentation(tokenizer, processor, caption_ids, list(images))
        tags = torch.tensor(tags, dtype=torch.long, device=self.device)
        image, video = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
        if not ids:  # an empty caption (dropped, or the negative): no text rows (the encoder takes none)
            width = encoder.config.text_config.hidden_size
            return torch.zeros(0, width, device=self.device, dtype=encoder.dtype), tags
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        # Qwen3-VL's own token types (its processor's create_mm_token_type_ids): 1 image pad, 2 video pad, 0 text
        types = (input_ids == image).long() + 2 * (input_ids == video).long()
        pixels = {
            name: value.to(self.device, encoder.dtype if name == "pixel_values" else value.dtype)
            for name, value in vision.items()
        }
        with torch.no_grad():
            outputs = encoder.model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=types,
                use_cache=False,
                output_hidden_states=True,
                **pixels,
            )
        return outputs.hidden_states[TEXT_LAYER][0], tags

    def keyframe_processor(self):
        """Qwen3-VL's image processor for the keyframes' vision blocks (keyframes.image_processor), made once."""
        if getattr(self, "_keyframe_processor", None) is None:
            encoder = self.text_encoders["text_encoder"]
            self._keyframe_processor = keyframes.image_processor(self.folder, encoder)
        return self._keyframe_processor

    def text_tokens(self) -> Optional[int]:
        """t2va: max_sequence_length rows a caption; fl2va: no fixed length (the keyframe's vision block joins)."""
        return None if self.anchors else self.max_sequence_length

    def encode_text(self, captions: list[str], frames: Optional[torch.Tensor] = None, **inputs) -> dict:
        """Each caption's rows padded with zeros (to max_sequence_length; fl2va: to the batch's longest, the
        caption after its clip's first frame `frames` (B, 3, H, W) uint8), the mask of its own rows and (fl2va)
        their modality tags."""
        images = keyframes.pil_images(frames) if frames is not None else [None] * len(captions)
        encoded = [
            self.prompt_rows(caption, (image,) if image is not None else ()) for caption, image in zip(captions, images)
        ]
        width = self.text_encoders["text_encoder"].config.text_config.hidden_size
        length = max((len(rows) for rows, _ in encoded), default=0) if frames is not None else self.max_sequence_length
        embeds = encoded[0][0].new_zeros(len(encoded), length, width) if encoded else torch.empty(0)
        mask = torch.zeros(len(encoded), length, dtype=torch.long, device=self.device)
        tags = torch.full((len(encoded), length), TEXT_TAG, dtype=torch.long, device=self.device)
        for number, (rows, row_tags) in enumerate(encoded):
            embeds[number, : len(rows)], mask[number, : len(rows)], tags[number, : len(rows)] = rows, 1, row_tags
        text = dict(zip(TEXT_TENSORS, (embeds, mask)))
        return {**text, "text_token_tags": tags} if frames is not None else text

    def condition_tensors(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """fl2va: each clip's first frame as a keyframe's latent and its pixels (keyframes.keyframe_tensors), which
        the latent cache stores beside the posterior; t2va: nothing."""
        if not self.anchors:
            return {}
        range_ = self.card.pixel_range()
        return keyframes.keyframe_tensors(self.vae, pixels, range_.mean, range_.std)

    def encode_conditions(self, batch: dict, dtype: torch.dtype) -> dict:
        """fl2va: the clips' keyframe latents and first frames, cached or encoded from the clips now."""
        if not self.anchors:
            return {}
        if all(name in batch for name in KEYFRAME_TENSORS):
            return {name: batch[name].to(self.device) for name in KEYFRAME_TENSORS}
        return self.condition_tensors(batch_field(batch, "pixel_values").to(self.device, self.vae.dtype))

    def text_inputs(self, conditions: dict) -> Optional[dict]:
        """fl2va: the text reads the first frames (their vision blocks precede the caption)."""
        return {"frames": conditions["keyframe_pixels"]} if self.anchors else None

    def encode_sound(self, sound: torch.Tensor) -> torch.Tensor:
        """Stereo waveforms (B, 2, samples) at sound_rate -> normalised channel-major rows (B, 2 x N, channels):
        each channel through the mono audio VAE (its posterior's mode), (z - latents_mean) / latents_std."""
        audio_vae = self.parts["audio_vae"]
        batch, channels, samples = sound.shape
        mono = sound.reshape(batch * channels, 1, samples).to(self.device, audio_vae.dtype)
        with torch.no_grad():
            latents = at_least_float32(audio_vae.encode(mono).latent_dist.mode()).transpose(1, 2)
        mean = torch.tensor(audio_vae.config.latents_mean, device=latents.device).view(1, 1, -1)
        std = torch.tensor(audio_vae.config.latents_std, device=latents.device).view(1, 1, -1)
        return ((latents - mean) / std).reshape(batch, channels * latents.shape[1], latents.shape[2])

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The core's encoded batch with the clips' sound rows (cached, or encoded from the batch's sound) and which
        clips have sound."""
        encoded = super().encode_batch(batch, dtype)
        heard = batch["has_sound"].to(self.device).reshape(-1).bool() if "has_sound" in batch else None
        if heard is None:  # a batch without sound (a cache built without it): every clip's rows are zeros
            heard = torch.zeros(len(encoded["indices"]), dtype=torch.bool, device=self.device)
        if "sound_latent" in batch:
            sound = batch["sound_latent"].to(self.device).float()
        elif heard.any():
            sound = self.encode_sound(batch["sound"].to(self.device))
        else:
            sound = None
        return {**encoded, "sound_latent": sound, "has_sound": heard}

    def to_model_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """(z - latents_mean) / latents_std per channel, the config's statistics (the pipeline's decode inverts it)."""
        shape = (1, -1) + (1,) * (sample.ndim - 2)
        mean = torch.tensor(self.vae.config.latents_mean, device=sample.device, dtype=sample.dtype).view(shape)
        std = torch.tensor(self.vae.config.latents_std, device=sample.device, dtype=sample.dtype).view(shape)
        return (sample - mean) / std

    # ------------------------------------------------------------------------------------- the loss

    def draw_pair(self, seed: int, step: int, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each clip's (video sigma, audio sigma): one u (model.timestep_sampling) through the shifts 12 and 3."""
        u = timestep_density(self.model_spec, seed, step, indices)
        return shifted(u, VIDEO_SHIFT), shifted(u, AUDIO_SHIFT)

    def clip_sound(self, encoded: dict, number: int, frames: int, seed: int, step: int, index: int):
        """(clean rows, noise) of clip `number`'s sound: the pipeline's row count for its frames, its rows cut to
        that many a channel (the VAE pads the track to whole 800-sample hops), zeros for a clip without sound."""
        rows = audio_rows(frames, STEREO)
        channels = self.parts["audio_vae"].config.latent_channels
        if encoded["has_sound"][number]:
            stored = encoded["sound_latent"][number]
            per_channel = stored.reshape(STEREO, -1, channels)
            if per_channel.shape[1] < rows // STEREO:
                raise FamilyError(
                    f"sample {index}: its sound has {per_channel.shape[1]} latents a channel, fewer than the "
                    f"{rows // STEREO} its {frames} frames take at {FPS} fps"
                )
            clean = per_channel[:, : rows // STEREO].reshape(rows, channels)
        else:
            clean = torch.zeros(rows, channels, device=self.device)
        noise = per_sample_randn((rows, channels), seed, step, [index], "audio_noise")[0].to(clean.device)
        return clean, noise

    def frames_of(self, latent_frames: int) -> int:
        """The pixel frames of a clip of `latent_frames` (the clip rule's inverse)."""
        rule = self.clip_rule()
        return rule.first + (latent_frames - rule.first_latents) // rule.latents * rule.step

    def packed_inputs(self, text, tags, keyframe_rows, video_rows, audio_rows_, shape, sigmas, dtype) -> dict:
        """The transformer's arguments for one clip: its layout as MiniMaxH3PrepareLayoutStep builds it (fl2va: the
        keyframe rows first among the video rows, anchored as self.anchors say), each row's timestep as
        MiniMaxH3SetTimestepsStep plans it (1 - sigma per stream, text at the video's, keyframe rows at
        max(1 - sigma, 0.999))."""
        with quiet_hf_libraries():
            from diffusers.modular_pipelines.minimax_h3.before_denoise import (
                MiniMaxH3PrepareLayoutStep,
                MiniMaxH3SetTimestepsStep,
            )

        _, _, frames, height, width = shape
        positions, token_tags, video, audio, text_rows, keyframe_count, _ = (
            MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                tags.cpu(),
                frames,
                height,
                width,
                len(audio_rows_) // STEREO,
                self.patch(),
                STEREO,
                AUDIO_TAG,
                VIDEO_TAG,
                self.anchors,
            )
        )
        video_t, audio_t = float(1 - sigmas[0]), float(1 - sigmas[1])
        timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            video, audio, keyframe_count, 0, len(text), video_t, audio_t, max(video_t, KEYFRAME_LEVEL), 1.0
        )
        device = video_rows.device
        return dict(
            hidden_states=torch.cat([keyframe_rows.to(device), video_rows])[None].to(dtype),
            audio_hidden_states=audio_rows_[None].to(dtype),
            encoder_hidden_states=text[None].to(dtype),
            timestep=timestep.to(device),
            timestep_indices=timestep_indices.to(device),
            token_tags=token_tags.to(device),
            position_ids=positions.to(device),
            video_indices=video.to(device),
            audio_indices=audio.to(device),
            text_indices=text_rows.to(device),
            return_dict=False,
        )

    def keyframe_rows(self, encoded: dict, number: int, seed: int, step: int, index: int) -> torch.Tensor:
        """Clip `number`'s keyframe rows (fl2va): its first frame's keyframe latent noised to t = 0.999 with its own
        draw (keyframes.noised_keyframe), packed; no rows for t2va."""
        if not self.anchors:
            channels = self.transformer_config["in_channels"] * math.prod(self.patch())
            return torch.zeros(0, channels, device=self.device)
        latent = encoded["keyframe_latent"][number : number + 1].float()
        noise = per_sample_randn(latent.shape[1:], seed, step, [index], "keyframe_noise").to(latent.device)
        return patchify(keyframes.noised_keyframe(latent, noise, self.scheduler, KEYFRAME_LEVEL), self.patch())

    def guided(self, forward, pack, text: torch.Tensor, tags: torch.Tensor) -> tuple:
        """The transformer's (video, sound) prediction for one clip (`pack(text, tags)`: its inputs); with
        model.cfg_augmented_target s, the rearranged guidance (cond + (s - 1) uncond) / s, uncond the same rows on
        the empty caption (no text rows; fl2va: the keyframe rows kept) without gradient: diffusion-pipe's
        CFG-augmented training, whose fit leaves the model's own output guided."""
        video, sound = forward(**pack(text, tags))
        scale = self.model_spec.cfg_augmented_target
        if scale is None:
            return video, sound
        with torch.no_grad():
            video_uncond, sound_uncond = forward(**pack(text[:0], tags[:0]))
        return (video + (scale - 1) * video_uncond) / scale, (sound + (scale - 1) * sound_uncond) / scale

    def clip_text(self, encoded: dict, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip `number`'s text rows (its padding cut) and their modality tags (text, or fl2va's stored tags)."""
        mask = encoded["encoder_attention_mask"][number].bool()
        text = encoded["encoder_hidden_states"][number][mask]
        if "text_token_tags" in encoded:
            return text, encoded["text_token_tags"][number][mask]
        return text, torch.full((len(text),), TEXT_TAG, dtype=torch.long)

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The mean over the micro batch of each clip's loss: the video's flow-matching error (its target rows'
        prediction negated to the core's noise - x0; over its loss mask where the batch has one) plus, for a clip
        with sound, the sound's squared error against x0 - noise. One forward per clip (its own packed sequence;
        fl2va: its keyframe rows before the targets, which the loss does not read)."""
        latents = self.model_latents(encoded, seed, step)
        indices = self.indices(encoded)
        noise = per_sample_randn(latents.shape[1:], seed, step, indices, "noise").to(latents.device)
        sigma, audio_sigma = self.draw_pair(seed, step, indices)
        sigmas, noisy = noisy_at(latents, noise, sigma.to(latents.device))  # sigmas shaped to the latents
        dtype = compute_dtype(self.trainable)
        frames = self.frames_of(latents.shape[2])
        predictions, sound_errors = [], []
        for number, index in enumerate(indices):
            text, tags = self.clip_text(encoded, number)
            clean, drawn = self.clip_sound(encoded, number, frames, seed, step, index)
            noisy_sound = (1 - audio_sigma[number]) * clean + audio_sigma[number] * drawn
            clip = noisy[number : number + 1]
            pack = functools.partial(  # the clip's inputs for a text (guided: also the empty caption's)
                self.packed_inputs,
                keyframe_rows=self.keyframe_rows(encoded, number, seed, step, index),
                video_rows=patchify(clip, self.patch()),
                audio_rows_=noisy_sound,
                shape=clip.shape,
                sigmas=(sigma[number], audio_sigma[number]),
                dtype=dtype,
            )
            video_velocity, sound_velocity = self.guided(forward, pack, text, tags)
            held = len(pack.keywords["keyframe_rows"])
            targets = at_least_float32(video_velocity[0, held:])  # the keyframe rows carry no loss
            predictions.append(-unpatchify(targets, clip, self.patch()))
            error = (at_least_float32(sound_velocity[0]) - (clean - drawn)).pow(2).mean()
            sound_errors.append(error * encoded["has_sound"][number].float())  # in the graph, weight 0 when silent
        prediction = torch.cat(predictions)
        video_error = self.flow_error(prediction, noisy, latents, noise, sigmas, encoded.get("loss_mask"))
        sound_error = torch.stack(sound_errors)
        loss, self.last_loss_parts = parted_loss({"video": video_error, "audio": sound_error}, encoded)
        return loss

    def own_split_plan(self, size: int) -> dict:
        """Its class's plan, after padding the packed sequence to split evenly (dstune.models.minimax_h3.split)."""
        return split.prepare_split(self.trainable, size)

    # ------------------------------------------------------------------------------------- samples

    def sample_scheduler(self):
        from diffusers import MiniMaxH3Scheduler

        return MiniMaxH3Scheduler.from_config(self.scheduler.config)

    def pipeline(self, transformer=None, vae=None, scheduler=None):
        """The folder's modular pipeline around the loaded parts without its text block: PromptRows hands it each
        prompt's rows."""
        components = {
            "transformer": transformer,
            "vae": vae,
            "scheduler": scheduler or self.scheduler,
            "audio_scheduler": self.parts["audio_scheduler"],
            "audio_vae": self.parts["audio_vae"],
        }
        return PromptRows(modular_pipeline(self.folder, components, without=("text_encoder",)), self)

    def sample_sources(self, sample_spec, prompts: list[str]) -> Optional[list]:
        """fl2va: each prompt's first frame (sample.control_images); t2va: none."""
        return first_frames(sample_spec, prompts) if self.anchors else None

    def sample_inputs(self, text_pipeline, prompt: str, source, sample_spec, side: int) -> dict:
        return {"prompt": prompt, "image": source}

    def sample_guidance(self, sample_spec, prompts: list[str]) -> dict:
        """Guidance-distilled: one forward a step, no guidance scale."""
        return {}

    def sample_arguments(self, pipeline, sample_spec, arguments: dict) -> dict:
        return {name: value for name, value in arguments.items() if name != "max_sequence_length"}

    def cached_text_arguments(self, pipeline, prompt: dict, negative: dict) -> dict:
        """The prompt's cached rows, its padding cut (one prompt a call)."""
        rows = prompt["encoder_hidden_states"][0][prompt["encoder_attention_mask"][0].bool()]
        return {"prompt_embeds": rows[None]}

    def rendered(self, result):
        """A rendered clip's frames with its stereo sound at the audio VAE's rate, at 24 fps."""
        frames = result.values["videos"][0]
        sound = result.values["audio"][0].float().cpu().numpy()
        return ClipWithSound(list(frames), sound, self.parts["audio_vae"].config.sampling_rate, FPS)


class PromptRows:
    """The modular pipeline without its text block, called as the core calls a pipeline: a prompt string becomes its
    rows (MiniMaxH3.prompt_rows) and text tags; cached rows (`prompt_embeds`) go in as they are."""

    def __init__(self, pipeline, model: MiniMaxH3):
        self.pipeline, self.model = pipeline, model

    def __call__(
        self, prompt: Optional[str] = None, prompt_embeds: Optional[torch.Tensor] = None, image=None, **arguments
    ):
        """fl2va (`image`: the prompt's first frame): the frame on the canvas (keyframes.canvas_keyframe) is the
        keyframe the pipeline encodes and the one the prompt's presentation shows."""
        keyframe = {}
        if image is not None:
            keyframe = {"image": keyframes.canvas_keyframe(image, arguments["width"], arguments["height"])}
        if prompt_embeds is None:
            prompt_embeds, tags = self.model.prompt_rows(prompt, tuple(keyframe.values()))
            prompt_embeds, tags = prompt_embeds[None], tags.cpu()
        else:
            tags = torch.full((prompt_embeds.shape[1],), TEXT_TAG, dtype=torch.long)
        return self.pipeline(prompt_embeds=prompt_embeds, text_token_tags=tags, output=None, **keyframe, **arguments)
