"""LTX-2 as the video family sees it (dstune.families.video.VideoModel): its recipe, its folder checks, the text
cache's folders (the connectors' outputs are what it stores) and the model keys its sigma draws refuse."""

from __future__ import annotations

from dstune.families.base import FamilyError
from dstune.families.video import VideoModel
from dstune.models.ltx2.recipe import LTX2, TRANSFORMER_CLASS, folder_problems, settings_problems


def _check_settings(built) -> None:
    """model.timestep_sampling, shift and timestep_range against LTX-2's sigma draws (before any step)."""
    problems = settings_problems(built.settings)
    if problems:
        raise FamilyError(
            f"{built.folder} cannot be trained with these model keys (LTX-2):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


VIDEO_MODEL = VideoModel(
    title="LTX-2",
    transformer_class=TRANSFORMER_CLASS,
    recipe_of=lambda folder: LTX2,
    folder_problems=folder_problems,
    text_cache_folders=("text_encoder", "tokenizer", "connectors"),  # Gemma 3 and the connectors after it
    # each clip's sound latents (the audio VAE's, of its log-mel) stored beside its posterior, silence's where it
    # has none, with has_sound saying which
    cache_key=lambda model, folder: ("sound: audio_vae latents", ("audio_vae",), ("sound_latent", "has_sound")),
    condition_tensors=lambda built, clips: {},
    after_build=_check_settings,
)
