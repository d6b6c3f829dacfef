"""Real 2-rank DeepSpeed training of Wan text-to-video (model.family video, builtin:tiny-wan and the two-expert
builtin:tiny-wan-a14b) and image-to-video (builtin:tiny-wan-i2v, builtin:tiny-wan22-ti2v) on CPU, five launches, which
between them train full and LoRA under ZeRO 2 and ZeRO 3:

- full fine-tuning under ZeRO 2 on two data.sets of real MP4s from the latent and text caches (built before step
  1): 9-frame clips with loss masks (a mask image and a mask video, cached at the latent grid beside the latents)
  x 2 and 5-frame clips without x 4, so every epoch is one 9-frame and two 5-frame global batches; trains, renders
  animated samples, exports a folder WanPipeline loads and renders frames with;
- its resume from the step-2 checkpoint (mid-epoch): steps 3-4 have the same losses and the export the same
  weights;
- LoRA under ZeRO 3 with gradient checkpointing on a folder of real MP4 files (written here with PyAV, resampled to
  12 fps) of two lengths and two aspect ratios and one still image, with frame-count buckets [5, 9], size buckets and
  sliding chunks, with only the text cache: every step trains on one (frames, width, height) bucket (the batch
  check), only adapters train, and the LoRA file loads with WanPipeline.load_lora_weights and changes the frames;
- the low-noise expert of the two-expert model (Wan 2.2 A14B layout), full under ZeRO 2: its export holds the
  trained `transformer_2` and the other expert's weights bit-identical to the base folder's;
- image-to-video trains from first frames: builtin:tiny-wan-i2v (Wan 2.1 I2V layout) in full under ZeRO 3 (the
  transformer built partitioned) from the latent cache (condition latents and CLIP embedding stored beside each clip's posterior), samples rendered from a
  first frame, the export rendered by WanImageToVideoPipeline from an image; builtin:tiny-wan22-ti2v (Wan 2.2 TI2V)
  with LoRA under ZeRO 2 in image-to-video mode, the LoRA file loaded into WanImageToVideoPipeline (expand_timesteps)
  changing the frames;

HunyuanVideo 1.5's and LTX-2's runs are tests/dist/test_hunyuan_video15.py and test_ltx2.py.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flow_runs import STEPS, TRANSFORMER, base_folder, check_lora_export, check_resume, check_trains
from harness import CACHE_DIR, explain, launch, metrics, write_spec
from video_runs import PROMPT, first_frame, video_spec

pytestmark = pytest.mark.dist

MODEL = "tiny-wan"
TWO_EXPERTS = "tiny-wan-a14b"  # Wan 2.2 A14B layout: transformer (high noise), transformer_2 (low noise)


def _write_mp4(path: Path, number: int, count: int, width: int = 32) -> None:
    """A moving-shapes clip as a 24 fps H.264 MP4 of `count` frames, width x 32 (the centre of a square render)."""
    import av

    from dstune.data.synthetic import render_moving_shape

    frames, caption = render_moving_shape(number, width, count)
    top = (width - 32) // 2
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, 32, "yuv420p"
        for frame in frames:
            pixels = np.asarray(frame.crop((0, top, width, top + 32)))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    path.with_suffix(".txt").write_text(caption)


def _write_masked_sets(root: Path) -> dict:
    """Two 9-frame moving-shapes MP4s in `videos/`, with masks in `masks/`: clip0's a PNG (the left half kept),
    clip1's an MP4 whose frame n keeps the columns left of 3n + 4; the data section of two sets of them (masked at 9
    frames x 2, unmasked at 5 frames x 4)."""
    import av
    from PIL import Image

    (root / "videos").mkdir(parents=True)
    (root / "masks").mkdir()
    for number in range(2):
        _write_mp4(root / "videos" / f"clip{number}.mp4", number * 9, 9)
    half = np.zeros((32, 32), dtype=np.uint8)
    half[:, :16] = 255
    Image.fromarray(half).save(root / "masks" / "clip0.png")
    with av.open(str(root / "masks" / "clip1.mp4"), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt, stream.options = 32, 32, "yuv420p", {"qp": "0"}
        for n in range(9):
            pixels = np.zeros((32, 32, 3), dtype=np.uint8)
            pixels[:, : 3 * n + 4] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    videos = str(root / "videos")
    return {"sets": [
        {"path": videos, "name": "masked", "mask_dir": "../masks", "repeats": 2, "video": {"frames": 9}},
        {"path": videos, "name": "plain", "repeats": 4, "video": {"frames": 5}},
    ]}


def _write_mp4_folder(root: Path) -> Path:
    """Real MP4s at 24 fps (resampled to 12 by the spec) for three (frames, width, height) buckets of four clips:
    four 12-frame 32 x 32 files (6 frames at 12 fps: 5-frame clips), two 36-frame 32 x 32 files (18 frames: two
    sliding 9-frame chunks each) and four 12-frame 48 x 32 files; and one still image (a one-frame clip alone in its
    bucket, which never trains). Same-stem captions."""
    from dstune.data.synthetic import render_shape

    root.mkdir(parents=True)
    for number in range(10):
        _write_mp4(root / f"clip{number}.mp4", number * 9, 36 if number in (4, 5) else 12, 48 if number > 5 else 32)
    still, caption = render_shape(3, 32)
    still.save(root / "still.png")
    (root / "still.txt").write_text(caption)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from dstune.builtin import ensure_builtin_model

    ensure_builtin_model(MODEL, CACHE_DIR)  # built once here, not by both launches' rank 0
    full_dir = tmp_path_factory.mktemp("wan-zero2") / "run"
    cache = {"latents": True, "text_embeddings": True, "dir": str(full_dir.parent / "cache")}
    sets = _write_masked_sets(full_dir.parent / "data")
    full = write_spec(full_dir.parent / "spec.yaml", video_spec(full_dir, MODEL, 2, "full", {**sets, "cache": cache}))
    lora_dir = tmp_path_factory.mktemp("wan-lora-zero3") / "run"
    videos = _write_mp4_folder(lora_dir.parent / "videos")
    lora = video_spec(lora_dir, MODEL, 3, "lora", {
        "path": str(videos), "video": {"frames": [5, 9], "fps": 12, "sampling": "sliding"},
        "buckets": {"enabled": True, "sizes": [[32, 32], [48, 32]]},
        "cache": {"text_embeddings": True, "dir": str(lora_dir.parent / "cache")}})
    lora["train"].update(micro_batch_size=2)  # grouped: a micro batch stacks clips of one shape
    lora = write_spec(lora_dir.parent / "spec.yaml", lora)
    ensure_builtin_model(TWO_EXPERTS, CACHE_DIR)
    a14b_dir = tmp_path_factory.mktemp("wan22-low-noise") / "run"
    a14b = video_spec(a14b_dir, TWO_EXPERTS, 2, "full", {"path": "builtin:moving-shapes"}, {"expert": "low_noise"})
    a14b = write_spec(a14b_dir.parent / "spec.yaml", {**a14b, "sample": {"prompts": []}})
    out = {}
    for name, run_dir, spec_path in (("full", full_dir, full), ("lora", lora_dir, lora), ("a14b", a14b_dir, a14b)):
        started = time.perf_counter()
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
        print(f"launch {name}: {time.perf_counter() - started:.1f} s wall")
    return out


def _render(pipeline) -> torch.Tensor:
    return pipeline(prompt=PROMPT, height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
                    max_sequence_length=32, generator=torch.Generator().manual_seed(0), output_type="pt").frames.float()


@pytest.mark.parametrize("name", ["full", "lora"])
def test_trains_checks_and_logs(runs, name):
    check_trains(runs[name][0], runs[name][2])


def test_full_run_from_caches_exports_a_folder_wan_pipeline_renders(runs):
    from diffusers import WanPipeline
    from PIL import Image
    from safetensors.torch import load_file

    run_dir, _, proc = runs["full"]
    assert proc.returncode == 0, explain(proc)
    assert "entries, built now" in proc.stdout and "loader micro batches" in proc.stdout
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(MODEL) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    frames = _render(WanPipeline.from_pretrained(export))
    assert frames.shape == (1, 5, 3, 32, 32) and torch.isfinite(frames).all()
    with Image.open(run_dir / "samples" / f"step-{STEPS:06d}.webp") as sample:
        assert sample.is_animated and sample.n_frames == 5
    assert (run_dir / "samples" / f"step-{STEPS:06d}.mp4").stat().st_size > 0
    assert f'<img src="step-{STEPS:06d}.webp"' in (run_dir / "samples" / "index.html").read_text()  # the page plays it


def test_full_run_trains_both_sets_with_the_masks_cached_at_the_latent_grid(runs):
    """Each epoch is 3 optimizer steps: the masked set's 4 nine-frame clips and the plain set's 8 five-frame clips;
    the cache holds a mask per clip at the latent grid (3 x 4 x 4 for 9 frames; ones for the plain set)."""
    from dstune.cache.entries import read_entry

    run_dir, _, proc = runs["full"]
    assert proc.returncode == 0, explain(proc)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["steps_per_epoch"] == 3
    assert {group["key"]: group["samples"] for group in plan["groups"]} == {"5f 32x32": 8, "9f 32x32": 4}
    assert [m["epoch"] for m in metrics(run_dir)] == [1, 1, 1, 2]  # epochs counted from 1, as on the console: the step-2 resume is mid-epoch
    masks = {}
    for path in (run_dir.parent / "cache").rglob("*.safetensors"):
        entry = read_entry(path)
        if "loss_mask" in entry:
            masks.setdefault(tuple(entry["loss_mask"].shape), []).append(entry["loss_mask"])
    assert set(masks) == {(1, 3, 4, 4), (1, 2, 4, 4)} and len(masks[(1, 3, 4, 4)]) == 2, masks.keys()
    assert all(bool((mask == 1).all()) for mask in masks[(1, 2, 4, 4)])  # the plain set: whole
    kept = sorted(round(float(mask.mean()), 3) for mask in masks[(1, 3, 4, 4)])
    assert 0.2 < kept[0] < kept[1] < 0.8, kept  # both masked clips keep part of their frames


def test_zero2_full_resume_continues_exactly(runs, tmp_path):
    started = time.perf_counter()
    check_resume(*runs["full"], tmp_path / "resumed", TRANSFORMER)
    print(f"launch resume: {time.perf_counter() - started:.1f} s wall")


def test_lora_on_mp4_files_loads_with_load_lora_weights_and_changes_frames(runs):
    from diffusers import WanPipeline

    run_dir, _, proc = runs["lora"]
    assert proc.returncode == 0, explain(proc)
    assert "entries, built now" in proc.stdout  # the captions' text entries
    check_lora_export(run_dir, proc, MODEL, WanPipeline, _render)


def test_lora_run_trains_every_step_on_one_frame_and_size_bucket(runs):
    """Frame-count buckets x size buckets and sliding chunks: 13 clips (the 36-frame files give two chunks each), the
    plan's buckets printed with their tokens, and the batch check: on both ranks each step's micro batches come from
    the step's bucket, the steps per bucket are the plan's and the ranks agree on the order."""
    run_dir, _, proc = runs["lora"]
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout
    assert re.search(r"dataset samples\s+13\s+13\s+13", out)  # plan, rank 0, rank 1
    assert "9f 32x32" in out and "12 tokens per sample" in out and "1f 32x32" in out
    steps = "5f 32x32: 1, 5f 48x32: 1, 9f 32x32: 1"
    assert re.search(rf"bucket steps\s+{steps}\s+{steps}\s+{steps}", out)
    assert re.search(r"steps mixing buckets\s+0\s+0\s+0", out)
    assert re.search(r"first batch in bucket\s+True\s+True\s+True", out)


def test_two_expert_run_trains_one_expert_and_leaves_the_other_bit_identical(runs):
    """model.expert low_noise: only transformer_2 trains (on the timesteps below the boundary); the export puts it in
    its slot and carries the high-noise expert unchanged, every weight bit for bit."""
    from safetensors.torch import load_file

    run_dir, _, proc = runs["a14b"]
    check_trains(run_dir, proc)
    export, base = run_dir / "export" / f"step-{STEPS:08d}", base_folder(TWO_EXPERTS)
    weights = "diffusion_pytorch_model.safetensors"
    other, start = load_file(export / "transformer" / weights), load_file(base / "transformer" / weights)
    assert set(other) == set(start) and all(torch.equal(other[k], start[k]) for k in start)
    trained, before = load_file(export / "transformer_2" / weights), load_file(base / "transformer_2" / weights)
    assert set(trained) == set(before) and any(not torch.equal(trained[k], before[k]) for k in before)


# ------------------------------------------------------------------------------------------ image-to-video

I2V, TI2V = "tiny-wan-i2v", "tiny-wan22-ti2v"


@pytest.fixture(scope="module")
def i2v_runs(tmp_path_factory) -> dict:
    from dstune.builtin import ensure_builtin_model

    out = {}
    for name, model, stage, train in (("i2v", I2V, 3, "full"), ("ti2v", TI2V, 2, "lora")):
        ensure_builtin_model(model, CACHE_DIR)
        run_dir = tmp_path_factory.mktemp(name) / "run"
        image = first_frame(run_dir.parent / "images")
        cache = {"latents": train == "full", "text_embeddings": True, "dir": str(run_dir.parent / "cache")}
        spec = video_spec(run_dir, model, stage, train, {"path": "builtin:moving-shapes", "cache": cache},
                          {"image_to_video": True} if model == TI2V else {})
        spec["sample"] = {**spec["sample"], "prompts": [PROMPT], "control_images": [str(image)]}
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        started = time.perf_counter()
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2), image)
        print(f"launch {name}: {time.perf_counter() - started:.1f} s wall")
    return out


def _render_from_image(pipeline, image: Path) -> torch.Tensor:
    """Frames from the first frame; the prompt embedded by WanPipeline.encode_prompt (WanImageToVideoPipeline's
    own text path needs ftfy; the embeddings are the same)."""
    from diffusers import WanPipeline
    from PIL import Image

    text = WanPipeline(tokenizer=pipeline.tokenizer, text_encoder=pipeline.text_encoder, vae=None, transformer=None,
                       scheduler=pipeline.scheduler)
    embeds, _ = text.encode_prompt(PROMPT, do_classifier_free_guidance=False, max_sequence_length=32)
    with Image.open(image) as first:
        return pipeline(image=first.convert("RGB"), prompt_embeds=embeds, height=32, width=32, num_frames=5,
                        num_inference_steps=2, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                        output_type="pt").frames.float()


def test_image_to_video_trains_from_first_frames_and_the_export_renders_from_an_image(i2v_runs):
    from diffusers import WanImageToVideoPipeline
    from PIL import Image
    from safetensors.torch import load_file

    from dstune.cache.entries import read_entry

    run_dir, _, proc, image = i2v_runs["i2v"]
    check_trains(run_dir, proc)
    assert "entries, built now" in proc.stdout
    entries = [read_entry(path) for path in (run_dir.parent / "cache").rglob("*.safetensors")]
    latent_entries = [entry for entry in entries if "latent_mean" in entry]
    assert latent_entries and all(entry["condition_mean"].shape == (16, 2, 4, 4) and
                                  entry["image_embeds"].shape == (17, 32) for entry in latent_entries)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(I2V) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    pipeline = WanImageToVideoPipeline.from_pretrained(export)
    frames = _render_from_image(pipeline, image)
    assert frames.shape == (1, 5, 3, 32, 32) and torch.isfinite(frames).all()
    assert not torch.allclose(frames, _render_from_image(WanImageToVideoPipeline.from_pretrained(base_folder(I2V)),
                                                         image))
    with Image.open(run_dir / "samples" / f"step-{STEPS:06d}.webp") as sample:
        assert sample.is_animated and sample.n_frames == 5


def test_ti2v_image_to_video_lora_loads_and_changes_the_frames(i2v_runs):
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from safetensors.torch import load_file

    run_dir, _, proc, image = i2v_runs["ti2v"]
    check_trains(run_dir, proc)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    adapters = load_file(export / "pytorch_lora_weights.safetensors")
    assert adapters and max(t.abs().max().item() for k, t in adapters.items() if ".lora_B." in k) > 0
    parts = WanPipeline.from_pretrained(base_folder(TI2V)).components
    pipeline = WanImageToVideoPipeline(**{k: v for k, v in parts.items() if k != "transformer_2"},
                                       expand_timesteps=True)
    before = _render_from_image(pipeline, image)
    pipeline.load_lora_weights(export)
    after = _render_from_image(pipeline, image)
    assert after.shape == (1, 5, 3, 32, 32) and torch.isfinite(after).all() and not torch.allclose(after, before)
