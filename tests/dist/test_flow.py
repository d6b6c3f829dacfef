"""Real 2-rank DeepSpeed training of the `flow` family on CPU: SD3-class under ZeRO 3 (trains, passes the batch check,
samples, resumes exactly, exports a StableDiffusion3Pipeline) and Flux-class LoRA under ZeRO 2 with gradient
checkpointing, from cached latents and text embeddings (trains, samples, exports a LoRA file FluxPipeline loads;
the memory plan's cache and sample phases hold what it measured). Three launches in all, shared by the tests
below."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flow_runs import check_memory_phases
from harness import CACHE_DIR, base_spec, explain, launch, metrics, write_spec

pytestmark = pytest.mark.dist

STEPS = 4
TRANSFORMER = Path("transformer") / "diffusion_pytorch_model.safetensors"
CASES = {  # name -> (built-in model, zero stage, gradient checkpointing, sample prompts, cache and LoRA)
    "sd3-zero3": ("tiny-flow", 3, False, ["a red circle"], False),
    "flux-lora-zero2": ("tiny-flux", 2, True, ["a red circle"], True),
}


def _spec(run_dir: Path, model: str, stage: int, checkpointing: bool, prompts: list[str], cache: bool) -> dict:
    return base_spec(
        run_dir,
        model={"family": "flow", "pretrained": f"builtin:{model}", "gradient_checkpointing": checkpointing,
               "train": "lora" if cache else "full"},
        data={"cache": {"latents": cache, "text_embeddings": cache, "dir": str(run_dir.parent / "cache")}},
        train={"global_batch_size": 4, "micro_batch_size": 2, "gradient_accumulation_steps": None, "max_steps": STEPS},
        deepspeed={"zero_stage": stage},
        output={"save_every_steps": 2, "keep_last": 5, "export": "diffusers"},
        sample={"prompts": prompts, "steps": 2},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from dstune.builtin import ensure_builtin_model

    for model, *_ in CASES.values():  # built here, in one process: both share one VAE build
        ensure_builtin_model(model, CACHE_DIR)
    out = {}
    for name, case in CASES.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"
        spec_path = write_spec(run_dir.parent / "spec.yaml", _spec(run_dir, *case))
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_trains_checks_and_exports_a_pipeline_that_runs(runs, name):
    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    assert "batch check passed" in proc.stdout and "rank 1" in proc.stdout
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in logged)
    assert "use_reentrant" not in proc.stdout + proc.stderr
    if CASES[name][4]:  # every latent and caption embedding encoded before step 1, by both ranks together
        assert re.search(r"\(ranks 0, 1\): (\d+) entries, built now \1, already cached 0, failed 0", proc.stdout)

    from diffusers import DiffusionPipeline

    export = run_dir / "export" / f"step-{STEPS:08d}"
    base = next(CACHE_DIR.glob(f"builtin/{CASES[name][0]}-v*/"))
    if CASES[name][4]:  # LoRA: the adapters alone (flow's default format: diffusers, in peft naming), trained
        adapters = load_file(export / "pytorch_lora_weights.safetensors")  # (B starts at zero), loaded
        assert adapters and all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in adapters)
        assert max(t.abs().max().item() for k, t in adapters.items() if ".lora_B." in k) > 0
        pipe = DiffusionPipeline.from_pretrained(base)
        pipe.load_lora_weights(export)
    else:
        pipe = DiffusionPipeline.from_pretrained(export)
        trained, start = load_file(export / TRANSFORMER), load_file(base / TRANSFORMER)
        assert set(trained) == set(start)
        assert max((trained[k] - start[k]).abs().max().item() for k in start) > 0
    assert type(pipe).__name__ == {"sd3-zero3": "StableDiffusion3Pipeline", "flux-lora-zero2": "FluxPipeline"}[name]
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                 max_sequence_length=32).images[0]
    assert image.shape == (32, 32, 3)


def test_samples_are_rendered_under_zero3_before_and_after(runs):
    run_dir, _, proc = runs["sd3-zero3"]
    assert proc.returncode == 0, explain(proc)
    assert sorted(p.name for p in (run_dir / "samples").glob("*.png")) == ["step-000000.png", f"step-{STEPS:06d}.png"]


def test_zero3_resume_continues_exactly(runs, tmp_path):
    """Resume from the step-2 checkpoint: steps 3-4 reproduce the uninterrupted run's losses and final weights."""
    run_dir, spec_path, proc = runs["sd3-zero3"]
    assert proc.returncode == 0, explain(proc)
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed_dir / "checkpoints" / "step-00000002")
    (resumed_dir / "checkpoints" / "latest").write_text("step-00000002")
    again = launch(spec_path, num_ranks=2, args=("--resume", "latest", "--set", f"output.dir={resumed_dir}",
                                                 "--set", "sample.prompts=[]"))
    assert again.returncode == 0, explain(again)
    assert "resumed from" in again.stdout
    first, second = metrics(run_dir), metrics(resumed_dir)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)
        assert after["samples"] == before["samples"]
    a = load_file(run_dir / "export" / f"step-{STEPS:08d}" / TRANSFORMER)
    b = load_file(resumed_dir / "export" / f"step-{STEPS:08d}" / TRANSFORMER)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_flux_lora_cache_and_sample_phases_are_within_the_plan(runs):
    """FLUX.1 LoRA from both caches with samples (launch/flux-lora-zero3-8gpu.yaml's tiny twin): the plan's cache
    phase (the VAE's or the text encoders' pass over a chunk beside the loaded parts) and sample phase (the decode or
    a sampling forward) hold what the ranks measured."""
    run_dir, _, proc = runs["flux-lora-zero2"]
    check_memory_phases(run_dir, proc)
