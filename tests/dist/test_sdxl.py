"""Real 2-rank DeepSpeed runs of the `sdxl` family on CPU (three launches, shared by the tests below): ZeRO 2 trains
on non-square images, passes the batch check, samples and exports a pipeline StableDiffusionXLPipeline loads; a
resumed run continues exactly; a run from the latent + text-embedding cache follows the on-the-fly losses (so the
cached crop geometry and the cached pooled embeddings are the ones the image loader makes)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harness import CACHE_DIR, base_spec, explain, launch, metrics, write_spec

pytestmark = pytest.mark.dist

STEPS = 4
# (width, height) of the training images: wide, tall and square, so crops have non-zero offsets that a flip moves.
SIZES = [(48, 32), (32, 56), (40, 40), (64, 36)]


def _image_folder(root: Path) -> Path:
    from dstune.data.synthetic import render_shape

    root.mkdir(parents=True)
    for i in range(8):
        image, caption = render_shape(i, 64)
        image.resize(SIZES[i % len(SIZES)]).save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(caption)
    return root


def _spec(run_dir: Path, images: Path, cached: bool) -> dict:
    return base_spec(
        run_dir,
        model={"family": "sdxl", "pretrained": "builtin:tiny-sdxl"},
        data={"path": str(images), "random_flip": True, "caption_dropout": 0.25,
              "cache": {"latents": cached, "text_embeddings": cached, "dir": str(run_dir.parent / "encoded")}},
        train={"global_batch_size": 4, "micro_batch_size": 2, "gradient_accumulation_steps": None,
               "max_steps": STEPS},
        deepspeed={"zero_stage": 2},
        output={"save_every_steps": 2, "keep_last": 5, "export": "diffusers"},
        sample={"prompts": ["a red circle"], "steps": 2},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sdxl")
    images = _image_folder(root / "images")
    out = {}
    for name, cached in (("fresh", False), ("cached", True)):
        run_dir = root / name / "run"
        spec_path = write_spec(root / f"{name}.yaml", _spec(run_dir, images, cached))
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
    run_dir, spec_path, proc = out["fresh"]
    resumed = root / "resumed"
    if proc.returncode == 0:
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
        (resumed / "checkpoints" / "latest").write_text("step-00000002")
        out["resumed"] = (resumed, spec_path, launch(spec_path, num_ranks=2,
                                                     args=("--resume", "latest", "--set", f"output.dir={resumed}")))
    return out


def test_trains_under_zero2_checks_batches_and_samples(runs):
    run_dir, _, proc = runs["fresh"]
    assert proc.returncode == 0, explain(proc)
    assert "batch check passed" in proc.stdout and "rank 1" in proc.stdout
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert logged[-1]["samples"] == STEPS * 4
    assert (run_dir / "samples" / "step-000000.png").is_file()
    assert (run_dir / "samples" / f"step-{STEPS:06d}.png").is_file()


def test_export_reloads_with_the_sdxl_pipeline_and_holds_trained_weights(runs):
    import torch
    from diffusers import StableDiffusionXLPipeline

    run_dir, _, proc = runs["fresh"]
    assert proc.returncode == 0, explain(proc)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    pipeline = StableDiffusionXLPipeline.from_pretrained(export)
    image = pipeline("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                     generator=torch.Generator().manual_seed(0)).images[0]
    assert image.shape == (32, 32, 3)
    unet = Path("unet") / "diffusion_pytorch_model.safetensors"
    trained, start = load_file(export / unet), load_file(CACHE_DIR / "builtin" / "tiny-sdxl-v1" / unet)
    assert set(trained) == set(start)
    assert max((trained[k] - start[k]).abs().max().item() for k in start) > 0


def test_resume_continues_exactly(runs):
    run_dir, _, proc = runs["fresh"]
    assert proc.returncode == 0, explain(proc)
    resumed_dir, _, again = runs["resumed"]
    assert again.returncode == 0, explain(again)
    assert "resumed from" in again.stdout
    first, second = metrics(run_dir), metrics(resumed_dir)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)
    unet = Path("unet") / "diffusion_pytorch_model.safetensors"
    a = load_file(run_dir / "export" / f"step-{STEPS:08d}" / unet)
    b = load_file(resumed_dir / "export" / f"step-{STEPS:08d}" / unet)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_cached_run_follows_the_on_the_fly_losses(runs):
    """Same spec, but trained from cached posteriors, prompt embeddings and pooled embeddings; the crop geometry
    then comes from the image headers. Equal losses mean every piece of conditioning matched."""
    fresh_dir, _, fresh = runs["fresh"]
    cached_dir, _, cached = runs["cached"]
    assert cached.returncode == 0, explain(cached)
    assert "cache:" in cached.stdout and "batch check passed" in cached.stdout
    entries = list((cached_dir.parent / "encoded").rglob("*.safetensors"))
    text = [load_file(p) for p in entries if p.parts[-3] == "text"]
    assert text and all(set(t) == {"encoder_hidden_states", "text_embeds"} for t in text)
    assert fresh.returncode == 0, explain(fresh)
    for a, b in zip(metrics(fresh_dir), metrics(cached_dir)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
