"""Wan 2.1 / 2.2's training step (its card: dstune.models.wan.card): a video model whose latents carry frames, with
two experts (Wan 2.2 A14B) and first-frame conditioning (dstune.models.wan.i2v).
- latents: clips (B, 3, frames, H, W) in [-1, 1] through the causal 3D VAE (AutoencoderKLWan) into
  (B, z_dim, 1 + (frames - 1) / 4, H / 8, W / 8), normalised per channel with the VAE config's latents_mean /
  latents_std (as WanPipeline un-normalises them before decoding); the transformer's patch_size (1, 2, 2) cuts them
  into tokens;
- text: WanPipeline.encode_prompt, UMT5's last hidden states of the caption's own tokens, zero-padded to
  max_sequence_length;
- tables: a FlowMatchEulerDiscreteScheduler with the model's shift (UniPC's flow_shift, the scheduler Wan ships with,
  or FlowMatchEuler's shift; model.shift replaces it);
- experts: `transformer` for the timesteps at or above boundary_ratio x 1000, `transformer_2` below; a run trains
  one (model.expert) on its own range of the tables (narrowed by model.timestep_range); the other is read from the
  folder only while samples render;
- conditioning: image-to-video (Wan 2.1 I2V, Wan 2.2 I2V A14B) and Wan 2.2 TI2V (expand_timesteps), per the
  folder's configs (dstune.models.wan.layouts, model.image_to_video): dstune.models.wan.i2v.
The loss is the velocity loss of Wan's trainers (no preconditioning).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Optional

import torch

from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component
from dstune.families.flow_model import FlowModel
from dstune.hf import quiet_hf_libraries
from dstune.models.wan import i2v
from dstune.models.wan.card import folder_mode
from dstune.spec.video_models import expert_range


def train_tables(scheduler_config, shift: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(timesteps, sigmas, shift) that u indexes: a FlowMatchEulerDiscreteScheduler with `shift`, or the folder
    scheduler's own (UniPC's flow_shift; FlowMatchEuler's shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if shift is None:
        shift = (
            scheduler_config.get("flow_shift")
            if "flow_shift" in scheduler_config
            else scheduler_config.get("shift", 1.0)
        )
    table = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=scheduler_config.get("num_train_timesteps", 1000), shift=float(shift)
    )
    return table.timesteps.clone().float(), table.sigmas.clone().float(), float(shift)


class Wan(FlowModel):
    other_expert: Optional[torch.nn.Module] = None  # two experts: the untrained one, only while samples render

    # ------------------------------------------------------------------------------------- loading

    def scheduler_class(self):
        """The scheduler the folder lists (UniPC): its flow_shift is the training tables' shift."""
        import diffusers

        return getattr(diffusers, self.model_index["scheduler"][1])

    def trained_component(self) -> str:
        return "transformer_2" if self.model_spec.expert == "low_noise" else "transformer"

    def other_component(self) -> str:
        return "transformer" if self.trained_component() == "transformer_2" else "transformer_2"

    def load_text_encoders(self) -> tuple[dict, dict]:
        """UMT5 loaded in the frozen dtype (keeping the modules transformers keeps in float32), and its tokenizer."""
        import transformers

        loader = transformers.UMT5EncoderModel.from_pretrained
        encoder = self.place_text(
            load_component(self.folder, "text_encoder", loader, torch_dtype=self.frozen_dtype), None
        )
        tokenizer = load_component(self.folder, "tokenizer", transformers.AutoTokenizer.from_pretrained)
        return {"text_encoder": encoder}, {"tokenizer": tokenizer}

    def load_parts(self) -> dict:
        """This run's mode (the folder's layout, image-to-video or not) and the image encoder it reads, if any."""
        self.mode = folder_mode(self.folder, self.model_spec.image_to_video)
        return i2v.image_parts(self)

    def train_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return train_tables(dict(self.scheduler.config), self.model_spec.shift)[:2]

    def training_positions(self) -> tuple[int, int]:
        """(first table position, count) of the timesteps a run trains on: the expert's side of the boundary
        (WanPipeline runs `transformer` at t >= boundary_ratio x num_train_timesteps and `transformer_2` below),
        narrowed by model.timestep_range. The tables descend from 1000, so they are one contiguous run."""
        settings, timesteps = self.model_spec, self.train_timesteps
        total = self.scheduler.config.num_train_timesteps
        low, high, inclusive = expert_range(self.model_index, settings.expert, settings.timestep_range, total)
        inside = (timesteps >= low) & ((timesteps <= high) if inclusive else (timesteps < high))
        if not inside.any():
            raise FamilyError(
                f"no training timestep of the shifted table falls in model.timestep_range {list(settings.timestep_range)} "
                f"(the tables' timesteps: {timesteps.min():.1f} to {timesteps.max():.1f}); widen it"
            )
        return int(inside.nonzero()[0]), int(inside.sum())

    # ------------------------------------------------------------------------------------- the step

    def encode_text(self, captions: list[str], **inputs) -> dict[str, torch.Tensor]:
        """{"encoder_hidden_states": (B, max_sequence_length, d_model)} from WanPipeline.encode_prompt."""
        with torch.no_grad(), quiet_hf_libraries():
            embeds, _ = self.pipeline().encode_prompt(
                list(captions),
                do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
                device=self.device,
            )
        return {"encoder_hidden_states": embeds}

    def latent_patch(self) -> tuple[int, int]:
        return tuple(self.transformer_config["patch_size"][1:])

    def spatial_factor(self) -> int:
        return self.vae.config.scale_factor_spatial

    def encode_conditions(self, batch: dict, dtype) -> dict:
        return i2v.encode_conditions(self, batch, dtype)

    def condition_tensors(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        return i2v.condition_tensors(self, pixels)

    def model_conditions(self, encoded: dict, dtype) -> dict:
        return i2v.model_inputs(self, encoded, dtype)

    def clean_frames(self) -> int:
        return i2v.clean_frames(self)

    def predict(self, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
        hidden, timestep, extra, _ = i2v.transformer_inputs(self, noisy, timesteps, conditions)
        return forward(
            hidden_states=hidden.to(dtype),
            timestep=timestep.to(dtype),
            encoder_hidden_states=conditions["encoder_hidden_states"].to(dtype),
            return_dict=False,
            **{k: v.to(dtype) for k, v in extra.items()},
        )[0]

    # ------------------------------------------------------------------------------------- samples

    def sample_scheduler(self):
        return self.scheduler

    def side_multiple(self) -> int:
        return self.vae.config.scale_factor_spatial * self.transformer_config["patch_size"][1]

    def sample_sources(self, sample_spec, prompts: list[str]):
        return i2v.sample_sources(self, sample_spec, prompts)

    def sample_inputs(self, text_pipeline, prompt: str, source, sample_spec, side: int) -> dict:
        return i2v.sample_inputs(self, text_pipeline, prompt, source, sample_spec)

    def pipeline_class_and_parts(self, transformer) -> tuple[type, dict]:
        """WanPipeline (WanImageToVideoPipeline for image-to-video samples) and its arguments: with two experts the
        trained one sits in its own slot and the other beside it."""
        cls, extra = i2v.pipeline_class(self, transformer)
        experts = {"transformer": transformer}
        if transformer is not None and self.other_expert is not None:
            experts = {self.trained_component(): transformer, self.other_component(): self.other_expert}
        return cls, {**experts, "boundary_ratio": self.model_index.get("boundary_ratio"), **extra}

    @contextlib.contextmanager
    def experts_loaded(self):
        """With two experts, the untrained one read from the folder onto the device for the duration (samples run
        both, each on its side of the boundary), then released: it is never held while training steps run."""
        if self.model_spec.expert is None:
            yield
            return
        from diffusers import WanTransformer3DModel

        loader = WanTransformer3DModel.from_pretrained
        other = load_component(self.folder, self.other_component(), loader, torch_dtype=self.frozen_dtype)
        self.other_expert = other.eval().requires_grad_(False).to(self.device)
        try:
            yield
        finally:
            self.other_expert = None
            gc.collect()
