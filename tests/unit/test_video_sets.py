"""data.sets for the video families (model.family video): each set with its own frames (data.sets.N.video), repeats
and masks, on builtin:tiny-wan with builtin:moving-shapes and a folder of real MP4s (tests/unit/test_video_masks.py
writes it): validate's set rows and buckets, one epoch of the real loader (each global batch one clip shape, every
set its exact count), the memory plan at the longest set, and the refusals that remain (set weights with several
frame counts; on LTX-2 sets at other frame rates and preservation sets)."""

from __future__ import annotations

from collections import Counter

import pytest
import yaml

from dstune.cli import main
from loaded_models import CACHE_DIR, start_up
from test_video_masks import write_masked_clips


def two_sets(tmp_path, **changes) -> dict:
    root = write_masked_clips(tmp_path / "data")
    spec = {
        "model": {"family": "video", "pretrained": "builtin:tiny-wan", "max_sequence_length": 32},
        "data": {
            "resolution": 32,
            "video": {"frames": 5},
            "num_workers": 0,
            "sets": [
                {"path": "builtin:moving-shapes", "name": "shapes"},
                {
                    "path": str(root / "videos"),
                    "name": "clips",
                    "mask_dir": "../masks",
                    "repeats": 3,
                    "video": {"frames": 9},
                },
            ],
        },
        "train": {"micro_batch_size": 1, "global_batch_size": 2, "max_steps": 2, "precision": "fp32", "seed": 3},
        "output": {"dir": str(tmp_path / "run"), "cache_dir": str(CACHE_DIR)},
    }
    for key, value in changes.items():
        spec[key].update(value)
    return spec


def written(tmp_path, spec: dict):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_validate_prints_each_sets_frames_and_count_and_buckets_by_frames(tmp_path, capsys):
    assert main(["validate", str(written(tmp_path, two_sets(tmp_path)))]) == 0
    out = capsys.readouterr().out
    assert "144 files x 1 = 144 samples per epoch" in out and "5 frames at 32 px" in out
    assert "2 files x 3 = 6 samples per epoch" in out and "9 frames at 32 px" in out
    assert "counted in the 2 sets of data.sets" in out
    assert "5f 32x32             144 samples" in out and "9f 32x32             6 samples" in out
    assert "largest 12 per sample (9f 32x32; the memory plan's)" in out  # the longest set's clips


def test_one_epoch_gives_every_set_its_count_and_each_global_batch_one_clip_shape(tmp_path):
    _, _, loader = start_up(written(tmp_path, two_sets(tmp_path)))
    sets, shapes = Counter(), []
    for batch in loader:
        sets.update(sample_id.split("/", 1)[0] for sample_id in batch["sample_id"])
        shapes.append(tuple(batch["pixel_values"].shape[2:]))
        masked = [sample_id.startswith("clips/") for sample_id in batch["sample_id"]]
        assert batch["loss_mask"].shape[2:] == batch["pixel_values"].shape[2:]  # a mask per clip, ones unmasked
        if not any(masked):
            assert bool((batch["loss_mask"] == 1).all())
    assert sets == {"shapes": 144, "clips": 6}
    pairs = [shapes[i : i + 2] for i in range(0, len(shapes), 2)]  # the 2 micro batches of each optimizer step
    assert all(len(set(pair)) == 1 for pair in pairs)
    assert Counter(pair[0] for pair in pairs) == {(5, 32, 32): 72, (9, 32, 32): 3}


def test_set_weights_with_several_frame_counts_are_refused(tmp_path, capsys):
    spec = two_sets(tmp_path)
    for item in spec["data"]["sets"]:
        item.pop("repeats", None)
        item["weight"] = 1.0
    assert main(["validate", str(written(tmp_path, spec))]) == 1
    assert "sets at several sizes (or frame counts) are not offered yet" in capsys.readouterr().out


def test_ltx2_takes_sets_at_one_frame_rate_and_refuses_preservation_and_other_rates(tmp_path, capsys):
    spec = two_sets(tmp_path, model={"pretrained": "builtin:tiny-ltx2"})
    assert main(["validate", str(written(tmp_path, spec))]) == 0, capsys.readouterr().out
    capsys.readouterr()
    spec["data"]["sets"][1].update(video={"frames": 9, "fps": 12}, role="regularization")
    spec["data"]["sets"][0]["video"] = {"frames": 5, "fps": 24}
    spec["model"]["train"] = "lora"
    spec["data"]["sets"].append({"path": "builtin:moving-shapes", "name": "keep", "role": "preservation"})
    assert main(["validate", str(written(tmp_path, spec))]) == 1
    out = capsys.readouterr().out
    assert "data.sets.1.video.fps" in out and "the sets' frame rates differ" in out
    assert "data.sets.2.role" in out and "preservation is not offered for LTX-2 yet" in out


@pytest.mark.parametrize("family", ["flow"])
def test_a_sets_video_key_on_an_image_family_is_an_error(tmp_path, capsys, family):
    spec = two_sets(tmp_path, model={"family": family, "pretrained": "builtin:tiny-flow"})
    spec["data"]["sets"] = [{"path": "builtin:shapes", "video": {"frames": 9}}]
    spec["data"].pop("video")
    assert main(["validate", str(written(tmp_path, spec))]) == 1
    assert "data.video are for the video family" in capsys.readouterr().out


def test_a_preservation_clip_is_held_to_the_base_wans_prediction_over_its_mask():
    """DOP on a video model (data.sets role preservation, LoRA): clip 3 a preservation sample (weight 0.5, its
    left half masked in), clip 11 a train sample. The loss is clip 11's flow error plus 0.5 x the masked mean of
    (adapted - base prediction)^2 of clip 3, the base being builtin:tiny-wan loaded without adapters, by hand."""
    import torch

    from dstune.families.flow_model import noisy_at
    from dstune.families.randomness import per_sample_randn
    from dstune.pretrained import build_model
    from dstune.spec.models import VideoModelSpec
    from test_loss_terms import with_trained_adapters
    from test_video_masks import FRAMES, INDICES, SEED, STEP
    from tiny_batches import clip_batch

    spec = dict(family="video", pretrained="builtin:tiny-wan", max_sequence_length=32)
    adapted = with_trained_adapters(VideoModelSpec(**spec, train="lora", lora={"rank": 2}))
    base = build_model(VideoModelSpec(**spec), CACHE_DIR, "cpu", torch.float32)
    mask = torch.ones(2, 1, FRAMES, 32, 32)
    mask[0, ..., 16:] = 0
    fields = {
        "loss_mask": mask,
        "loss_weight": torch.tensor([0.5, 1.0]),
        "prior": torch.tensor([False, False]),
        "preserve": torch.tensor([True, False]),
    }
    encoded = adapted.encode_batch({**clip_batch(INDICES, SEED, FRAMES), **fields}, torch.float32)
    with torch.no_grad():
        loss = adapted.loss(adapted.trainable, encoded, SEED, STEP).item()
        latents = adapted.model_latents(encoded, SEED, STEP)
        noise = per_sample_randn(latents.shape[1:], SEED, STEP, INDICES, "noise")
        timesteps, sigma = adapted.draw_sigmas(latents, SEED, STEP, INDICES)
        _, noisy = noisy_at(latents, noise, sigma)
        conditions = adapted.conditions(encoded, torch.float32)
        ours = adapted.predict(adapted.trainable, noisy, timesteps, conditions, torch.float32)
        theirs = base.predict(base.trainable, noisy, timesteps, conditions, torch.float32)
    half = ours.shape[-1] // 2
    held = ((ours[0] - theirs[0]) ** 2)[..., :half].mean()
    trained = ((ours[1] - (noise[1] - latents[1])) ** 2).mean()
    assert (ours[0] - theirs[0]).abs().max() > 1e-3  # the adapters do change the prediction
    assert loss == pytest.approx((trained + 0.5 * held).item(), rel=1e-5)
