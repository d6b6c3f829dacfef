"""What the 2-rank runs of the video models share (tests/dist/test_wan.py, test_hunyuan_video15.py, test_ltx2.py):
the spec of a run on builtin:moving-shapes and the first frame an image-to-video run starts from."""

from __future__ import annotations

from pathlib import Path

from flow_runs import STEPS
from harness import base_spec

PROMPT = "a red circle moving left"


def video_spec(run_dir: Path, model: str, stage: int, train: str, data: dict, keys: dict | None = None) -> dict:
    """A 4-step run of builtin:`model` (full: micro batch 2, samples; LoRA: micro batch 1 with gradient
    checkpointing), `keys` added to its model section."""
    lora = train == "lora"
    return base_spec(
        run_dir,
        model={"family": "video", "pretrained": f"builtin:{model}", "train": train, "gradient_checkpointing": lora,
               **(keys or {})},
        data=data,
        train={"global_batch_size": 4, "micro_batch_size": 1 if lora else 2, "gradient_accumulation_steps": None,
               "max_steps": STEPS,
               "optimizer": {"type": "adamw", "lr": 1e-2 if lora else 2e-4}},
        deepspeed={"zero_stage": stage},
        output={"save_every_steps": 2, "keep_last": 5, "export": "diffusers"},
        sample={"prompts": [] if lora else [PROMPT], "steps": 2, "guidance": 1.0},
    )


def first_frame(folder: Path) -> Path:
    """The first frame of builtin:moving-shapes' clip 0 ("a red circle moving left") as a PNG in `folder`."""
    from dstune.data.synthetic import render_moving_shape

    frames, _ = render_moving_shape(0, 32, 5)
    folder.mkdir(parents=True, exist_ok=True)
    frames[0].save(folder / "first.png")
    return folder / "first.png"
