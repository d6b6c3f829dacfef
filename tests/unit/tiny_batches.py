"""Batches of the built-in datasets as the family tests feed them: shapes (images) and moving shapes (clips)."""

from __future__ import annotations

import torch

from dstune.builtin.common import to_tensor
from dstune.data.synthetic import render_shape


def shape_batch(indices: list[int], side: int = 32) -> dict:
    """builtin:shapes samples `indices` as an image family's batch: pixel_values in [-1, 1], caption, index."""
    images = [render_shape(i, side) for i in indices]
    return {
        "pixel_values": to_tensor([image for image, _ in images]),
        "caption": [caption for _, caption in images],
        "index": torch.tensor(indices, dtype=torch.long),
    }


def clip_batch(indices: list[int], seed: int, frames: int = 5) -> dict:
    """builtin:moving-shapes clips `indices` of `frames` frames, collated as the video loader collates them."""
    from dstune.data.index import list_samples
    from dstune.data.video import VideoCaptionDataset, collate_video
    from dstune.spec.models import DataSpec

    data = DataSpec(path="builtin:moving-shapes", video={"frames": frames})
    dataset = VideoCaptionDataset(data, list_samples(data, video=True), seed)
    return collate_video([dataset[i] for i in indices])
