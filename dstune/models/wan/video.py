"""Wan 2.1 / 2.2 as the video family sees it (dstune.families.video.VideoModel): its recipe, its folder checks,
and what an image-to-video run (Wan 2.1 I2V, Wan 2.2 I2V A14B, TI2V) stores beside each clip's posterior."""

from __future__ import annotations

from pathlib import Path

from dstune.families.folders import read_component_config
from dstune.families.video import VideoModel
from dstune.models.wan import i2v
from dstune.models.wan.recipe import WAN, folder_problems


def cache_key(model, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """The mode (the condition stored with the posterior) and the image encoder's folders, and the tensors stored;
    ("", (), ()) for text-to-video (the entries are the posterior's)."""
    mode = i2v.folder_mode(Path(folder), model.image_to_video)
    if not mode.image_to_video:
        return "", (), ()
    if read_component_config(folder, "transformer").get("image_dim") is None:
        return f"image_to_video/{mode.layout}", (), (i2v.CONDITION,)
    return (f"image_to_video/{mode.layout}", ("image_encoder", "image_processor"), (i2v.CONDITION, i2v.IMAGE_EMBEDS))


VIDEO_MODEL = VideoModel(
    title="Wan",
    transformer_class=WAN.transformer_class,
    recipe_of=lambda folder: WAN,
    folder_problems=folder_problems,
    text_cache_folders=("text_encoder", "tokenizer"),  # UMT5
    cache_key=cache_key,
    condition_tensors=i2v.condition_tensors,
)
