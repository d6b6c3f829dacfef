"""What the UNet models' classes share: `UnetModel`, the base class of every model whose UNet trains in a diffusers
pipeline folder beside a VAE and CLIP text encoders (models/<unit>/model.py one level below it).

The loss is diffusers' examples/text_to_image/train_text_to_image.py (and its variant with pooled text): epsilon or v target,
optional offset noise, optional Min-SNR-gamma weighting. What differs is where randomness comes from: every draw of
a sample (VAE posterior, noise, offset noise, timestep) comes from its own generator, seeded by (train.seed,
optimizer step, dataset index, purpose), so results do not depend on the rank count or the accumulation split. That
is also why encode_batch returns the VAE posterior (mean, std) and the loss draws the latent: encode_batch stays
deterministic (cacheable), and the draw is per sample and per step like the rest.

A model's class says what differs: its text tensors (`encode_text`), what its UNet reads besides
(`added_conditions`, `predict`) and its pipeline's other arguments (`pipeline_extras`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from dstune.families.base import FamilyError, TrainedModel
from dstune.families.diffusion import (
    batch_field,
    export_pipeline_folder,
    inputs_cast_to,
    load_component,
    load_trainable,
    block_checkpoint,
)
from dstune.families.loss_terms import (
    base_prediction,
    batch_loss,
    loss_terms,
    masked_mean,
    preserved_error,
    preserves,
)
from dstune.families.precision import at_least_float32, compute_dtype
from dstune.families.randomness import per_sample_randint, per_sample_randn, sample_generator
from dstune.families.samples import save_grid
from dstune.families.unet_card import UnetCard
from dstune.hf import quiet_hf_libraries


class UnetModel(TrainedModel):
    """A UNet pipeline loaded for training. `trainable` is the UNet (the only part DeepSpeed wraps); the VAE, the
    text encoders and tokenizers and the training noise scheduler are frozen companions on `device`."""

    card: UnetCard
    supports_lora: ClassVar[bool] = True

    def __init__(self, card: UnetCard, model_spec, folder: Path, device):
        self.card, self.model_spec, self.folder, self.device = card, model_spec, Path(folder), torch.device(device)

    @property
    def modality(self) -> str:
        return "image"

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"vae": self.vae, **self.text_encoders}

    # ------------------------------------------------------------------------------------------------ loading

    @classmethod
    def load(cls, card, model_spec, folders: dict, device, frozen_dtype=torch.float32, zero3_config=None, **_):
        """Load `model_spec.pretrained` (its folder checked by the card first: every problem at once). The UNet is
        fp32 in host memory (the start-up casts and moves it), built partitioned with `zero3_config`
        (dstune.families.diffusion.load_trainable); the frozen parts are cast to `frozen_dtype`. Never downloads."""
        from diffusers import AutoencoderKL, UNet2DConditionModel

        folder = folders["pretrained"]
        problems = card.folder_problems(folder, model_spec)
        if problems:
            raise FamilyError(
                f"{folder} cannot be used as a {card.name} model (model.family {card.family}):\n"
                + "\n".join(f"  - {p}" for p in problems)
            )
        model = cls(card, model_spec, folder, device)
        model.noise_scheduler, model.prediction_type = model.training_noise_scheduler()
        # diffusers models get their dtype at load time: ModelMixin.to(dtype) warns on every call (diffusers 0.42)
        unet = load_trainable(folder, "unet", UNet2DConditionModel, zero3_config)
        if model_spec.gradient_checkpointing:
            unet.enable_gradient_checkpointing(
                gradient_checkpointing_func=block_checkpoint(model_spec.activation_offload)
            )
        model.trainable = unet.train().requires_grad_(True)
        model.unet_config = dict(unet.config)  # the export builds a fresh UNet from it
        model.vae = load_component(folder, "vae", AutoencoderKL.from_pretrained, torch_dtype=frozen_dtype)
        model.vae.to(model.device).eval().requires_grad_(False)
        model.text_encoders, model.tokenizers = model.load_text_side(frozen_dtype)
        return model

    def load_text_side(self, dtype: torch.dtype) -> tuple[dict, dict]:
        """({text encoder subfolder: encoder}, {tokenizer subfolder: tokenizer}): every CLIP pair of the card's text
        cache folders, the encoders frozen in `dtype`."""
        import transformers

        encoders, tokenizers = {}, {}
        for name, (classes, _) in self.card.unet_components.items():
            if name.startswith("text_encoder"):
                loader = getattr(transformers, classes[0]).from_pretrained
                encoder = load_component(self.folder, name, loader).to(self.device, dtype)
                encoders[name] = encoder.eval().requires_grad_(False)
            elif name.startswith("tokenizer"):
                tokenizers[name] = load_component(self.folder, name, transformers.CLIPTokenizer.from_pretrained)
        return encoders, tokenizers

    def training_noise_scheduler(self):
        """(the training DDPMScheduler with the resolved prediction type registered, that type): model.prediction,
        else the scheduler's own; epsilon or v_prediction, and no epsilon on a zero-terminal-SNR schedule."""
        from diffusers import DDPMScheduler

        scheduler = load_component(self.folder, "scheduler", DDPMScheduler.from_pretrained)
        prediction_type = self.model_spec.prediction or scheduler.config.prediction_type
        where = self.folder / "scheduler"
        if prediction_type not in ("epsilon", "v_prediction"):
            raise FamilyError(
                f"{where}: prediction_type {prediction_type!r} is not supported; set model.prediction to epsilon or "
                "v_prediction"
            )
        if prediction_type == "epsilon" and float(scheduler.alphas_cumprod[-1]) == 0.0:
            raise FamilyError(
                f"{where} has zero terminal SNR (rescale_betas_zero_snr), where an epsilon-predicting model cannot "
                "denoise its first sampling step (x_T holds no image). Use model.prediction: v_prediction (or leave "
                "it unset)."
            )
        scheduler.register_to_config(prediction_type=prediction_type)
        return scheduler, prediction_type

    # ------------------------------------------------------------------------------------------ the train step

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """The card's text tensors of `captions`, in the text encoders' dtype (what the text cache stores)."""
        raise NotImplementedError

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The frozen encoders' view of a collated batch: the VAE posterior (mean, std; float32, unscaled), the text
        tensors (in `dtype`, the trainable's compute dtype), the added conditions and the samples' dataset indices.
        No random draws. Cached tensors are used as stored; only what is missing is encoded here."""
        indices = torch.as_tensor(batch_field(batch, "indices", "index"), dtype=torch.long)
        if "latent_mean" in batch:
            mean, std = batch["latent_mean"].to(self.device).float(), batch["latent_std"].to(self.device).float()
        else:
            pixels = batch_field(batch, "pixel_values").to(self.device, self.vae.dtype)
            with torch.no_grad():
                posterior = self.vae.encode(pixels).latent_dist
            mean, std = at_least_float32(posterior.mean), at_least_float32(posterior.std)
        if all(name in batch for name in self.card.text_tensors):
            text = {name: batch[name].to(self.device) for name in self.card.text_tensors}
        else:
            text = self.encode_text(list(batch_field(batch, "captions", "caption")))
        text = {name: value.to(dtype) for name, value in text.items()}
        terms = loss_terms(batch, mean.shape, self.device)  # masks, the sets' roles and weights (where given)
        return {"latent_mean": mean, "latent_std": std, **text, **self.added_conditions(batch, mean, dtype)} | {
            "indices": indices,
            **terms,
        }

    def added_conditions(self, batch: dict, mean: torch.Tensor, dtype: torch.dtype) -> dict:
        """What the UNet reads beside the text and the noisy latents (size and crop time ids): nothing here."""
        return {}

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The diffusion loss of one micro batch (mean over its samples). `seed` is train.seed, `step` the optimizer
        step; with the samples' dataset indices they fix every random draw."""
        mean, std = encoded["latent_mean"], encoded["latent_std"]
        indices, shape, device = encoded["indices"].tolist(), tuple(mean.shape[1:]), mean.device

        def draw(purpose: str, size: tuple) -> torch.Tensor:
            return per_sample_randn(size, seed, step, indices, purpose).to(device)

        vae_config = self.vae.config
        latents = mean + std * draw("vae_posterior", shape)
        latents = (latents - (getattr(vae_config, "shift_factor", None) or 0.0)) * vae_config.scaling_factor
        noise = draw("noise", shape)
        if self.model_spec.noise_offset:
            noise = noise + self.model_spec.noise_offset * draw("noise_offset", (shape[0], 1, 1))
        scheduler = self.noise_scheduler
        steps = scheduler.config.num_train_timesteps
        timesteps = per_sample_randint(steps, seed, step, indices, "timestep").to(device)
        noisy = scheduler.add_noise(latents, noise, timesteps)
        target = noise if self.prediction_type == "epsilon" else scheduler.get_velocity(latents, noise, timesteps)
        if preserves(encoded):  # the base model's prediction: the preservation samples' target
            base = base_prediction(self.trainable, lambda: self.predict(forward, noisy, timesteps, encoded))
        prediction = self.predict(forward, noisy, timesteps, encoded)
        error = F.mse_loss(at_least_float32(prediction), at_least_float32(target), reduction="none")
        per_sample = masked_mean(error, encoded.get("loss_mask"))  # the plain mean without a mask
        gamma = self.model_spec.min_snr_gamma
        if gamma:
            per_sample = per_sample * min_snr_weights(scheduler, timesteps, gamma, self.prediction_type)
        if preserves(encoded):  # held to the base's prediction, unweighted by the timestep
            per_sample = preserved_error(prediction, base, encoded, per_sample)
        return batch_loss(per_sample, encoded)

    def predict(self, forward, noisy: torch.Tensor, timesteps: torch.Tensor, encoded: dict) -> torch.Tensor:
        """The UNet's output on the noisy latents, in its parameters' dtype."""
        dtype = compute_dtype(self.trainable)
        hidden = encoded["encoder_hidden_states"].to(dtype)
        return forward(noisy.to(dtype), timesteps, hidden, return_dict=False)[0]

    # ------------------------------------------------------------------------------------------------ samples

    def sample(self, unet_module, prompts: list[str], sample_spec, resolution: int) -> list:
        """One image per prompt from the card's pipeline around `unet_module` (no weight copy) and a DDIM
        scheduler: the side rounded down to a multiple of 8 (the pipeline's requirement), prompt i from the noise
        of (sample_spec.seed, i) so grids of different steps are comparable, the UNet's train/eval mode restored."""
        if not prompts:
            return []
        pipeline = self.pipeline(unet_module)
        pipeline.set_progress_bar_config(disable=True)
        side = max(8, resolution // 8 * 8)
        generators = [sample_generator(sample_spec.seed, 0, number, "sample") for number in range(len(prompts))]
        was_training = unet_module.training
        unet_module.eval()
        try:
            with inputs_cast_to(unet_module, compute_dtype(unet_module)), quiet_hf_libraries():
                result = pipeline(
                    prompt=list(prompts),
                    height=side,
                    width=side,
                    guidance_scale=sample_spec.guidance,
                    num_inference_steps=sample_spec.steps,
                    generator=generators,
                    output_type="pil",
                )
        finally:
            unet_module.train(was_training)
        return result.images

    def pipeline(self, unet_module):
        """The card's pipeline around `unet_module` with this model's frozen parts and a DDIM scheduler."""
        import diffusers

        with quiet_hf_libraries():
            scheduler = diffusers.DDIMScheduler.from_config(self.noise_scheduler.config, set_alpha_to_one=False)
            pipeline_class = getattr(diffusers, self.card.pipeline_class)
        return pipeline_class(
            vae=self.vae,
            unet=unet_module,
            scheduler=scheduler,
            **self.text_encoders,
            **self.tokenizers,
            **self.pipeline_extras(),
        )

    def pipeline_extras(self) -> dict:
        """The pipeline's other constructor arguments."""
        return {}

    def save_samples(self, outputs: list, prompts: list[str], path) -> Path:
        return save_grid(outputs, prompts, path)

    # ------------------------------------------------------------------------------------------------- export

    def fresh_unet(self, state_dict: dict):
        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel.from_config(self.unet_config)
        expected, given = set(unet.state_dict()), set(state_dict)
        missing, unexpected = sorted(expected - given), sorted(given - expected)
        if missing or unexpected:
            raise FamilyError(
                f"the trained weights do not fit the UNet of {self.folder}: {len(missing)} missing "
                f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
            )
        unet.load_state_dict(state_dict, strict=True)
        return unet

    def export(self, state_dict: dict, out_dir, pretrained_folder=None) -> Path:
        """A complete diffusers pipeline folder at `out_dir`: the trained UNet (safetensors, loaded strictly into a
        fresh UNet built from the source config) plus every other component of the source pipeline copied
        unchanged, the trained prediction type recorded in the scheduler config. Written beside `out_dir` and
        renamed into place, replacing an older export only once complete."""
        source = Path(pretrained_folder) if pretrained_folder is not None else self.folder
        return export_pipeline_folder(
            source,
            out_dir,
            "unet",
            self.fresh_unet(state_dict),
            finish=lambda work: record_prediction_type(work / "scheduler", self.prediction_type),
        )

    def save_lora_weights(self, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
        """The UNet's LoRA as the card's pipeline writes it (dstune.families.lora builds the layers, in diffusers
        naming)."""
        import diffusers

        with quiet_hf_libraries():
            getattr(diffusers, self.card.pipeline_class).save_lora_weights(
                folder,
                unet_lora_layers=lora_layers,
                unet_lora_adapter_metadata=adapter_metadata,
                safe_serialization=True,
            )


def clip_states(model: UnetModel, encoder: str, tokenizer: str, captions: list[str]):
    """A CLIP text encoder's output (all hidden states) for `captions`, padded to its context."""
    tokenizer, encoder = model.tokenizers[tokenizer], model.text_encoders[encoder]
    max_length = min(tokenizer.model_max_length, encoder.config.max_position_embeddings)
    token_ids = tokenizer(
        captions, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids.to(model.device)
    with torch.no_grad():
        return encoder(token_ids, output_hidden_states=True)


def min_snr_weights(noise_scheduler, timesteps: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Per-sample Min-SNR-gamma loss weights, as diffusers' train_text_to_image.py computes them; one difference:
    with a zero-terminal-SNR schedule, epsilon's min(snr, gamma) / snr is 0 / 0 at the last timestep, where diffusers
    gives NaN and this gives the limit, 1."""
    from diffusers.training_utils import compute_snr

    snr = compute_snr(noise_scheduler, timesteps)
    weights = torch.stack([snr, gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    if prediction_type == "epsilon":
        return torch.where(snr > 0, weights / snr.clamp_min(torch.finfo(snr.dtype).tiny), torch.ones_like(snr))
    return weights / (snr + 1)


def record_prediction_type(scheduler_dir: Path, prediction_type: str) -> None:
    """Record the trained prediction type, so inference with the export uses the right target."""
    path = scheduler_dir / "scheduler_config.json"
    config = json.loads(path.read_text())
    if config.get("prediction_type") != prediction_type:
        config["prediction_type"] = prediction_type
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
