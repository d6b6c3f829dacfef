"""Real 2-rank DeepSpeed training of HunyuanVideo 1.5 (model.family video; the folder chooses the model) on CPU, two
launches: builtin:tiny-hunyuan-video15 in full under ZeRO 2 from the latent and text caches, its export rendered by
HunyuanVideo15Pipeline; builtin:tiny-hunyuan-video15-i2v image-to-video with LoRA under ZeRO 3 and gradient
checkpointing (the SigLIP embedding stored in the latent cache), resumed from its step-2 checkpoint with the same
losses and LoRA file, which the pipeline's transformer loads with load_lora_adapter and which changes the frames.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from flow_runs import STEPS, TRANSFORMER, base_folder, check_memory_phases, check_resume, check_trains
from harness import CACHE_DIR, launch, write_spec
from video_runs import PROMPT, first_frame, video_spec

pytestmark = pytest.mark.dist

FULL, I2V = "tiny-hunyuan-video15", "tiny-hunyuan-video15-i2v"
TEXT_TOKENS = 48  # the tiny model's Qwen side; the default 1000 tokens would make the text encoder most of a step
RUNS = {  # run name -> (model, ZeRO stage, train)
    "full": (FULL, 2, "full"),
    "lora": (I2V, 3, "lora"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The ZeRO-2 full run from both caches, and the image-to-video ZeRO-3 LoRA run with gradient checkpointing."""
    from dstune.builtin import ensure_builtin_model

    out = {}
    for name, (model, stage, train) in RUNS.items():
        ensure_builtin_model(model, CACHE_DIR)
        run_dir = tmp_path_factory.mktemp(f"hunyuan-video15-{name}") / "run"
        cache = {"latents": True, "text_embeddings": True, "dir": str(run_dir.parent / "cache")}
        spec = video_spec(run_dir, model, stage, train, {"path": "builtin:moving-shapes", "cache": cache},
                          {"max_sequence_length": TEXT_TOKENS})
        if model == I2V:
            image = first_frame(run_dir.parent / "images")
            spec["sample"] = {**spec["sample"], "prompts": [PROMPT], "control_images": [str(image)]}
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        started = time.perf_counter()
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
        print(f"launch {name}: {time.perf_counter() - started:.1f} s wall")
    return out


def _render_hv15(pipeline, image: Path | None = None) -> torch.Tensor:
    from PIL import Image

    pipeline.guider = type(pipeline.guider).from_config({**pipeline.guider.config, "guidance_scale": 1.0})
    common = dict(prompt=PROMPT, num_frames=5, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                  output_type="pt")
    if image is None:
        return pipeline(height=32, width=32, **common).frames.float()
    with Image.open(image) as first:
        return pipeline(image=first.convert("RGB"), **common).frames.float()


def test_full_run_from_caches_exports_a_folder_the_pipeline_renders(runs):
    from diffusers import HunyuanVideo15Pipeline
    from safetensors.torch import load_file

    run_dir, _, proc = runs["full"]
    check_trains(run_dir, proc)
    assert "entries, built now" in proc.stdout
    # the text cache replaces the text encoders: rank 1 never loads them, and the samples read their prompt's text
    assert "text encoders: loaded on rank 0 only (the first of each node; 1 of 2 ranks)" in proc.stdout
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(FULL) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    frames = _render_hv15(HunyuanVideo15Pipeline.from_pretrained(export))
    assert frames.shape == (1, 5, 3, 32, 32) and torch.isfinite(frames).all()
    assert (run_dir / "samples" / f"step-{STEPS:06d}.mp4").stat().st_size > 0
    # launch/hunyuan-video15-720p-lora-zero3-8gpu.yaml's tiny twin: the plan's cache and sample phases (the VAE's
    # encode of a chunk, its decode or a sampling forward) hold what the ranks measured, the step its transients
    check_memory_phases(run_dir, proc)
    assert json.loads((run_dir / "memory.json").read_text())["predicted"]["per_gpu"]["backward_transients_bytes"] > 0


def test_i2v_lora_zero3_resumes_exactly_and_its_file_loads_into_the_transformer(runs, tmp_path):
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from safetensors.torch import load_file

    from dstune.cache.entries import read_entry

    run_dir, spec_path, proc = runs["lora"]
    check_trains(run_dir, proc)
    entries = [read_entry(path) for path in (run_dir.parent / "cache").rglob("*.safetensors")]
    assert [entry["image_embeds"].shape for entry in entries if "latent_mean" in entry][0] == (16, 16)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    adapters = load_file(export / "pytorch_lora_weights.safetensors")
    assert adapters and all(k.startswith("transformer.") and ".lora_" in k for k in adapters)
    assert max(t.abs().max().item() for k, t in adapters.items() if ".lora_B." in k) > 0
    image = run_dir.parent / "images" / "first.png"
    pipeline = HunyuanVideo15ImageToVideoPipeline.from_pretrained(base_folder(I2V))
    before = _render_hv15(pipeline, image)
    pipeline.transformer.load_lora_adapter(str(export), weight_name="pytorch_lora_weights.safetensors",
                                           prefix="transformer")
    after = _render_hv15(pipeline, image)
    assert after.shape == (1, 5, 3, 32, 32) and torch.isfinite(after).all() and not torch.allclose(after, before)
    started = time.perf_counter()
    check_resume(run_dir, spec_path, proc, tmp_path / "resumed", Path("pytorch_lora_weights.safetensors"))
    print(f"launch hv15 resume: {time.perf_counter() - started:.1f} s wall")
