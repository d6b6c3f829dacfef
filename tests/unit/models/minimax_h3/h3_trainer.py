"""The loss lines of a published MiniMax-H3 trainer, re-typed for the parity test (test helpers, not tests):
AviadDahan/MiniMax-H3-Trainer at commit 3b739f70d2a61b8b65ece20a576c8252eba35326, src/h3_trainer/flow_matching.py
(shift_sigma, timestep_from_sigma, add_noise, velocity_target, flow_matching_loss, audio_loss_weight),
src/h3_trainer/packing.py (assemble: the layout, the rows at their timesteps) and
src/h3_trainer/training_strategies/flexible.py (compute_loss: the video's mean squared error plus the audio's, the
audio's weight 0 for an all-zero placeholder track). Its layout builders are diffusers' (a pinned commit's
`packing` module; in diffusers 0.42.1 the same functions are MiniMaxH3PrepareLayoutStep.build_packed_sequence and
MiniMaxH3SetTimestepsStep.build_row_timesteps). Written from reading it, in this project's words."""

from __future__ import annotations

import torch

VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # its constants.DEFAULT_VIDEO_SHIFT / DEFAULT_AUDIO_SHIFT
TEXT_TAG, VIDEO_TAG, AUDIO_TAG = 1, 0, 2


def shift_sigma(u, shift: float):
    return shift * u / (1.0 + (shift - 1.0) * u)


def trainer_loss(transformer, u: float, video_rows, audio_rows, text, noise_video, noise_audio, frame_shape):
    """One packed sample's loss as the trainer computes it: (loss, the transformer's keyword arguments).
    `video_rows` / `audio_rows`: the clean target rows (rows, channels); `frame_shape` (latent frames, h, w)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
    )

    sigma_video, sigma_audio = shift_sigma(u, VIDEO_SHIFT), shift_sigma(u, AUDIO_SHIFT)
    video_t, audio_t = 1.0 - sigma_video, 1.0 - sigma_audio  # timestep_from_sigma
    frames, height, width = frame_shape
    tags = torch.full((text.shape[0],), TEXT_TAG, dtype=torch.long)
    positions, token_tags, video_idx, audio_idx, text_idx, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, frames, height, width, audio_rows.shape[0] // 2, (1, 2, 2), 2, AUDIO_TAG, VIDEO_TAG
    )
    noisy_video = (1.0 - sigma_video) * video_rows + sigma_video * noise_video  # add_noise
    noisy_audio = (1.0 - sigma_audio) * audio_rows + sigma_audio * noise_audio
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_idx, audio_idx, 0, 0, text.shape[0], float(video_t), float(audio_t), max(float(video_t), 0.999), 1.0
    )
    kwargs = dict(
        hidden_states=noisy_video[None],
        audio_hidden_states=noisy_audio[None],
        encoder_hidden_states=text[None],
        timestep=timestep,
        timestep_indices=timestep_indices,
        position_ids=positions,
        token_tags=token_tags,
        video_indices=video_idx,
        audio_indices=audio_idx,
        text_indices=text_idx,
        attention_kwargs=None,
        return_dict=False,
    )
    prediction_video, prediction_audio = transformer(**kwargs)
    video_loss = torch.nn.functional.mse_loss(prediction_video.float(), (video_rows - noise_video)[None].float())
    weight = 1.0 if bool(audio_rows.abs().sum() > 0) else 0.0  # audio_loss_weight
    audio_loss = torch.nn.functional.mse_loss(prediction_audio.float(), (audio_rows - noise_audio)[None].float())
    return video_loss + weight * audio_loss, kwargs
