"""HunyuanVideo 1.5 as the video family sees it (dstune.families.video.VideoModel): its recipes (text- and
image-to-video, by the folder's pipeline class), its folder checks, and its image-to-video cache tensors."""

from __future__ import annotations

from pathlib import Path

from dstune.families.video import VideoModel
from dstune.models.hunyuan_video15 import i2v
from dstune.models.hunyuan_video15.recipe import TRANSFORMER_CLASS, folder_problems, recipe_of


def cache_key(model, folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """An image-to-video folder stores SigLIP's embedding of the first frame beside the posterior."""
    if not i2v.is_image_to_video(Path(folder)):
        return "", (), ()
    return "image_to_video/hunyuan_video15", ("image_encoder", "feature_extractor"), (i2v.IMAGE_EMBEDS,)


def _encode_clip_by_clip(built) -> None:
    # diffusers 0.42's HunyuanVideo 1.5 VAE attention mask fits one clip: encode a batch clip by clip
    built.vae.enable_slicing()


VIDEO_MODEL = VideoModel(
    title="HunyuanVideo 1.5",
    transformer_class=TRANSFORMER_CLASS,
    recipe_of=recipe_of,
    folder_problems=folder_problems,
    # Qwen2.5-VL, and the ByT5 glyph encoder's
    text_cache_folders=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    cache_key=cache_key,
    condition_tensors=i2v.condition_tensors,
    after_build=_encode_clip_by_clip,
)
