"""The flow-matching core (`model.family flow` for images, `video` for clips): `FlowModel`, the base class of every
flow-matching model's class (models/<unit>/model.py, one level below it), and what they share.

Latents are (B, C, H, W) for images and (B, C, F, H, W) for clips: frames are a dimension of the latents, and every
step below works on either. The loss is the one of diffusers' flow-matching training examples: sample u with
compute_density_for_timestep_sampling (uniform, logit_normal, mode), index the timestep and sigma tables with it
(one expert's range of them with two experts), x_t = (1 - sigma) x0 + sigma noise (what the scheduler's scale_noise
computes), target noise - x0 (or x0, precondition_outputs), weighting none / sigma_sqrt / cosmap. Every draw of a
sample (VAE posterior, noise, u) comes from its own generator seeded by (train.seed, optimizer step, dataset index,
purpose), so results do not depend on the rank count.

A model's class sets nothing but what differs: it reads its constants from its card (`self.card`, a FlowCard or
VideoCard) and overrides the methods below where its reference trainer differs. The methods, in the order a run
calls them:

    load(card, model_spec, folders, ...)     the folder checked by the card, then the parts: load_transformer,
                                             load_text_encoders (or load_tokenizers), load_parts, train_tables
    encode_batch(batch, dtype)               the posterior, encode_text (cached text as stored), encode_conditions
    loss(forward, encoded, seed, step)       model_latents -> draw_sigmas -> noisy -> predict -> flow_error
    sample(module, prompts, sample_spec, resolution)    the model's own pipeline around the live transformer
    export(state_dict, out_dir)              a pipeline folder with the trained transformer
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ClassVar, Optional

import torch

from dstune.families.base import FamilyError, TrainedModel
from dstune.families.denoiser_facts import TEXT_PARTS, PipelineFolder
from dstune.families.diffusion import (
    batch_field,
    export_pipeline_folder,
    load_component,
    load_trainable,
    block_checkpoint,
    vae_posterior,
)
from dstune.families.flow_distilled import attach_sampling_denoiser, fuse_training_adapter
from dstune.families.flow_matching import flow_loss_per_sample, loss_weights, timestep_density
from dstune.families.flow_sampling import render
from dstune.families.loss_terms import base_prediction, batch_loss, loss_terms, preserved_error, preserves
from dstune.families.folders import is_modular, read_model_index
from dstune.families.modular import modular_pipeline
from dstune.families.lean_text import make_lean
from dstune.families.pipeline_card import PipelineCard
from dstune.families.precision import compute_dtype
from dstune.families.quantized_base import load_quantized_transformer
from dstune.families.randomness import per_sample_randn
from dstune.families.samples import save_clip_grid, save_grid
from dstune.families.text_offload import place_text_encoder
from dstune.hf import quiet_hf_libraries


def vae_spatial_factor(vae_config) -> int:
    """Pixels per latent along a side: 2 per down block of an AutoencoderKL, 2 per temporal-downsample entry (one per
    down stage) of a video-style VAE."""
    if getattr(vae_config, "temperal_downsample", None) is not None:
        return 2 ** len(vae_config.temperal_downsample)
    return 2 ** (len(vae_config.block_out_channels) - 1)


def normalised_latents(vae_config, latents: torch.Tensor) -> torch.Tensor:
    """The VAE sample in the transformer's scale: per channel (latents_mean, latents_std) where the VAE states them
    (a video-style VAE's), else (sample - shift_factor) * scaling_factor."""
    means = getattr(vae_config, "latents_mean", None)
    if means is not None:
        shape = (1, len(means)) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(means, dtype=latents.dtype, device=latents.device).view(shape)
        std = torch.tensor(vae_config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
        return (latents - mean) / std
    return (latents - (getattr(vae_config, "shift_factor", None) or 0.0)) * vae_config.scaling_factor


def folder_train_tables(scheduler, shift) -> tuple[torch.Tensor, torch.Tensor]:
    """The timestep and sigma tables u indexes, as the scripts take them from a fresh scheduler: shifted by the
    config's shift, except with dynamic shifting, where the scripts train on unshifted sigmas. model.shift
    replaces either with a fixed shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if shift is not None:
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            scheduler.config, shift=shift, use_dynamic_shifting=False
        )
    return scheduler.timesteps.clone().float(), scheduler.sigmas.clone().float()


def noisy_at(latents: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma shaped to broadcast over the latents, x_t = (1 - sigma) x0 + sigma noise)."""
    sigmas = sigma.view(-1, *(1,) * (latents.ndim - 1))
    return sigmas, (1.0 - sigmas) * latents + sigmas * noise


class FlowModel(TrainedModel):
    """A flow-matching model loaded for training (see the module docstring). `trainable` is the transformer (the
    only part DeepSpeed wraps); the VAE, the text encoders and `parts` (frozen modules a model adds) are its frozen
    companions on `device`."""

    card: PipelineCard
    supports_lora: ClassVar[bool] = True
    samples_with_another_denoiser: ClassVar[bool] = True  # sample.pretrained, model.training_adapter

    def __init__(self, card: PipelineCard, model_spec, folder: Path, device, frozen_dtype: torch.dtype):
        self.card, self.model_spec, self.folder = card, model_spec, Path(folder)
        self.device, self.frozen_dtype = torch.device(device), frozen_dtype
        self.model_index = read_model_index(self.folder)
        self.parts: dict = {}  # frozen pipeline parts a model adds (an image encoder, a processor)
        self.sampling_denoiser = None  # flow_distilled.SamplingDenoiser: samples use another transformer
        # the ranks each sample's tokens are split over (deepspeed.sequence_parallel_size; set by split_plan)
        self.sequence_split = 1
        # text encoders loaded on one rank per node and dropped after the text cache (text_encoders then maps each
        # name to None): sample prompt (and the negative) -> its cached text tensors, which samples render from
        self.prompt_text: dict = {}

    @property
    def modality(self) -> str:
        return "video" if self.card.family == "video" else "image"

    @property
    def sound_rate(self) -> Optional[int]:
        """The sample rate (Hz) the dataset reads each clip's sound at; None: the model trains on no sound."""
        return None

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        modules = {name: part for name, part in self.parts.items() if isinstance(part, torch.nn.Module)}
        text = {name: encoder for name, encoder in self.text_encoders.items() if encoder is not None}
        return {"vae": self.vae, **text, **modules}

    # ------------------------------------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        card: PipelineCard,
        model_spec,
        folders: dict,
        device,
        frozen_dtype: torch.dtype = torch.float32,
        zero3_config: Optional[dict] = None,
        text_encoders: bool = True,
    ) -> "FlowModel":
        """Load `model_spec.pretrained` (its folder checked by the card first: every problem at once): the
        transformer fp32 in host memory (the start-up casts and moves it; partitioned with `zero3_config`), the
        frozen parts in `frozen_dtype`. Without `text_encoders` (a rank that reads only cached text:
        dstune.text_once) the text encoders are only named (None). Never downloads."""
        folder = Path(folders["pretrained"])
        problems = card.folder_problems(folder, model_spec)
        problems += [f"{key}: {message}" for key, message in card.settings_issues(model_spec)]
        if problems:
            raise FamilyError(
                f"{folder} cannot be used as a {card.name} pipeline ({card.pipeline_class}, model.family "
                f"{card.family}):\n" + "\n".join(f"  - {p}" for p in problems)
            )
        model = cls(card, model_spec, folder, device, frozen_dtype)
        model.load_all(zero3_config, text_encoders)
        return model

    def load_all(self, zero3_config: Optional[dict], text_encoders: bool) -> None:
        self.scheduler = load_component(self.folder, "scheduler", self.scheduler_class().from_pretrained)
        self.trainable = self.load_transformer(zero3_config)
        self.transformer_config = dict(self.trainable.config)
        self.vae = self.load_vae()
        if text_encoders:
            self.text_encoders, self.tokenizers = self.load_text_encoders()
            described = PipelineFolder(self.folder, str(self.folder), self.model_index)
            make_lean(self.text_encoders, self.card.hidden_states_read(described))  # the pipeline's reads only
        else:  # named for the pipeline's constructor, which takes None for a part
            self.text_encoders = {name: None for name in TEXT_PARTS if (self.model_index.get(name) or [None])[0]}
            self.tokenizers = self.load_tokenizers()
        self.parts = self.load_parts()
        last = list(self.tokenizers.values())[-1]  # the long-text tokenizer (T5, an LLM's) is listed last
        longest = getattr(last, "tokenizer", last).model_max_length  # a processor holds its tokenizer
        self.max_sequence_length = int(
            self.model_spec.max_sequence_length or min(self.card.default_text_tokens, longest)
        )
        self.train_timesteps, self.train_sigmas = self.train_tables()
        self.positions = self.training_positions()

    def scheduler_class(self):
        """The scheduler class of the training tables (the folder's own, as listed, for a model that trains on its
        tables; FlowMatchEulerDiscreteScheduler here)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler

    def trained_component(self) -> str:
        """The pipeline component this run trains."""
        return "transformer"

    def load_transformer(self, zero3_config: Optional[dict]) -> torch.nn.Module:
        """The trained transformer: fp32, train mode, a training adapter fused in, checkpointing as the spec says."""
        with quiet_hf_libraries():
            import diffusers

        model_class = getattr(diffusers, self.card.transformer_class)
        quantized = getattr(self.model_spec, "transformer_file", None)  # LoRA only: a frozen base read quantized
        component = self.folder / self.trained_component()
        transformer = (
            load_quantized_transformer(model_class, model_class.load_config(component), quantized, self.card)
            if quantized
            else load_trainable(self.folder, self.trained_component(), model_class, zero3_config)
        )
        if getattr(self.model_spec, "training_adapter", None):  # fused into the frozen base, before the run's adapters
            fuse_training_adapter(transformer, self.model_spec.training_adapter)
        if self.model_spec.gradient_checkpointing:
            transformer.enable_gradient_checkpointing(
                gradient_checkpointing_func=block_checkpoint(self.model_spec.activation_offload)
            )
        return transformer.train().requires_grad_(not quantized)  # stored bytes (int8) cannot require grad

    def load_vae(self) -> torch.nn.Module:
        with quiet_hf_libraries():
            import diffusers

        loader = getattr(diffusers, self.card.vae_class).from_pretrained
        vae = load_component(self.folder, "vae", loader, torch_dtype=self.frozen_dtype).to(self.device)
        return vae.eval().requires_grad_(False)

    def load_text_encoders(self) -> tuple[dict, dict]:
        """The text encoders the card lists (frozen, eval, the frozen dtype, on the device) and the tokenizers."""
        import transformers

        encoders = {}
        for name, expected in self.card.components.items():
            if name.startswith("text_encoder") and expected is not None:
                loader = getattr(transformers, expected).from_pretrained
                encoders[name] = self.place_text(load_component(self.folder, name, loader), self.frozen_dtype)
        return encoders, self.load_tokenizers()

    def place_text(self, module: torch.nn.Module, dtype: Optional[torch.dtype]) -> torch.nn.Module:
        """A loaded text encoder (or text connector) frozen in `dtype` (None: as loaded) on the device, or with
        model.text_encoder_offload in host memory, run layer by layer on the device (dstune.families.text_offload)."""
        offload = getattr(self.model_spec, "text_encoder_offload", "none")
        return place_text_encoder(module, self.device, dtype, offload)

    def load_tokenizers(self) -> dict:
        """The card's tokenizers (a processor where the folder lists one, as the pipeline loads it: its
        encode_prompt may call the processor's apply_chat_template): all a rank that loads no text encoder keeps
        of the text side."""
        import transformers

        tokenizers = {}
        for name, expected in self.card.components.items():
            if name.startswith("tokenizer") and expected is None:
                listed = str((self.model_index.get(name) or [None, ""])[-1])
                loader = transformers.AutoProcessor if listed.endswith("Processor") else transformers.AutoTokenizer
                tokenizers[name] = load_component(self.folder, name, loader.from_pretrained)
        return tokenizers

    def load_parts(self) -> dict:
        """Frozen pipeline parts beside the VAE and the text encoders (an image encoder, a processor); none here."""
        return {}

    def train_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The timestep and sigma tables u indexes (model.shift applied when given)."""
        return folder_train_tables(self.scheduler, self.model_spec.shift)

    def training_positions(self) -> tuple[int, int]:
        """(first table position, how many) this run trains on: all of them here."""
        return 0, len(self.train_sigmas)

    # ------------------------------------------------------------------------------------------------ encoding

    def pipeline(self, transformer=None, vae=None, scheduler=None):
        """The model's diffusers pipeline around the loaded parts (references, no copies); without transformer and
        VAE it is the text side only, which is all encode_prompt needs."""
        with quiet_hf_libraries():
            pipeline_class, extra = self.pipeline_class_and_parts(transformer)
            components = {
                "transformer": transformer,
                "vae": vae,
                "scheduler": scheduler or self.scheduler,
                **self.text_encoders,
                **self.tokenizers,
                **extra,
            }
            if is_modular(self.folder):  # its blocks over these parts (dstune.families.modular)
                return modular_pipeline(self.folder, components)
            pipeline = pipeline_class(**components)
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def pipeline_class_and_parts(self, transformer) -> tuple[type, dict]:
        """(the pipeline class, its constructor arguments beyond the transformer, VAE, scheduler and text side)."""
        import diffusers

        return getattr(diffusers, self.card.pipeline_class), self.parts

    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        """The card's text tensors of `captions` (each (B, ...)), through the pipeline's own encode_prompt; `inputs`
        are what the conditions add (an edit model's source images)."""
        raise NotImplementedError(f"{type(self).__name__} does not encode text")

    def text_tokens(self) -> Optional[int]:
        """Tokens per caption in the cached encoder_hidden_states (None: no fixed length)."""
        return self.max_sequence_length

    def encode_conditions(self, batch: dict, dtype: torch.dtype) -> dict:
        """What the transformer reads beside the text and the noisy latents, from the batch (a source image, a
        first frame): nothing here."""
        return {}

    def text_inputs(self, conditions: dict) -> Optional[dict]:
        """encode_text's extra arguments made of the conditions (the text needs them), or None."""
        return None

    def condition_tensors(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the latent cache stores beside the posterior, from the same pixels (card.latent_cache_key names
        it): nothing here."""
        return {}

    def encode_sound(self, sound: torch.Tensor) -> torch.Tensor:
        """The latents the latent cache stores of the clips' sound (B, channels, samples) at sound_rate: only a model
        that trains on sound (sound_rate not None) has them."""
        raise NotImplementedError(f"{type(self).__name__} trains on no sound")

    def clip_rule(self):
        """A video model's clip length rule (dstune.card.ClipRule: its card's, on this folder): the latent frames the
        data layer expects of a clip's cached latents."""
        return self.card.clip_rule(PipelineFolder(self.folder, str(self.folder), self.model_index))

    def latent_patch(self) -> tuple[int, int]:
        """Latent (rows, columns) per token: the sides must be multiples of them."""
        return 2, 2

    def spatial_factor(self) -> int:
        """Pixels per latent along a side."""
        return vae_spatial_factor(self.vae.config)

    def encode_batch(self, batch: dict, dtype: torch.dtype = torch.float32) -> dict:
        """The frozen encoders' view of a collated batch: the VAE posterior (mean, std; at least float32, unscaled),
        the text tensors (floating ones in `dtype`), the conditions' tensors and the dataset indices. No random draws.
        Cached tensors are used as stored."""
        indices = torch.as_tensor(batch_field(batch, "indices", "index"), dtype=torch.long)
        if "latent_mean" in batch:
            mean, std = batch["latent_mean"].to(self.device).float(), batch["latent_std"].to(self.device).float()
        else:
            pixels = batch_field(batch, "pixel_values").to(self.device, self.vae.dtype)
            mean, std = vae_posterior(self.vae, pixels, self.card.pixel_range())
        self._check_latent_layout(mean)
        conditions = self.encode_conditions(batch, dtype)
        text_inputs = self.text_inputs(conditions)
        if text_inputs is None and all(name in batch for name in self.card.text_tensors):
            text = {name: batch[name].to(self.device) for name in self.card.text_tensors}
            self._check_cached_sequence(text["encoder_hidden_states"].shape[1])
        else:
            text = self.encode_text(list(batch_field(batch, "captions", "caption")), **(text_inputs or {}))
        text = {name: value.to(dtype) if value.is_floating_point() else value for name, value in text.items()}
        terms = loss_terms(batch, mean.shape, self.device)  # masks, the sets' roles and weights (where given)
        return {"latent_mean": mean, "latent_std": std, **text, **conditions, "indices": indices, **terms}

    def _check_cached_sequence(self, tokens: int) -> None:
        """A second guard behind the text cache's key (which holds max_sequence_length): embeddings of the wrong
        length never reach the transformer, whatever wrote them."""
        expected = self.text_tokens()
        if tokens != expected:
            raise ValueError(
                f"the cached text embeddings have {tokens} tokens, but model.max_sequence_length "
                f"{self.max_sequence_length} gives {expected}: they were cached with another "
                "max_sequence_length. Delete data.cache.dir (or choose another) to re-encode them."
            )

    def _check_latent_layout(self, mean: torch.Tensor) -> None:
        """Clips for a video model, images for an image one, and latent sides the transformer's patch divides."""
        clips = self.modality == "video"
        if clips and mean.ndim != 5:
            raise ValueError(
                f"model.family {self.card.family} trains on clips (B, 3, frames, H, W); "
                f"the batch's latents are {tuple(mean.shape)}"
            )
        rows, columns = self.latent_patch()
        if mean.shape[-1] % columns or mean.shape[-2] % rows:
            factor = self.spatial_factor()
            raise ValueError(
                f"{self.card.transformer_class} takes {rows}x{columns} latent patches, so {'clip' if clips else 'image'}"
                f" heights must be multiples of {rows * factor} px and widths of {columns * factor} px; got "
                f"{mean.shape[-1] * factor}x{mean.shape[-2] * factor} (width x height). Change data.resolution (or "
                "buckets)."
            )

    # ------------------------------------------------------------------------------------------------ the step

    def posterior_mean(self) -> bool:
        """Whether the training latents are the VAE posterior's mean (model.vae_latents: mean) rather than a draw
        from it; unset, the model's reference trainer's choice (its card's posterior_mode)."""
        choice = self.model_spec.vae_latents
        return self.card.posterior_mode if choice is None else choice == "mean"

    def to_model_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """A VAE sample in the space noise is added to: normalised by the VAE config's statistics or scale."""
        return normalised_latents(self.vae.config, sample)

    def model_latents(self, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The batch's training latents in model space: the posterior's mean, or a draw from it."""
        mean, std = encoded["latent_mean"], encoded["latent_std"]
        if not self.posterior_mean():
            mean = mean + std * per_sample_randn(mean.shape[1:], seed, step, self.indices(encoded), "vae_posterior").to(
                mean.device
            )
        return self.to_model_latents(mean)

    @staticmethod
    def indices(encoded: dict) -> list[int]:
        return encoded["indices"].tolist()

    def draw_sigmas(self, latents: torch.Tensor, seed: int, step: int, indices: list[int]):
        """(timesteps (B,), sigmas (B,)) of the samples: u (timestep_density) indexes the tables, within the range
        this run trains on; a model whose card says it draws sigma itself draws it (sigma_draw) with timesteps
        sigma x 1000."""
        if self.card.draws_sigma:
            sigma = self.sigma_draw(latents, seed, step, indices).to(latents.device)
            return sigma * 1000, sigma
        first, count = self.positions  # one expert's range of the tables (all of them otherwise)
        positions = (timestep_density(self.model_spec, seed, step, indices) * count).long()
        positions = first + positions.clamp(0, count - 1)  # u == 1.0 (a float32 sigmoid can round up)
        return self.train_timesteps[positions].to(latents.device), self.train_sigmas[positions].to(latents.device)

    def sigma_draw(self, latents: torch.Tensor, seed: int, step: int, indices: list[int]) -> torch.Tensor:
        """Each sample's sigma drawn continuously as the model's reference trainer draws it (card.draws_sigma)."""
        raise NotImplementedError(f"{self.card.name}'s card says it draws sigma itself, but its class draws none")

    def conditions(self, encoded: dict, dtype: torch.dtype) -> dict:
        """What predict is given beside the noisy latents: the text tensors (floating ones in the transformer's
        dtype) and model_conditions."""
        text = {
            name: encoded[name].to(dtype) if encoded[name].is_floating_point() else encoded[name]
            for name in self.card.text_tensors
        }
        return {**text, **self.model_conditions(encoded, dtype)}

    def model_conditions(self, encoded: dict, dtype: torch.dtype) -> dict:
        """The encoded conditions as predict reads them (a source's normalised latents): nothing here."""
        return {}

    def predict(self, forward, noisy: torch.Tensor, timesteps: torch.Tensor, conditions: dict, dtype) -> torch.Tensor:
        """The transformer's velocity for the noisy latents, in the latent layout."""
        raise NotImplementedError(f"{type(self).__name__} does not predict")

    def preconditioned(self) -> bool:
        """Whether the loss compares the x0 the velocity implies (EDM-style) rather than the velocity."""
        return bool(getattr(self.model_spec, "precondition_outputs", False))

    def clean_frames(self) -> int:
        """Leading latent frames given clean (a first frame): outside the loss."""
        return 0

    def flow_error(self, prediction, noisy, latents, noise, sigmas, mask=None) -> torch.Tensor:
        """Each sample's weighted flow-matching error of the latents (B,), over the loss mask where the batch has one;
        the latent frames given clean are not in it."""
        weights = loss_weights(self.model_spec.loss_weighting, sigmas)
        clean = self.clean_frames()
        if clean:  # the first latent frames were given clean: only the frames after them are learned
            prediction, noisy, latents, noise = (t[:, :, clean:] for t in (prediction, noisy, latents, noise))
            mask = None if mask is None else mask[:, :, clean:]  # a clip's mask has the latent frames too
        return flow_loss_per_sample(prediction, noisy, latents, noise, sigmas, weights, self.preconditioned(), mask)

    def loss(self, forward, encoded: dict, seed: int, step: int) -> torch.Tensor:
        """The flow-matching loss of one micro batch (mean over its samples; with data.sets, the roles' weighted
        means: dstune.families.loss_terms); `seed` is train.seed, `step` the optimizer step: with the samples'
        dataset indices they fix every random draw."""
        latents = self.model_latents(encoded, seed, step)
        indices = self.indices(encoded)
        noise = per_sample_randn(latents.shape[1:], seed, step, indices, "noise").to(latents.device)
        timesteps, sigma = self.draw_sigmas(latents, seed, step, indices)
        sigmas, noisy = noisy_at(latents, noise, sigma)
        dtype = compute_dtype(self.trainable)
        conditions = self.conditions(encoded, dtype)
        if preserves(encoded):  # the base model's prediction: the preservation samples' target
            base = base_prediction(self.trainable, lambda: self.predict(forward, noisy, timesteps, conditions, dtype))
        prediction = self.predict(forward, noisy, timesteps, conditions, dtype)
        per_sample = self.flow_error(prediction, noisy, latents, noise, sigmas, encoded.get("loss_mask"))
        if preserves(encoded):
            per_sample = preserved_error(prediction, base, encoded, per_sample)
        return batch_loss(per_sample, encoded)

    # ------------------------------------------------------------------------------------------------ samples

    def sample(self, transformer_module, prompts: list[str], sample_spec, resolution: int) -> list:
        """One image (a video model: one clip, a list of model.sample_frames PIL frames) per prompt with the model's
        own pipeline around `transformer_module` (no weight copy): dstune.families.flow_sampling."""
        return render(self, transformer_module, prompts, sample_spec, resolution)

    def save_samples(self, outputs: list, prompts: list[str], path) -> Path:
        return (save_clip_grid if self.modality == "video" else save_grid)(outputs, prompts, path)

    def sample_scheduler(self):
        """The scheduler samples run with: a FlowMatchEulerDiscreteScheduler of the folder's config."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)

    def side_multiple(self) -> int:
        """Pixels a sample's sides are multiples of: the VAE's factor x 2 (the latent patch)."""
        return vae_spatial_factor(self.vae.config) * 2

    def sample_guidance(self, sample_spec, prompts: list[str]) -> dict:
        """The pipeline call's guidance arguments."""
        return {"guidance_scale": sample_spec.guidance}

    def sample_arguments(self, pipeline, sample_spec, arguments: dict) -> dict:
        """The arguments the pipeline's __call__ takes (one without max_sequence_length, say): as they are here."""
        return arguments

    def sample_sources(self, sample_spec, prompts: list[str]) -> Optional[list]:
        """One source per prompt (an edit model's source image, a first frame), or None: the prompts alone."""
        return None

    def sample_inputs(self, text_pipeline, prompt: str, source, sample_spec, side: int) -> dict:
        """One prompt's pipeline inputs with its source (the sample is side x side pixels)."""
        return {"prompt": prompt, "image": source}

    def experts_loaded(self):
        """What samples need loaded while they render beside the trained transformer (a second expert)."""
        return contextlib.nullcontext()

    def cached_text_arguments(self, pipeline, prompt: dict, negative: dict) -> dict:
        """The pipeline call's arguments in place of `prompt`, from the prompts' cached text tensors (each (B, ...)
        on the device) and those of the negative caption as many times, as the card's cached_text_* fields say."""
        card = self.card
        cached = card.cached_text_arguments

        def rows(tensors: dict) -> dict:
            if card.cached_text_rows == "per_caption":  # each caption's own tokens, unpadded
                mask = tensors["encoder_attention_mask"].bool()
                return {name: [e[m] for e, m in zip(tensors[name], mask)] for name in cached.values()}
            if card.cached_text_rows == "trimmed":  # the tail that is padding in every row cut off
                used = tensors["encoder_attention_mask"].bool().any(dim=0).nonzero()
                keep = int(used.max()) + 1 if len(used) else tensors["encoder_attention_mask"].shape[1]
                return {name: tensors[name][:, :keep] for name in cached.values()}
            return tensors

        prompt, negative = rows(prompt), rows(negative)
        arguments = {argument: prompt[tensor] for argument, tensor in cached.items()}
        if card.cached_text_negative:
            arguments.update({f"negative_{argument}": negative[tensor] for argument, tensor in cached.items()})
        return arguments

    def rendered(self, result):
        """One prompt's output of the pipeline: its image, or a clip's frames."""
        return list(result.frames[0]) if self.modality == "video" else result.images[0]

    def attach_sampling_denoiser(self, folder: Path, model_spec, key: str = "sample.pretrained") -> None:
        """`folder`'s transformer with the run's LoRA layers renders the samples (dstune.families.flow_distilled)."""
        attach_sampling_denoiser(self, folder, model_spec, key)

    # ------------------------------------------------------------------------------------------------ export

    def fresh_transformer(self, state_dict: dict) -> torch.nn.Module:
        with quiet_hf_libraries():
            import diffusers

        transformer = getattr(diffusers, self.card.transformer_class).from_config(self.transformer_config)
        expected, given = set(transformer.state_dict()), set(state_dict)
        missing, unexpected = sorted(expected - given), sorted(given - expected)
        if missing or unexpected:
            raise FamilyError(
                f"the trained weights do not fit the transformer of {self.folder}: {len(missing)} missing "
                f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
            )
        transformer.load_state_dict(state_dict, strict=True)
        return transformer

    def export(self, transformer_state_dict: dict, out_dir, pretrained_folder=None) -> Path:
        """Write a complete diffusers pipeline folder at `out_dir`: the trained transformer (safetensors, loaded
        strictly into a fresh one built from the source config) in its component (an expert's: transformer_2)
        plus the source pipeline's other components copied unchanged. Written beside `out_dir` and renamed into
        place (an older export is replaced only once this one is complete)."""
        source = Path(pretrained_folder) if pretrained_folder is not None else self.folder
        transformer = self.fresh_transformer(transformer_state_dict)
        return export_pipeline_folder(source, out_dir, self.trained_component(), transformer)

    def lora_pipeline_class(self) -> str:
        """Whose save_lora_weights writes the LoRA file: the card's pipeline's."""
        return self.card.pipeline_class

    def save_lora_weights(self, lora_layers: dict, adapter_metadata: dict, folder: Path) -> None:
        """The transformer's LoRA as the model's pipeline class writes it (dstune.families.lora builds the layers;
        a low-noise expert's LoRA loads with the pipeline's load_into_transformer_2=True)."""
        with quiet_hf_libraries():
            import diffusers

            getattr(diffusers, self.lora_pipeline_class()).save_lora_weights(
                folder,
                transformer_lora_layers=lora_layers,
                transformer_lora_adapter_metadata=adapter_metadata,
                safe_serialization=True,
            )

    def split_plan(self, size: int) -> Optional[dict]:
        """The context-parallel plan that splits the transformer's sequences over `size` ranks, after preparing it
        (a model whose diffusers class has none gives its own); None: the class's own plan."""
        self.sequence_split = size
        return self.own_split_plan(size)

    def own_split_plan(self, size: int) -> Optional[dict]:
        return None
