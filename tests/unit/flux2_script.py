"""What the FLUX.2 [klein] and [dev] parity tests share: the loss lines of diffusers' FLUX.2 DreamBooth examples
(train_dreambooth_lora_flux2_klein.py, train_dreambooth_lora_flux2.py), recomputed with diffusers' own pieces, and
the two checks both models pass the same way.

The examples differ only in the pipeline class (whose static helpers patchify, pack and unpack), how the prompt is
encoded (klein: Flux2KleinPipeline.encode_prompt; dev: Flux2Pipeline.encode_prompt with its text_encoder_out_layers)
and whether the guidance embedding is fed (--guidance_scale, dev only).
"""

from __future__ import annotations

import torch

from dstune.families.randomness import per_sample_randn
from dstune.spec.models import SampleSpec
from edit_script import Recorder, check_source_conditions_the_loss, script_loss, script_timesteps
from tiny_batches import shape_batch

CASES = {  # (dstune settings, the examples' flags): their defaults (uniform u: --weighting_scheme none), then others
    "script-defaults": (dict(timestep_sampling="uniform"), dict(weighting_scheme="none")),
    "logit-normal": (dict(timestep_sampling="logit_normal"), dict(weighting_scheme="logit_normal")),
}

# what the transformer is given, compared between dstune and the example (edit_script.check_same_denoiser_inputs)
DENOISER_INPUTS = dict(
    exact=("img_ids", "txt_ids", "timestep", "guidance", "return_dict"),
    close=("hidden_states", "encoder_hidden_states"),
)


def reference_times(img_ids: torch.Tensor) -> list[set]:
    """Per sample, the time coordinates of the reference's tokens (the second half of a pair's image tokens)."""
    return [set(t.unique().tolist()) for t in img_ids[:, img_ids.shape[1] // 2 :, 0]]


def flux2_script_loss(
    built,
    pipeline_class,
    prompt_pipeline,
    encode_kwargs: dict,
    pixels: torch.Tensor,
    captions: list[str],
    flags: dict,
    u: torch.Tensor,
    draws: tuple,
    cond_pixels: torch.Tensor | None = None,
    denoiser=None,
    reference_per_sample_time: bool = False,
) -> torch.Tensor:
    """The example's loss on `pixels` / `captions` at dstune's u and noise draws (`draws`: seed, step, indices):
    the posterior's mode patchified and normalised with the VAE's batch-norm statistics, _prepare_latent_ids,
    _pack_latents, the scheduler copy's tables, timestep / 1000, guidance = flags["guidance_scale"] (None when the
    flag is absent), the output cut to the image tokens, _unpack_latents_with_ids, compute_loss_weighting_for_sd3.
    With `cond_pixels` (image-to-image: train_dreambooth_lora_flux2_img2img.py / ..._klein_img2img.py), their mode
    patchified and normalised the same way, packed after the noisy target's tokens with
    _prepare_image_ids([cond_model_input[0:1]]) expanded over the batch (the klein script), or with
    `reference_per_sample_time` as the dev script: _prepare_image_ids of the batch's references as a list, viewed per
    sample, which gives sample b's reference the time coordinate 10 * (b + 1). `denoiser` stands for the transformer
    (a Recorder of it)."""
    vae = built.vae
    bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
    bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    with torch.no_grad():
        model_input = vae.encode(pixels).latent_dist.mode()
        prompt_embeds, text_ids = prompt_pipeline.encode_prompt(
            prompt=list(captions), max_sequence_length=512, **encode_kwargs
        )
    model_input = (pipeline_class._patchify_latents(model_input) - bn_mean) / bn_std
    model_input_ids = pipeline_class._prepare_latent_ids(model_input)
    noise = per_sample_randn(model_input.shape[1:], *draws, "noise")
    timesteps, sigmas = script_timesteps(built.folder, u, model_input.ndim)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    packed = pipeline_class._pack_latents(noisy)
    target_tokens, target_ids = packed.shape[1], model_input_ids
    if cond_pixels is not None:
        with torch.no_grad():
            cond_model_input = vae.encode(cond_pixels).latent_dist.mode()
        cond_model_input = (pipeline_class._patchify_latents(cond_model_input) - bn_mean) / bn_std
        batch = cond_model_input.shape[0]
        if reference_per_sample_time:
            each = [cond_model_input[i].unsqueeze(0) for i in range(batch)]
            cond_ids = pipeline_class._prepare_image_ids(each).view(batch, -1, model_input_ids.shape[-1])
        else:
            cond_ids = pipeline_class._prepare_image_ids([cond_model_input[0:1]]).expand(batch, -1, -1)
        packed = torch.cat([packed, pipeline_class._pack_latents(cond_model_input)], dim=1)
        model_input_ids = torch.cat([model_input_ids, cond_ids], dim=1)
    guidance = (
        None if "guidance_scale" not in flags else torch.full([1], flags["guidance_scale"]).expand(model_input.shape[0])
    )
    with torch.no_grad():
        model_pred = (denoiser or built.trainable)(
            hidden_states=packed,
            timestep=timesteps / 1000,
            guidance=guidance,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=model_input_ids,
            return_dict=False,
        )[0]
    model_pred = pipeline_class._unpack_latents_with_ids(model_pred[:, :target_tokens], target_ids)
    return script_loss(model_pred, noise, model_input, sigmas, flags["weighting_scheme"])


def check_cached_text_trains_like_encoded_text(built) -> None:
    batch = shape_batch([4, 7])
    cached = {**batch, **built.encode_text(batch["caption"])}
    assert cached["encoder_hidden_states"].shape == (2, 512, 96)
    with torch.no_grad():
        encoded = built.loss(built.trainable, built.encode_batch(batch), 0, 1)
        from_cache = built.loss(built.trainable, built.encode_batch(cached), 0, 1)
    assert from_cache.item() == encoded.item()


def check_sample_and_export_reload(built, pipeline_class, guidance: float, out_dir) -> None:
    """Samples render at 32 px; the export loads in `pipeline_class` with the trained weights and renders."""
    images = built.sample(built.trainable, ["a red circle"], SampleSpec(prompts=["x"], steps=2, guidance=guidance), 32)
    assert [image.size for image in images] == [(32, 32)]
    state = {k: v + 0.01 for k, v in built.trainable.state_dict().items()}
    reloaded = pipeline_class.from_pretrained(built.export(state, out_dir / "export"))
    name = next(iter(state))
    assert torch.equal(reloaded.transformer.state_dict()[name], state[name])
    assert reloaded(prompt="a red circle", height=32, width=32, num_inference_steps=2).images[0].size == (32, 32)


def reference_batch(indices: list[int]) -> dict:
    """shape_batch with a reference image per target (another shape), as data.control_dir gives it."""
    from dstune.builtin.common import to_tensor
    from dstune.data.synthetic import render_shape

    return {**shape_batch(indices), "control_values": to_tensor([render_shape(i + 100, 32)[0] for i in indices])}


def check_reference_conditions_the_loss(built) -> None:
    """Another reference gives another loss; cached reference latents give the same loss as encoded ones; the
    reference's tokens reach the transformer after the target's with the pipeline's reference ids (time 10)."""
    check_source_conditions_the_loss(built, reference_batch)
    recording = Recorder(built.trainable)
    with torch.no_grad():
        built.loss(recording, built.encode_batch(reference_batch([4, 7])), 0, 1)
        built.loss(recording, built.encode_batch(shape_batch([4, 7])), 0, 1)
    (with_reference, ids), (alone, alone_ids) = [(c["hidden_states"].shape[1], c["img_ids"]) for c in recording.calls]
    assert with_reference == 2 * alone and torch.equal(ids[:, :alone], alone_ids)
    assert set(ids[:, alone:, 0].unique().tolist()) == {10} and set(alone_ids[..., 0].unique().tolist()) == {0}
