"""The clip length rule is a fact of the video model (its card's clip_rule, dstune.card.ClipRule): validate names the
frame counts the model's VAE takes on a wrong data.video.frames (each set's own) or model.sample_frames, and the
plan's tokens per clip follow the rule. A causal VAE 4x / 8x in time keeps the first frame (4k+1 -> k+1, the rule of
Wan, HunyuanVideo 1.5 and LTX-2's 8k+1: their numbers do not move); a VAE of 17-frame chunks (MiniMax-H3's
AutoencoderKLMiniMaxH3) takes 17k+5 -> 5k+2, checked here against the real class."""

from __future__ import annotations

from dataclasses import fields

import pytest
import yaml

from dstune.card import CAUSAL_4X, ClipRule
from dstune.data.clips import latent_tokens
from dstune.families.denoiser_facts import pipeline_folder
from dstune.models.wan.card import WAN_CARD
from dstune.spec.load import load_spec

CHUNKED = ClipRule(17, 5, 5, 2)


def test_the_causal_rule_is_the_formula_the_video_models_had():
    for frames in (1, 5, 9, 33, 81, 121):
        assert CAUSAL_4X.latent_frames(frames) == 1 + (frames - 1) // 4
        assert ClipRule(8).latent_frames(frames) == 1 + (frames - 1) // 8
    assert CAUSAL_4X.takes(81) and not CAUSAL_4X.takes(80)
    assert latent_tokens((81, 64, 32), 8, (1, 2, 2)) == 21 * 4 * 2


@pytest.mark.parametrize("frames", [22, 39])
def test_a_chunked_rule_gives_the_latent_frames_of_the_real_vae(frames):
    import torch
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(0)
    vae = AutoencoderKLMiniMaxH3(
        block_out_channels=(8,) * 6, layers_per_block=1, norm_num_groups=4, latent_channels=4, decoder_num_layers=1
    )
    assert vae.config.clip_length == CHUNKED.step and vae.tokens_chunk_size == CHUNKED.latents
    with torch.no_grad():
        latents = vae.encode(torch.rand(1, 3, frames, 32, 32)).latent_dist.mean
    assert CHUNKED.takes(frames) and latents.shape[2] == CHUNKED.latent_frames(frames)


class ChunkedWanCard(type(WAN_CARD)):
    """Wan's card with a VAE of 17-frame chunks: the core reads the rule from the card, never from a model's name."""

    def clip_rule(self, folder):
        return CHUNKED


def spec_with(tmp_path, frames, sample_frames=5, sets=None):
    spec = {
        "model": {"family": "video", "pretrained": "builtin:tiny-wan", "sample_frames": sample_frames},
        "data": {"path": "builtin:moving-shapes", "resolution": 32, "video": {"frames": frames}},
        "train": {"micro_batch_size": 1, "max_steps": 2},
    }
    if sets:
        spec["data"].pop("path")
        spec["data"]["sets"] = sets
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return load_spec(path)[0]


def test_the_frame_checks_name_the_counts_of_the_cards_rule(tmp_path):
    folder = pipeline_folder("builtin:tiny-wan")
    chunked = ChunkedWanCard(**{field.name: getattr(WAN_CARD, field.name) for field in fields(WAN_CARD)})
    spec = spec_with(tmp_path, [22, 30], sample_frames=124)
    assert chunked.frame_issues(spec, folder) == [
        (
            "data.video.frames",
            "30 is not 17k+5: Wan's VAE takes 17k+5 frames (5, 22, 39, ..., 7 latent frames for 22); use 22 or 39",
        )
    ]
    issues = dict(WAN_CARD.frame_issues(spec, folder))
    assert issues["data.video.frames"].startswith("22 is not 4k+1: Wan's VAE takes 4k+1 frames (1, 5, 9, ...")
    assert "30 is not 4k+1" in issues["data.video.frames"] and "use 29 or 33" in issues["data.video.frames"]
    assert (
        issues["model.sample_frames"].startswith("124 is not 4k+1")
        and "use 121 or 125" in issues["model.sample_frames"]
    )
    sets = [{"path": "builtin:moving-shapes", "name": "a"}, {"path": "builtin:moving-shapes", "video": {"frames": 9}}]
    assert dict(chunked.frame_issues(spec_with(tmp_path, 22, sets=sets), folder)) == {
        "data.sets.1.video.frames": "9 is not 17k+5: Wan's VAE takes 17k+5 frames (5, 22, 39, ..., 7 latent "
        "frames for 22); use 5 or 22"
    }
    assert latent_tokens((22, 32, 32), 8, (1, 2, 2), CHUNKED) == 7 * 2 * 2


def test_the_memory_plan_caches_the_latent_frames_of_the_cards_rule(tmp_path):
    """The latent cache's bytes count each clip's latent frames by the card's rule: 22 frames are 7 latent frames
    under 17k+5 (6 under the causal 4x formula)."""
    folder = pipeline_folder("builtin:tiny-wan")
    chunked = ChunkedWanCard(**{field.name: getattr(WAN_CARD, field.name) for field in fields(WAN_CARD)})
    spec = spec_with(tmp_path, 22)
    spec = spec.model_copy(
        update={"data": spec.data.model_copy(update={"cache": spec.data.cache.model_copy(update={"latents": True})})}
    )
    clips = [(22, 32, 32, 10)]
    text = WAN_CARD.text_bytes(spec, folder) * 10
    causal = WAN_CARD.cache_bytes(spec, folder, {"vae": 0}, 10, clips) - text
    chunked_bytes = chunked.cache_bytes(spec, folder, {"vae": 0}, 10, clips) - text
    assert causal > 0 and chunked_bytes * 6 == causal * 7


def test_the_data_layers_pixels_reach_a_vae_in_its_own_range():
    """dstune.card.PixelRange: the data layer's [-1, 1] pixels of an 8-bit clip, mapped to an ImageNet-normalised
    [0, 1] VAE's range, are what a pipeline that normalises `uint8 / 255` by ImageNet's statistics gives its VAE; the
    default range hands the pixels over untouched (the same tensor: no rounding for the models that take [-1, 1])."""
    import torch

    from dstune.card import DATA_PIXELS, IMAGENET_UNIT_PIXELS
    from dstune.families.diffusion import vae_pixels

    frames = torch.randint(0, 256, (2, 3, 5, 8, 8), generator=torch.Generator().manual_seed(0))
    data = frames.float() / 127.5 - 1  # what dstune.data.video gives of them
    mean = torch.tensor(IMAGENET_UNIT_PIXELS.mean).view(1, 3, 1, 1, 1)
    std = torch.tensor(IMAGENET_UNIT_PIXELS.std).view(1, 3, 1, 1, 1)
    expected = (frames.float() / 255 - mean) / std
    assert torch.allclose(vae_pixels(data, IMAGENET_UNIT_PIXELS), expected, atol=1e-6)
    assert vae_pixels(data, DATA_PIXELS) is data
    assert (vae_pixels(data, IMAGENET_UNIT_PIXELS) - data).abs().max() > 0.5  # the ranges differ
    assert DATA_PIXELS.text == "[-1, 1]" and IMAGENET_UNIT_PIXELS.text == "[0, 1], per-channel normalised"
