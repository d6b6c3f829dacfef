"""The Wan 2.1 / 2.2 recipe of the flow-matching core (dstune.families.flow_recipe; model.family wan): a video model
whose latents carry frames, with two experts (Wan 2.2 A14B) and first-frame conditioning (dstune.models.wan.i2v).

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
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Optional

import torch

from dstune.models.wan import layouts as wan_layouts
from dstune.models.wan import i2v as wan_i2v
from dstune.families.base import FamilyError
from dstune.families.diffusion import load_component
from dstune.families.folders import component_problems, read_component_config, read_model_index
from dstune.families.flow_recipe import Conditioning, Experts, FlowRecipe, LatentSpace, Sampling, TextSide
from dstune.hf import quiet_hf_libraries
from dstune.spec.models import VideoModelSpec
from dstune.spec.video_models import expert_problems, expert_range, experts_in

COMPONENTS = {
    "transformer": "WanTransformer3DModel",
    "vae": "AutoencoderKLWan",
    "text_encoder": "UMT5EncoderModel",
    "tokenizer": None,
    "scheduler": None,
}
TEXT_TENSORS = ("encoder_hidden_states",)
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default


# ------------------------------------------------------------------------------------------ the folder


def folder_problems(
    folder: Path, expert: Optional[str] = None, image_to_video: Optional[bool] = None, timestep_range=None
) -> list[str]:
    """Why `folder` is not a Wan pipeline folder dstune trains with model.expert `expert`, model.image_to_video
    `image_to_video` and model.timestep_range (empty: it is)."""
    index = read_model_index(folder)
    problems = expert_problems(index, expert, timestep_range)
    if "transformer_2" in experts_in(index) and not (folder / "transformer_2").is_dir():
        problems.append("model_index.json lists transformer_2 but there is no transformer_2/ subfolder")
    problems += component_problems(folder, index, COMPONENTS)
    if not problems:
        vae, text = read_component_config(folder, "vae"), read_component_config(folder, "text_encoder")
        for name in experts_in(index):
            transformer = read_component_config(folder, name)
            kind, found = wan_layouts.layout(index, transformer, vae)
            problems += [f"{name}: {problem}" for problem in found]
            if transformer.get("text_dim") != text.get("d_model"):
                problems.append(
                    f"{name} text_dim {transformer.get('text_dim')} != {text.get('d_model')} (the text "
                    "encoder's d_model)"
                )
            if kind is not None and not found:
                problem = wan_layouts.image_to_video(kind, image_to_video)[1]
                problems += [problem] if problem and problem not in problems else []
    return problems


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


def _load_text(folder: Path, recipe, device, dtype) -> tuple[dict, dict]:
    """UMT5 loaded in `dtype` (keeping the modules transformers keeps in float32), and its tokenizer."""
    import transformers

    text_encoder = load_component(
        folder, "text_encoder", transformers.UMT5EncoderModel.from_pretrained, torch_dtype=dtype
    ).to(device)
    tokenizer = load_component(folder, "tokenizer", transformers.AutoTokenizer.from_pretrained)
    return {"text_encoder": text_encoder.eval().requires_grad_(False)}, {"tokenizer": tokenizer}


# ------------------------------------------------------------------------------------------ the experts


def expert_positions(timesteps: torch.Tensor, model: VideoModelSpec, index: dict, scheduler_config) -> tuple[int, int]:
    """(first table position, count) of the timesteps a run trains on: the expert's side of the boundary
    (WanPipeline runs `transformer` at t >= boundary_ratio x num_train_timesteps and `transformer_2` below),
    narrowed by model.timestep_range. The tables descend from 1000, so they are one contiguous run."""
    low, high, inclusive = expert_range(index, model.expert, model.timestep_range, scheduler_config.num_train_timesteps)
    inside = (timesteps >= low) & ((timesteps <= high) if inclusive else (timesteps < high))
    if not inside.any():
        raise FamilyError(
            f"no training timestep of the shifted table falls in model.timestep_range "
            f"{list(model.timestep_range)} (the tables' timesteps: {timesteps.min():.1f} to "
            f"{timesteps.max():.1f}); widen it"
        )
    first = int(inside.nonzero()[0])
    return first, int(inside.sum())


def _other_name(built) -> str:
    return "transformer" if built.trained_name == "transformer_2" else "transformer_2"


@contextlib.contextmanager
def other_expert_loaded(built):
    """With two experts, the untrained one read from the folder onto the device for the duration (samples run both,
    each on its side of the boundary), then released: it is never held while training steps run."""
    if built.settings.expert is None:
        yield
        return
    from diffusers import WanTransformer3DModel

    built.other_expert = (
        load_component(
            built.folder, _other_name(built), WanTransformer3DModel.from_pretrained, torch_dtype=built.frozen_dtype
        )
        .eval()
        .requires_grad_(False)
        .to(built.device)
    )
    try:
        yield
    finally:
        built.other_expert = None
        gc.collect()


# ------------------------------------------------------------------------------------------ text, prediction


def _captions(pipeline, built, captions: list[str]) -> dict:
    """{"encoder_hidden_states": (B, max_sequence_length, d_model)} from WanPipeline.encode_prompt."""
    with torch.no_grad(), quiet_hf_libraries():
        embeds, _ = pipeline.encode_prompt(
            list(captions),
            do_classifier_free_guidance=False,
            max_sequence_length=built.max_sequence_length,
            device=built.device,
        )
    return {"encoder_hidden_states": embeds}


def _cached_text(built, pipeline, prompt: dict, negative: dict) -> dict:
    """The prompt's (and the empty negative's) cached UMT5 embeddings as WanPipeline's arguments."""
    return {
        "prompt_embeds": prompt["encoder_hidden_states"],
        "negative_prompt_embeds": negative["encoder_hidden_states"],
    }


def _predict(built, forward, noisy, timesteps, conditions: dict, dtype) -> torch.Tensor:
    hidden, timestep, extra, _ = wan_i2v.transformer_inputs(built, noisy, timesteps, conditions)
    return forward(
        hidden_states=hidden.to(dtype),
        timestep=timestep.to(dtype),
        encoder_hidden_states=conditions["encoder_hidden_states"].to(dtype),
        return_dict=False,
        **{k: v.to(dtype) for k, v in extra.items()},
    )[0]


def _pipeline(built, transformer) -> tuple:
    """WanPipeline (WanImageToVideoPipeline for image-to-video samples) and its arguments: with two experts the
    trained one sits in its own slot and the other beside it."""
    cls, extra = wan_i2v.pipeline_class(built, transformer)
    experts = {"transformer": transformer}
    if transformer is not None and built.other_expert is not None:
        experts = {built.trained_name: transformer, _other_name(built): built.other_expert}
    return cls, {**experts, "boundary_ratio": built.model_index.get("boundary_ratio"), **extra}


WAN = FlowRecipe(
    kind="wan",
    transformer_class="WanTransformer3DModel",
    pipeline_class="WanPipeline",
    components=COMPONENTS,
    text=TextSide(
        TEXT_TENSORS, _captions, lambda built: built.max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH, load=_load_text
    ),
    predict=_predict,
    config_mismatches=lambda folder: [],  # folder_problems checks a Wan folder (with the spec's expert and mode)
    latents=LatentSpace(
        vae_class="AutoencoderKLWan",
        frames=True,
        patch=lambda built: tuple(built.transformer_config["patch_size"][1:]),
        spatial_factor=lambda vae_config: vae_config.scale_factor_spatial,
    ),
    conditioning=Conditioning(
        load=wan_i2v.load,
        encode=wan_i2v.encode_conditions,
        model_inputs=wan_i2v.model_inputs,
        clean_frames=wan_i2v.clean_frames,
        sample_sources=wan_i2v.sample_sources,
        sample_inputs=wan_i2v.sample_inputs,
    ),
    experts=Experts(
        trained=lambda model: "transformer_2" if model.expert == "low_noise" else "transformer",
        positions=expert_positions,
        other_loaded=other_expert_loaded,
    ),
    sampling=Sampling(
        pipeline=_pipeline,
        scheduler=lambda built: built.scheduler,
        side_multiple=lambda built: built.vae.config.scale_factor_spatial * built.transformer_config["patch_size"][1],
        cached_text=_cached_text,
    ),
    train_tables=lambda scheduler, shift: train_tables(dict(scheduler.config), shift)[:2],
    scheduler_class=None,  # UniPCMultistepScheduler, as listed
    preconditioned=lambda model: False,
)  # the velocity loss of Wan's trainers (model.family wan has no such key)
