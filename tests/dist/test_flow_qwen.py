"""Real 2-rank DeepSpeed training of Qwen-Image (builtin:tiny-qwen-image, the flow family's qwen_image recipe) on
CPU: full fine-tuning under ZeRO 2 from cached latents and text embeddings (trains, samples, resumes exactly,
exports a folder QwenImagePipeline loads and renders with) and LoRA under ZeRO 3 with gradient checkpointing (only
adapters train; the LoRA file loads with QwenImagePipeline.load_lora_weights and changes the image). Three launches
in all, shared by the tests below."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import CACHE_DIR, base_spec, explain, launch, metrics, write_spec

pytestmark = pytest.mark.dist

STEPS = 4
TRANSFORMER = Path("transformer") / "diffusion_pytorch_model.safetensors"
CASES = {"qwen-zero2": (2, "full"), "qwen-lora-zero3": (3, "lora")}


def _spec(run_dir: Path, stage: int, train: str) -> dict:
    lora = train == "lora"
    return base_spec(
        run_dir,
        model={"family": "flow", "pretrained": "builtin:tiny-qwen-image", "train": train,
               "gradient_checkpointing": lora, "timestep_sampling": "uniform"},
        data={"cache": {"latents": not lora, "text_embeddings": not lora, "dir": str(run_dir.parent / "cache")}},
        train={"global_batch_size": 4, "micro_batch_size": 2, "gradient_accumulation_steps": None, "max_steps": STEPS,
               "optimizer": {"type": "adamw", "lr": 1e-3 if lora else 2e-4}},
        deepspeed={"zero_stage": stage},
        output={"save_every_steps": 2, "keep_last": 5, "export": "diffusers"},
        sample={"prompts": [] if lora else ["a red circle"], "steps": 2, "guidance": 1.0},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from dstune.builtin import ensure_builtin_model

    ensure_builtin_model("tiny-qwen-image", CACHE_DIR)  # built once here, not by both launches' rank 0
    out = {}
    for name, case in CASES.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"
        spec_path = write_spec(run_dir.parent / "spec.yaml", _spec(run_dir, *case))
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
    return out


def _render(pipeline) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    image = pipeline(prompt="a red circle", height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0,
                     generator=generator, output_type="pt").images
    return image.float()


@pytest.mark.parametrize("name", list(CASES))
def test_trains_checks_and_logs(runs, name):
    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    assert "batch check passed" in proc.stdout and "rank 1" in proc.stdout
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in logged)
    assert "use_reentrant" not in proc.stdout + proc.stderr


def test_full_export_loads_in_qwen_image_pipeline_and_renders(runs):
    from diffusers import QwenImagePipeline

    run_dir, _, proc = runs["qwen-zero2"]
    assert proc.returncode == 0, explain(proc)
    assert "entries, built now" in proc.stdout  # latents and text embeddings cached before step 1
    export = run_dir / "export" / f"step-{STEPS:08d}"
    base = next(CACHE_DIR.glob("builtin/tiny-qwen-image-v*/"))
    trained, start = load_file(export / TRANSFORMER), load_file(base / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    image = _render(QwenImagePipeline.from_pretrained(export))
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()
    assert (run_dir / "samples" / f"step-{STEPS:06d}.png").is_file()


def test_lora_trains_adapters_only_and_loads_with_load_lora_weights(runs):
    from diffusers import QwenImagePipeline

    run_dir, _, proc = runs["qwen-lora-zero3"]
    assert proc.returncode == 0, explain(proc)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    adapters = load_file(export / "pytorch_lora_weights.safetensors")
    assert adapters and all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in adapters)
    assert max(t.abs().max().item() for k, t in adapters.items() if ".lora_B." in k) > 0  # B starts at zero
    base = next(CACHE_DIR.glob("builtin/tiny-qwen-image-v*/"))
    pipeline = QwenImagePipeline.from_pretrained(base)
    before = _render(pipeline)
    pipeline.load_lora_weights(export)
    assert not torch.allclose(_render(pipeline), before)


def test_zero2_resume_continues_exactly(runs, tmp_path):
    run_dir, spec_path, proc = runs["qwen-zero2"]
    assert proc.returncode == 0, explain(proc)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    (resumed / "checkpoints" / "latest").write_text("step-00000002")
    again = launch(spec_path, num_ranks=2, args=("--resume", "latest", "--set", f"output.dir={resumed}"))
    assert again.returncode == 0, explain(again)
    first, second = metrics(run_dir), metrics(resumed)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)
    a = load_file(run_dir / "export" / f"step-{STEPS:08d}" / TRANSFORMER)
    b = load_file(resumed / "export" / f"step-{STEPS:08d}" / TRANSFORMER)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
