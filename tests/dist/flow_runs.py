"""What the 2-rank runs of the flow family's image models share (tests/dist/test_flow_models_a.py and _b.py: one
table, ROWS; the edit models' test_flow_qwen_edit.py and test_flow_kontext_flux2.py: the pairs, on_pairs and
render_edit): the spec, the launches, and the checks a full run, a LoRA run and a resume get."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from safetensors.torch import load_file

from harness import CACHE_DIR, base_spec, explain, launch, memory_phase_rows, memory_problems, metrics, write_spec

STEPS = 4
TRANSFORMER = Path("transformer") / "diffusion_pytorch_model.safetensors"


def flow_spec(run_dir: Path, model: str, stage: int, train: str) -> dict:
    """A full run reads cached latents and text and renders samples; a LoRA run checkpoints its activations."""
    lora = train == "lora"
    return base_spec(
        run_dir,
        model={"family": "flow", "pretrained": f"builtin:{model}", "train": train, "gradient_checkpointing": lora,
               "timestep_sampling": "uniform"},
        data={"cache": {"latents": not lora, "text_embeddings": not lora, "dir": str(run_dir.parent / "cache")}},
        train={"global_batch_size": 4, "micro_batch_size": 2, "gradient_accumulation_steps": None, "max_steps": STEPS,
               "optimizer": {"type": "adamw", "lr": 1e-3 if lora else 2e-4}},
        deepspeed={"zero_stage": stage},
        output={"save_every_steps": 2, "keep_last": 5, "export": "diffusers"},
        sample={"prompts": [] if lora else ["a red circle"], "steps": 2, "guidance": 1.0},
    )


def write_pairs(root: Path, pairs: int = 8, side: int = 64) -> None:
    """An edit model's data: target/NNN.png (a shape) with its instruction, control/NNN.png (another shape)."""
    from dstune.data.synthetic import render_shape

    for folder in ("target", "control"):
        (root / folder).mkdir(parents=True)
    for number in range(pairs):
        target, caption = render_shape(number, side)
        target.save(root / "target" / f"{number:03d}.png")
        (root / "target" / f"{number:03d}.txt").write_text(f"turn it into {caption}")
        render_shape(number + 100, side)[0].save(root / "control" / f"{number:03d}.png")


def on_pairs(pairs: Path, side: int, source: int = 5, **sample) -> Callable:
    """`adjust(spec, train)` for an edit model trained on `write_pairs(pairs)`: targets from target/, references
    from ../control (data.control_dir), and samples (both runs) from control/NNN.png with the instruction; `sample`
    adds sample.* settings (the guidance the model renders with)."""

    def adjust(spec: dict, train: str) -> None:
        spec["data"].update(path=str(pairs / "target"), control_dir="../control", resolution=side)
        spec["sample"].update(prompts=[EDIT_PROMPT], control_images=[str(pairs / "control" / f"{source:03d}.png")],
                              **sample)

    return adjust


EDIT_PROMPT = "turn it into a red circle"


def render_edit(pipeline, source: int, side: int, **arguments) -> torch.Tensor:
    """One `side` px image of EDIT_PROMPT from reference shape `source` (render_shape's numbering), 2 steps, seeded."""
    from dstune.data.synthetic import render_shape

    return pipeline(image=render_shape(source, side)[0], prompt=EDIT_PROMPT, height=side, width=side,
                    num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt",
                    **arguments).images.float()


def launch_cases(tmp_path_factory, model: str, cases: dict, adjust=None) -> dict:
    """name -> (run_dir, spec_path, finished 2-rank launch) for each case (name -> (zero stage, train)) of
    `flow_spec`, after building the built-in model once here (not by both launches' rank 0); `adjust(spec, train)`
    edits a case's spec before it is written."""
    from dstune.builtin import ensure_builtin_model

    ensure_builtin_model(model, CACHE_DIR)
    out = {}
    for name, (stage, train) in cases.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"
        spec = flow_spec(run_dir, model, stage, train)
        if adjust is not None:
            adjust(spec, train)
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
    return out


def base_folder(model: str) -> Path:
    return next(CACHE_DIR.glob(f"builtin/{model}-v*/"))


def check_trains(run_dir: Path, proc) -> None:
    assert proc.returncode == 0, explain(proc)
    assert "batch check passed" in proc.stdout and "rank 1" in proc.stdout
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in logged)
    assert "use_reentrant" not in proc.stdout + proc.stderr


def check_full_export(run_dir: Path, proc, model: str, pipeline_class, render) -> None:
    """Caches built before step 1, the trained transformer exported in a folder `pipeline_class` loads and renders
    with (`render(pipeline)` -> image tensor), samples written."""
    assert proc.returncode == 0, explain(proc)
    assert "entries, built now" in proc.stdout
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(model) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    image = render(pipeline_class.from_pretrained(export))
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()
    assert (run_dir / "samples" / f"step-{STEPS:06d}.png").is_file()


def check_memory_phases(run_dir: Path, proc) -> None:
    """The memory plan against the run's measurement per phase (harness.memory_problems: predicted >= 0.9 x
    measured, under the ceiling), the cache phase with its encoders' pass over a chunk and the sample phase with the
    VAE's decode and a sampling forward (dstune.memory.working) among its parts."""
    import json

    assert proc.returncode == 0, explain(proc)
    phases = json.loads((run_dir / "memory.json").read_text())["predicted"]["phases"]
    assert phases["cache"]["parts"]["VAE encode of one chunk"] > 0
    assert phases["sample"]["parts"]["VAE decode of the samples"] > 0 and phases["sample"]["parts"]["one sampling forward"] > 0
    for name, planned, measured, _ in memory_phase_rows(run_dir):
        print(f"{run_dir.parent.name} {name}: predicted {planned / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB")
    assert not memory_problems(run_dir), memory_problems(run_dir)


def check_lora_export(run_dir: Path, proc, model: str, pipeline_class, render) -> None:
    """Only adapters trained (B moved off zero); the LoRA file loads with load_lora_weights and changes the image."""
    assert proc.returncode == 0, explain(proc)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    adapters = load_file(export / "pytorch_lora_weights.safetensors")
    assert adapters and all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in adapters)
    assert max(t.abs().max().item() for k, t in adapters.items() if ".lora_B." in k) > 0
    pipeline = pipeline_class.from_pretrained(base_folder(model))
    before = render(pipeline)
    pipeline.load_lora_weights(export)
    assert not torch.allclose(render(pipeline), before)


def check_lora_samples_from(run_dir: Path, proc, folder: str) -> None:
    """The LoRA run's samples were rendered by `folder`'s transformer with the trained LoRA, before and after."""
    assert proc.returncode == 0, explain(proc)
    name = folder.split(":", 1)[-1]
    assert any(f"{name}-v" in line and "transformer with the trained LoRA" in line for line in proc.stdout.splitlines())
    assert all((run_dir / "samples" / f"step-{step:06d}.png").is_file() for step in (0, STEPS))


def check_resume(run_dir: Path, spec_path: Path, proc, resumed: Path, compared: Path) -> None:
    """Resumed from step 2 into `resumed`: steps 3-4 have the same losses, and the export's `compared` file (the
    transformer, or the LoRA file) the same tensors, as the uninterrupted run."""
    assert proc.returncode == 0, explain(proc)
    again = launch(spec_path, num_ranks=2, args=resume_from_step_2(run_dir, resumed))
    assert again.returncode == 0, explain(again)
    check_resumed(run_dir, resumed, compared)


def resume_from_step_2(run_dir: Path, resumed: Path) -> tuple:
    """`resumed` given `run_dir`'s step-2 checkpoint as its latest; the `dstune train` flags that resume it there."""
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    (resumed / "checkpoints" / "latest").write_text("step-00000002")
    return ("--resume", "latest", "--set", f"output.dir={resumed}")


def check_resumed(run_dir: Path, resumed: Path, compared: Path) -> None:
    """check_resume's comparison of a run resumed from step 2 (resume_from_step_2) with the uninterrupted one."""
    first, second = metrics(run_dir), metrics(resumed)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)
    a = load_file(run_dir / "export" / f"step-{STEPS:08d}" / compared)
    b = load_file(resumed / "export" / f"step-{STEPS:08d}" / compared)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


# ------------------------------------------------------------------------------------- the table of image models


def _render_with(**guidance):
    """`render(pipeline)`: one 32 px image of "a red circle" in 2 steps, seeded, with the pipeline's guidance key."""
    def render(pipeline) -> torch.Tensor:
        return pipeline(prompt="a red circle", height=32, width=32, num_inference_steps=2,
                        generator=torch.Generator().manual_seed(0), output_type="pt", **guidance).images.float()
    return render


@dataclass(frozen=True)
class FlowRow:
    """One image model of the flow family in the 2-rank table (tests/dist/test_flow_models_*.py)."""

    pipeline_class: str  # the diffusers pipeline its export and LoRA load in
    render: Callable  # pipeline -> image tensor
    resume_case: Optional[str] = None  # the case that also resumes from step 2 (None: no resume launch)
    full_case: str = "zero2"
    lora_case: str = "lora-zero3"
    sample_pretrained: Optional[str] = None  # the LoRA run samples with this folder's transformer (sample.pretrained)
    loader: Optional[Callable] = None  # folder -> pipeline, where from_pretrained cannot load the folder itself

    @property
    def cases(self) -> dict:
        return {self.full_case: (2, "full"), self.lora_case: (3, "lora")}

    def adjust(self, spec: dict, train: str) -> None:
        """The LoRA run of a row with sample_pretrained renders samples there (collective under ZeRO-3)."""
        if self.sample_pretrained and train == "lora":
            spec["sample"].update(prompts=["a red circle"], pretrained=self.sample_pretrained, guidance=0.0)

    def pipeline(self):
        import diffusers

        if self.loader is not None:  # what the checks call: from_pretrained(folder)
            return type("Loader", (), {"from_pretrained": staticmethod(self.loader)})
        return getattr(diffusers, self.pipeline_class)


# Resume is a property of the flow core, not of a model: it is checked for a full ZeRO-2 run from caches
# (Qwen-Image) and a ZeRO-3 LoRA run with checkpointing (Z-Image). FLUX.2 [klein] and [dev] train on reference
# pairs in test_flow_kontext_flux2.py instead (the same class, with the references' tokens).
ROWS = {
    "tiny-qwen-image": FlowRow("QwenImagePipeline", _render_with(true_cfg_scale=1.0), resume_case="zero2"),
    "tiny-z-image": FlowRow("ZImagePipeline", _render_with(guidance_scale=1.0), resume_case="lora-zero3"),
    # Krea 2 (Raw): rendered without classifier-free guidance (Krea2Pipeline's guidance_scale 0)
    # its LoRA run samples with the Turbo layout's transformer (sample.pretrained), gathering the adapters under ZeRO-3
    "tiny-krea2": FlowRow("Krea2Pipeline", _render_with(guidance_scale=0.0), resume_case="lora-zero3",
                          sample_pretrained="builtin:tiny-krea2-turbo"),
}
# Ideogram 4 draws sigma off the tables (its class's sigma_draw) and loads its unconditional transformer for samples
# only: its LoRA run resumes too. A constant guidance_scale replaces the pipeline's default per-step schedule.
ROWS["tiny-ideogram4"] = FlowRow("Ideogram4Pipeline", _render_with(guidance_scale=1.0, guidance_schedule=None,
                                                                   max_sequence_length=128),
                                 resume_case="lora-zero3")

# ERNIE-Image: its text is padded to max_sequence_length with a mask (text_lens); its LoRA run resumes too
ROWS["tiny-ernie-image"] = FlowRow("ErnieImagePipeline", _render_with(guidance_scale=1.0), resume_case="lora-zero3")

# Qwen-Image 2.1: the tiny folder's processor is a tokenizer (no Qwen3VLProcessor without torchvision), so its
# pipelines are built from the folder's parts; the pipeline renders RGBA, whose RGB the checks compare.
def _qwen_image_21_pipeline(folder):
    from dstune.models.qwen_image_21.model import pipeline_from_parts

    return pipeline_from_parts(folder)


def _render_rgb(pipeline) -> torch.Tensor:
    return _render_with()(pipeline)[:, :3]


ROWS["tiny-qwen-image-21"] = FlowRow("QwenImage21Pipeline", _render_rgb, resume_case="zero2",
                                     loader=_qwen_image_21_pipeline)


def resumed_file(row: FlowRow, case: str) -> Path:
    """The export file a resume compares: the transformer of a full run, the LoRA file of a LoRA run."""
    return TRANSFORMER if row.cases[case][1] == "full" else Path("pytorch_lora_weights.safetensors")
