"""The loss lines of the musubi-tuner fork that trains Kandinsky 6, re-typed (test helpers, not tests).

Source: AkaneTendo25/musubi-tuner, src/musubi_tuner/kandinsky6_train_network.py at commit
2f1e2ed5650b1c1ba0956b348ce063a716e693bb (shifted_flow_sigma, build_ti2av_video_input,
get_noisy_model_input_and_timesteps, Kandinsky6NetworkTrainer.call_dit / process_batch / compute_loss), with the
independent audio time of the fork's later tests/test_kandinsky6_training.py (independent_time on by default: the
sound's own uniform u, shifted alike, its timestep fed to the audio branch). The fork's own DiT takes
time=(video_time, audio_time); here diffusers' Kandinsky6Transformer3DModel runs with its audio_time_embeddings
swapped, for the call, for a module that embeds the audio time. The draws are dstune's (each sample's own
generators): the uniform u of the video and of the sound, the noises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shifted_flow_sigma(uniform: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * uniform / (1.0 + (shift - 1.0) * uniform)


def build_ti2av_video_input(noisy_video, image_latent, visual_cond: bool):
    batch, frames, height, width, channels = noisy_video.shape
    token_types = None
    if image_latent is not None:
        noisy_video = torch.cat([noisy_video, image_latent], dim=1)
        token_types = torch.cat(
            [torch.zeros((batch, frames), dtype=torch.long), torch.ones((batch, 1), dtype=torch.long)], dim=1
        )
    if not visual_cond:
        return noisy_video, token_types
    condition = torch.zeros_like(noisy_video)
    mask = torch.zeros((*noisy_video.shape[:-1], 1), dtype=noisy_video.dtype)
    if image_latent is not None:
        mask[:, -1] = 1
    return torch.cat([noisy_video, condition, mask], dim=-1), token_types


class _AudioTime(torch.nn.Module):
    """Stands in for the audio branch's time embedding: the same module fed the audio time."""

    def __init__(self, embeddings, audio_time):
        super().__init__()
        self.embeddings, self.audio_time = embeddings, audio_time

    def forward(self, _video_time):
        return self.embeddings(self.audio_time)


def dit(transformer, model_video, token_types, rope_pos, noisy_audio, text, pooled, mask, video_time, audio_time):
    """The transformer at (video_time, audio_time) (B,) each."""
    original = transformer.audio_time_embeddings
    transformer.audio_time_embeddings = _AudioTime(original, audio_time)
    try:
        return transformer(
            hidden_states=model_video,
            audio_hidden_states=noisy_audio,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=video_time,
            visual_rope_pos=rope_pos,
            encoder_attention_mask=mask,
            visual_token_type_ids=token_types,
            return_dict=False,
        )
    finally:
        transformer.audio_time_embeddings = original


def fork_loss(
    transformer,
    latents,
    noise,
    u_video,
    audio,
    audio_noise,
    u_audio,
    audio_present,
    text,
    pooled,
    mask,
    shift: float,
    image_latent=None,
):
    """process_batch + call_dit + compute_loss: latents (B, C, T, H, W) and audio (B, C, A) in the cache layout,
    already scaled; image_latent (B, C, 1, H, W) or None."""
    video = latents.permute(0, 2, 3, 4, 1)
    video_noise = noise.permute(0, 2, 3, 4, 1)
    sigma = shifted_flow_sigma(u_video, shift)
    sigma_view = sigma.view(-1, 1, 1, 1, 1)
    noisy_video = (1.0 - sigma_view) * video + sigma_view * video_noise
    timesteps = sigma * 1000.0
    audio = audio.transpose(1, 2)
    audio_noise = audio_noise.transpose(1, 2)
    audio_sigma = shifted_flow_sigma(u_audio, shift)
    audio_view = audio_sigma.view(-1, 1, 1)
    noisy_audio = (1.0 - audio_view) * audio + audio_view * audio_noise
    image = None if image_latent is None else image_latent.permute(0, 2, 3, 4, 1)
    model_video, token_types = build_ti2av_video_input(noisy_video, image, transformer.config.visual_cond)
    frames, height, width = video.shape[1:4]
    patch_t, patch_h, patch_w = transformer.config.patch_size
    rope_pos = None
    if image is not None:  # the tail reference reuses generated frame zero's temporal position
        rope_pos = (
            torch.cat([torch.arange(frames // patch_t), torch.zeros(1, dtype=torch.long)]),
            torch.arange(height // patch_h),
            torch.arange(width // patch_w),
        )
    video_pred, audio_pred = dit(
        transformer, model_video, token_types, rope_pos, noisy_audio, text, pooled, mask, timesteps, audio_sigma * 1000
    )
    video_pred = video_pred[:, :frames]
    video_loss = F.mse_loss(video_pred.float(), (video_noise - video).float())
    per_item_audio = (audio_pred.float() - (audio_noise - audio).float()).pow(2).flatten(1).mean(1)
    weights = audio_present.float()
    audio_loss = (per_item_audio * weights).sum() / (weights > 0).sum().clamp_min(1)
    return video_loss + audio_loss
