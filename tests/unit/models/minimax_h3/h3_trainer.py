"""The loss lines of a published MiniMax-H3 trainer, re-typed for the parity test (test helpers, not tests):
AviadDahan/MiniMax-H3-Trainer at commit 3b739f70d2a61b8b65ece20a576c8252eba35326, src/h3_trainer/flow_matching.py
(shift_sigma, timestep_from_sigma, add_noise, velocity_target, flow_matching_loss, audio_loss_weight),
src/h3_trainer/packing.py (assemble: the layout, the rows at their timesteps) and
src/h3_trainer/training_strategies/flexible.py (compute_loss: the video's mean squared error plus the audio's, the
audio's weight 0 for an all-zero placeholder track). Its first-frame (i2v / fl2va) lines too: packing.py's
_prepend_conditions / noise_condition_rows / row_timesteps / loss_masks, flow_matching_loss's row_mask, and
preprocessing/encoders.py's encode_visual_condition and encode_prompt / _run_conditioner (the keyframe's latent and
the presentation). Its layout builders are diffusers' (a pinned commit's
`packing` module; in diffusers 0.42.1 the same functions are MiniMaxH3PrepareLayoutStep.build_packed_sequence and
MiniMaxH3SetTimestepsStep.build_row_timesteps). Written from reading it, in this project's words."""

from __future__ import annotations

import torch

VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # its constants.DEFAULT_VIDEO_SHIFT / DEFAULT_AUDIO_SHIFT
TEXT_TAG, VIDEO_TAG, AUDIO_TAG = 1, 0, 2


def shift_sigma(u, shift: float):
    return shift * u / (1.0 + (shift - 1.0) * u)


def trainer_loss(transformer, u: float, video_rows, audio_rows, text, noise_video, noise_audio, frame_shape, cfg=1.0):
    """One packed sample's loss as the trainer computes it: (loss, the transformer's keyword arguments).
    `video_rows` / `audio_rows`: the clean target rows (rows, channels); `frame_shape` (latent frames, h, w).
    `cfg` > 1: diffusion-pipe's CFG-augmented training (tdrussell/diffusion-pipe 8f83dbf2, models/minimax_h3.py
    FinalLayer: the same sample on the empty caption's embedding without gradient, the two outputs rearranged as
    below) on these lines; the empty caption is no text rows here."""
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
    if cfg > 1:
        bare = dict(kwargs, encoder_hidden_states=text[None, :0])
        positions, token_tags, video_idx, audio_idx, text_idx, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            tags[:0], frames, height, width, audio_rows.shape[0] // 2, (1, 2, 2), 2, AUDIO_TAG, VIDEO_TAG
        )
        bare.update(position_ids=positions, token_tags=token_tags, video_indices=video_idx, audio_indices=audio_idx)
        bare["text_indices"] = text_idx
        bare["timestep"], bare["timestep_indices"] = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            video_idx, audio_idx, 0, 0, 0, float(video_t), float(audio_t), max(float(video_t), 0.999), 1.0
        )
        with torch.no_grad():
            video_out_uncond, audio_out_uncond = transformer(**bare)
        # "raw" velocity from guidance-distilled output and own uncond (diffusion-pipe's two lines)
        prediction_video = (prediction_video + (cfg - 1) * video_out_uncond) / cfg
        prediction_audio = (prediction_audio + (cfg - 1) * audio_out_uncond) / cfg
    video_loss = torch.nn.functional.mse_loss(prediction_video.float(), (video_rows - noise_video)[None].float())
    weight = 1.0 if bool(audio_rows.abs().sum() > 0) else 0.0  # audio_loss_weight
    audio_loss = torch.nn.functional.mse_loss(prediction_audio.float(), (audio_rows - noise_audio)[None].float())
    return video_loss + weight * audio_loss, kwargs


CONDITION_TIMESTEP, KEYFRAME_ENCODE_SEED = 0.999, 42  # its constants (diffusers' keyframe_noise_aug / encode seed)


def trainer_keyframe_rows(vae, frame, latents_mean, latents_std):
    """encode_visual_condition(frame, is_image=True): `frame` (H, W, 3) uint8 -> its patchified keyframe rows."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    pixel_mean = torch.tensor((0.485, 0.456, 0.406)).view(1, -1, 1, 1, 1)  # MINIMAX_H3_PIXEL_MEAN / _STD
    pixel_std = torch.tensor((0.229, 0.224, 0.225)).view(1, -1, 1, 1, 1)
    pixels = torch.from_numpy(frame).permute(2, 0, 1)[None, :, None].float() / 255.0  # frames_to_pixel_tensor
    moments = vae._encode_clip((pixels - pixel_mean) / pixel_std)
    latents = DiagonalGaussianDistribution(moments).sample(
        generator=torch.Generator().manual_seed(KEYFRAME_ENCODE_SEED)
    )
    latents = latents.to(torch.float16).float().cpu()
    mean, std = torch.tensor(latents_mean).view(1, -1, 1, 1, 1), torch.tensor(latents_std).view(1, -1, 1, 1, 1)
    return patchify_video_latents((latents - mean) / std, (1, 2, 2)).contiguous()


def trainer_prompt(text_encoder, tokenizer, image_processor, prompt, images):
    """encode_prompt + _run_conditioner: (layer-50 rows, row tags) of the prompt after its keyframes. Its
    processor.create_mm_token_type_ids is Qwen3VLProcessor's: 1 where the token is the image pad, 2 the video pad."""
    vision = image_processor(images=images, return_tensors="pt")
    pixel_values, image_grid_thw = vision["pixel_values"], vision["image_grid_thw"]
    merge_size = image_processor.merge_size**2
    token_ids, token_tags = [], []
    for index in range(len(images)):
        num_image_tokens = int(image_grid_thw[index].prod()) // merge_size
        label_ids = tokenizer(f"<Picture {index + 1}>: ", add_special_tokens=False)["input_ids"]
        vision_ids = (
            [tokenizer.convert_tokens_to_ids("<|vision_start|>")]
            + [tokenizer.convert_tokens_to_ids("<|image_pad|>")] * num_image_tokens
            + [tokenizer.convert_tokens_to_ids("<|vision_end|>")]
        )
        token_ids += label_ids + vision_ids
        token_tags += [TEXT_TAG] * len(label_ids) + [VIDEO_TAG] * len(vision_ids)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    token_ids += prompt_ids
    token_tags += [TEXT_TAG] * len(prompt_ids)
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    image, video = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    mm_token_type_ids = (input_ids == image).long() + 2 * (input_ids == video).long()
    outputs = text_encoder.model(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=mm_token_type_ids,
        pixel_values=pixel_values.to(text_encoder.dtype),
        image_grid_thw=image_grid_thw,
        use_cache=False,
        output_hidden_states=True,
    )
    return outputs.hidden_states[50][0], torch.tensor(token_tags, dtype=torch.long)


def trainer_fl2va_loss(
    transformer, u, video_rows, audio_rows, text, tags, keyframe_rows, noise_video, noise_audio, noise_keyframe, shape
):
    """One first-frame sample's loss as the trainer computes it (prepare with a first_frame condition at probability
    1, assemble, compute_loss): (loss, the transformer's keyword arguments). flow_matching_loss's row_mask as commit
    7b624a15 fixed it (the mask selects the prediction's target rows; at 3b739f70 it indexed the target, which holds
    no keyframe rows, too: an IndexError on every keyframe step, so that commit could not train first frames). Its _prepend_conditions draws the
    keyframe's noise from the step's generator; here it is given (`noise_keyframe`), as the other noises are."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
    )

    sigma_video, sigma_audio = shift_sigma(u, VIDEO_SHIFT), shift_sigma(u, AUDIO_SHIFT)
    video_t, audio_t = 1.0 - sigma_video, 1.0 - sigma_audio
    frames, height, width = shape
    positions, token_tags, video_idx, audio_idx, text_idx, conditions, _ = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            tags, frames, height, width, audio_rows.shape[0] // 2, (1, 2, 2), 2, AUDIO_TAG, VIDEO_TAG, ("first",)
        )
    )
    noisy_video = (1.0 - sigma_video) * video_rows + sigma_video * noise_video
    noisy_audio = (1.0 - sigma_audio) * audio_rows + sigma_audio * noise_audio
    sigma_condition = 1.0 - float(CONDITION_TIMESTEP)  # noise_condition_rows
    held = (1.0 - sigma_condition) * keyframe_rows + sigma_condition * noise_keyframe
    video = torch.cat([held, noisy_video], dim=0)[None]  # _prepend_conditions
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_idx,
        audio_idx,
        conditions,
        0,
        text.shape[0],
        float(video_t),
        float(audio_t),
        max(float(video_t), CONDITION_TIMESTEP),
        1.0,
    )
    kwargs = dict(
        hidden_states=video,
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
    video_mask = torch.ones(video_idx.numel(), dtype=torch.bool)  # loss_masks
    video_mask[:conditions] = False
    target = (video_rows - noise_video)[None].float()  # the target rows alone (clean_video, noise_video)
    video_loss = torch.nn.functional.mse_loss(prediction_video.float()[..., video_mask, :], target)
    weight = 1.0 if bool(audio_rows.abs().sum() > 0) else 0.0
    audio_loss = torch.nn.functional.mse_loss(prediction_audio.float(), (audio_rows - noise_audio)[None].float())
    return video_loss + weight * audio_loss, kwargs
