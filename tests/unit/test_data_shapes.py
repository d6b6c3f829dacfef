"""builtin:shapes: deterministic, balanced, and the picture matches the caption at 32 and 64 px."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dstune.data.synthetic import BACKGROUNDS, COLOURS, SHAPES, SHAPES_NUM_SAMPLES, render_shape, shape_sample


@pytest.mark.parametrize("resolution", [32, 64])
def test_rendering_is_deterministic_and_matches_the_caption(resolution):
    for index in range(0, SHAPES_NUM_SAMPLES, 7):
        image, caption = render_shape(index, resolution)
        again, _ = render_shape(index, resolution)
        assert image.size == (resolution, resolution) and image.mode == "RGB"
        assert image.tobytes() == again.tobytes()
        sample = shape_sample(index)
        assert caption == sample.caption == f"a {sample.colour} {sample.shape}"
        pixels = np.asarray(image).astype(int)
        centre = pixels[round(sample.centre_y * resolution), round(sample.centre_x * resolution)]
        assert np.abs(centre - COLOURS[sample.colour]).max() <= 2, (index, centre)  # flat fill at the centre
        assert np.abs(pixels[0, 0] - BACKGROUNDS[sample.background]).max() <= 2  # the corner is background
        covered = (np.abs(pixels - COLOURS[sample.colour]).max(axis=2) <= 2).mean()
        assert 0.1 < covered < 0.6, (index, covered)  # large shapes, never the whole image


def test_shapes_differ_by_kind_with_the_same_colour():
    # Same colour: circle, square, triangle cover different pixel areas at the same size.
    areas = {}
    for index in range(SHAPES_NUM_SAMPLES):
        sample = shape_sample(index)
        pixels = np.asarray(render_shape(index, 64)[0]).astype(int)
        areas.setdefault(sample.shape, []).append(
            (np.abs(pixels - COLOURS[sample.colour]).max(axis=2) <= 2).mean() / sample.size**2
        )
    means = {shape: np.mean(values) for shape, values in areas.items()}
    assert means["triangle"] < means["square"] < means["circle"]


def test_every_colour_shape_pair_appears_evenly():
    counts = Counter((shape_sample(i).colour, shape_sample(i).shape) for i in range(SHAPES_NUM_SAMPLES))
    assert len(counts) == len(COLOURS) * len(SHAPES)
    assert max(counts.values()) - min(counts.values()) <= 1
    assert {shape_sample(i).background for i in range(SHAPES_NUM_SAMPLES)} == set(BACKGROUNDS)


def test_out_of_range_index():
    with pytest.raises(IndexError, match="0..255"):
        shape_sample(SHAPES_NUM_SAMPLES)
