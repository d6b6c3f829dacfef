"""Masked loss for the video models (data.mask_dir with model.family video), on the real tiny models of the three
video units (builtin:tiny-wan, builtin:tiny-hunyuan-video15, builtin:tiny-ltx2) and real MP4 files:

- a clip's mask reaches the latent grid (frames x h x w) averaged as the video VAEs compress time: latent frame 0
  is frame 0, latent frame k the mean of frames (k-1)t+1 .. kt (t = 4 for these VAEs, 8 for LTX-2's real one);
- a mask of ones gives the unmasked loss; a mask keeping frames 0-4 (latent frames 0 and 1) and the left half
  gives the flow error over exactly those latents, by hand;
- LTX-2's sound is not masked: a clip's audio part of the loss is the same with any mask;
- the latent cache stores each clip's mask at the latent grid: a mask image (every frame alike) and a mask video
  (frame by frame) equal the files' pixels averaged down by hand, and the cached run's loss is the uncached one's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from dstune.families.flow_model import noisy_at
from dstune.families.loss_terms import mask_at_latents
from dstune.families.randomness import per_sample_randn
from dstune.pretrained import build_model
from dstune.spec.models import VideoModelSpec
from loaded_models import CACHE_DIR, start_up
from tiny_batches import clip_batch

SEED, STEP, INDICES, FRAMES = 7, 5, [3, 11], 9
MODELS = ["builtin:tiny-wan", "builtin:tiny-hunyuan-video15", "builtin:tiny-ltx2"]


def by_hand_at_latents(mask: torch.Tensor, t: int, factor: int) -> torch.Tensor:
    """(B, 1, T, H, W) -> (B, 1, 1 + (T-1)/t, H/factor, W/factor) with loops: the first frame alone, then t frames
    per latent frame, each latent the mean of its factor x factor pixels."""
    groups = [mask[:, :, :1]] + [mask[:, :, 1 + k * t : 1 + (k + 1) * t] for k in range((mask.shape[2] - 1) // t)]
    out = []
    for group in groups:
        frame = group.mean(dim=2)  # (B, 1, H, W)
        b, c, h, w = frame.shape
        out.append(frame.reshape(b, c, h // factor, factor, w // factor, factor).mean(dim=(3, 5)))
    return torch.stack(out, dim=2)


@pytest.mark.parametrize("frames, t, factor", [(9, 4, 8), (17, 8, 32), (5, 4, 16), (1, 4, 8)])
def test_a_clips_mask_is_averaged_to_the_latent_grid_as_the_vae_compresses_time(frames, t, factor):
    mask = torch.rand(2, 1, frames, 64, 64, generator=torch.Generator().manual_seed(frames))
    latent = (1 + (frames - 1) // t, 64 // factor, 64 // factor)
    ours = mask_at_latents(mask, latent)
    assert ours.shape == (2, 1, *latent)
    assert torch.allclose(ours, by_hand_at_latents(mask, t, factor), atol=1e-6)
    assert torch.equal(mask_at_latents(ours, latent), ours)  # a cached mask (already at the grid) is kept as is


def test_a_mask_whose_frames_do_not_compress_to_the_latent_frames_is_an_error():
    with pytest.raises(ValueError, match="10 frames does not compress to 3 latent frames"):
        mask_at_latents(torch.ones(1, 1, 10, 8, 8), (3, 1, 1))


@pytest.fixture(scope="module", params=MODELS)
def video_model(request):
    spec = VideoModelSpec(family="video", pretrained=request.param, max_sequence_length=32)
    return build_model(spec, CACHE_DIR, "cpu", torch.float32)


def encoded_of(model, **fields) -> dict:
    batch = clip_batch(INDICES, SEED, FRAMES)
    if model.sound_rate:  # LTX-2: its loss trains the video alone for clips without sound (moving-shapes)
        batch["has_sound"] = torch.tensor([False] * len(INDICES))
    with torch.no_grad():
        return model.encode_batch({**batch, **fields}, torch.float32)


def loss_of(model, **fields) -> float:
    with torch.no_grad():
        return model.loss(model.trainable, encoded_of(model, **fields), SEED, STEP).item()


def flow_error_by_hand(model) -> torch.Tensor:
    """The squared velocity error (B, C, f, h, w) of the step, from the model's own draws and prediction (these
    models' default loss_weighting is none and they predict the velocity noise - x0)."""
    encoded = encoded_of(model)
    latents = model.model_latents(encoded, SEED, STEP)
    noise = per_sample_randn(latents.shape[1:], SEED, STEP, INDICES, "noise")
    timesteps, sigma = model.draw_sigmas(latents, SEED, STEP, INDICES)
    _, noisy = noisy_at(latents, noise, sigma)
    with torch.no_grad():
        prediction = model.predict(
            model.trainable, noisy, timesteps, model.conditions(encoded, torch.float32), torch.float32
        )
    return (prediction.float() - (noise - latents)) ** 2


def test_a_mask_of_ones_gives_the_unmasked_loss_and_a_kept_part_the_error_over_its_latents(video_model):
    plain = loss_of(video_model)
    ones = loss_of(video_model, loss_mask=torch.ones(len(INDICES), 1, FRAMES, 32, 32))
    assert ones == pytest.approx(plain, rel=1e-6)
    error = flow_error_by_hand(video_model)
    assert error.mean().item() == pytest.approx(plain, rel=1e-5)  # the hand error is the loss's
    mask = torch.zeros(len(INDICES), 1, FRAMES, 32, 32)
    mask[:, :, :5, :, :16] = 1  # frames 0-4 (latent frames 0 and 1), the left half
    kept = error[:, :, :2, :, : error.shape[-1] // 2].mean(dim=(1, 2, 3, 4)).mean()
    assert loss_of(video_model, loss_mask=mask) == pytest.approx(kept.item(), rel=1e-5)
    assert abs(kept.item() - plain) > 1e-4  # the mask does change it


# --------------------------------------------------------------------------------------------- the mask cache


def write_mp4(path: Path, frames: list[np.ndarray], fps: int = 24) -> Path:
    """A real MP4 (H.264, near-lossless) of RGB frames (H, W, 3) uint8."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt, stream.options = "yuv420p", {"qp": "0"}
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_masked_clips(root: Path) -> Path:
    """Two 9-frame 32 x 32 moving-shapes MP4s in `videos/`; in `masks/` clip0's mask image (white left of column
    12, a grey band to 20, at twice the size: stretched over the frame) and clip1's mask video (frame n white left
    of column 3n + 4)."""
    from dstune.data.synthetic import render_moving_shape

    (root / "videos").mkdir(parents=True)
    (root / "masks").mkdir()
    for number in range(2):
        images, caption = render_moving_shape(number * 9, 32, FRAMES)
        write_mp4(root / "videos" / f"clip{number}.mp4", [np.asarray(image) for image in images])
        (root / "videos" / f"clip{number}.txt").write_text(caption)
    still = np.zeros((64, 64), dtype=np.uint8)
    still[:, :24], still[:, 24:40] = 255, 128
    Image.fromarray(still).save(root / "masks" / "clip0.png")
    moving = []
    for n in range(FRAMES):
        frame = np.zeros((32, 32, 3), dtype=np.uint8)
        frame[:, : 3 * n + 4] = 255
        moving.append(frame)
    write_mp4(root / "masks" / "clip1.mp4", moving)
    return root


def file_mask(root: Path, sample_id: str) -> torch.Tensor:
    """The mask file of a clip as (1, 1, FRAMES, 32, 32) in [0, 1]: the image on every frame (resized to the
    frame), or the mask video's decoded frames."""
    from dstune.data.video import decode_frames

    stem = sample_id.rsplit(".", 1)[0]
    if (root / "masks" / f"{stem}.png").exists():
        image = Image.open(root / "masks" / f"{stem}.png").resize((32, 32), Image.Resampling.BILINEAR)
        images = [image] * FRAMES
    else:
        images = decode_frames(str(root / "masks" / f"{stem}.mp4"), list(range(FRAMES)))
    frames = [torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32) / 255.0) for image in images]
    return torch.stack(frames)[None, None]


def test_the_cached_clip_mask_is_the_files_mask_at_latent_size_and_trains_as_the_uncached_one(tmp_path):
    root = write_masked_clips(tmp_path / "data")
    losses = {}
    for cached in (True, False):
        spec = {
            "model": {"family": "video", "pretrained": "builtin:tiny-wan", "max_sequence_length": 32},
            "data": {
                "path": str(root / "videos"),
                "mask_dir": "../masks",
                "resolution": 32,
                "video": {"frames": FRAMES},
                "num_workers": 0,
                "cache": {"latents": cached, "dir": str(tmp_path / "cache")},
            },
            "train": {"micro_batch_size": 2, "max_steps": 1, "precision": "fp32", "seed": SEED},
            "output": {"dir": str(tmp_path / f"run-{cached}"), "cache_dir": str(CACHE_DIR)},
        }
        path = tmp_path / f"spec-{cached}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        model, caches, loader = start_up(path)
        batch = next(iter(loader))
        by_hand = torch.cat([file_mask(root, sample_id) for sample_id in batch["sample_id"]])
        assert by_hand[:, :, 0].std() > 0.1  # the masks keep parts of the frames
        if cached:  # tiny-wan: 9 frames -> 3 latent frames, 8 pixels per latent
            assert caches.images.latents and batch["loss_mask"].shape == (2, 1, 3, 4, 4)
            assert torch.allclose(batch["loss_mask"], by_hand_at_latents(by_hand, 4, 8), atol=1e-6)
        else:
            assert batch["loss_mask"].shape == (2, 1, FRAMES, 32, 32)
            assert torch.allclose(batch["loss_mask"], by_hand, atol=1e-6)
        with torch.no_grad():
            losses[cached] = model.loss(model.trainable, model.encode_batch(batch, torch.float32), SEED, 0).item()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_validate_takes_a_video_mask_folder_and_refuses_alpha_masks_for_clips(tmp_path, capsys):
    from dstune.cli import main

    root = write_masked_clips(tmp_path / "data")
    spec = {
        "model": {"family": "video", "pretrained": "builtin:tiny-wan"},
        "data": {"path": str(root / "videos"), "mask_dir": "../masks", "resolution": 32, "video": {"frames": FRAMES}},
        "train": {"micro_batch_size": 1, "max_steps": 1},
        "output": {"dir": str(tmp_path / "run"), "cache_dir": str(CACHE_DIR)},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main(["validate", str(path)]) == 0, capsys.readouterr()
    del spec["data"]["mask_dir"]
    spec["data"]["alpha_mask"] = True
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main(["validate", str(path)]) == 1
    assert "data.alpha_mask reads an image's alpha channel" in capsys.readouterr().out


def test_a_mask_video_of_other_frames_is_named_before_training(tmp_path):
    """A mask video must match its video frame for frame: one of 5 frames for a 9-frame video is found by the
    start-up check (find_bad_clips), with both counts in the message."""
    from dstune.data.index import list_samples
    from dstune.data.video import find_bad_clips
    from dstune.spec.models import DataSpec

    root = write_masked_clips(tmp_path / "data")
    write_mp4(root / "masks" / "clip1.mp4", [np.zeros((32, 32, 3), dtype=np.uint8)] * 5)
    data = DataSpec(path=str(root / "videos"), mask_dir="../masks", resolution=32, video={"frames": FRAMES})
    bad = find_bad_clips(list_samples(data, video=True), data)
    assert [record.sample_id for record, _ in bad] == ["clip1.mp4"]
    assert "has 5 frames at 24 fps, its video 9 at 24 fps" in bad[0][1]
