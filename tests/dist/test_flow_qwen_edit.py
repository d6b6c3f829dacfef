"""Real 2-rank DeepSpeed training of the edit models. Qwen-Image-Edit (builtin:tiny-qwen-image-edit: its card and class in
dstune.models.qwen_image) on CPU, from a folder of source/target pairs (data.control_dir): full fine-tuning under ZeRO 2
from cached target and source latents (trains, renders samples from sample.control_images, resumes exactly, exports a
folder QwenImageEditPipeline loads and renders from a source image) and LoRA under ZeRO 3 with gradient checkpointing
(only adapters train; the LoRA file loads with QwenImageEditPipeline.load_lora_weights and changes the image).
Qwen-Image-Edit-2509 (builtin:tiny-qwen-image-edit-plus, two references per sample): its own section below. Six
launches (helpers: flow_runs.py); FLUX.1 Kontext and FLUX.2 image-to-image: test_flow_kontext_flux2.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flow_runs import (STEPS, TRANSFORMER, base_folder, check_lora_export, check_resume, check_trains, launch_cases,
                       write_pairs)
from harness import explain

pytestmark = pytest.mark.dist

MODEL = "tiny-qwen-image-edit"
PAIRS, SIDE = 8, 64  # 8 px per latent: 8x8 latents
CASES = {"edit-zero2": (2, "full"), "edit-lora-zero3": (3, "lora")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    pairs = tmp_path_factory.mktemp("pairs")
    write_pairs(pairs, PAIRS, SIDE)

    def on_pairs(spec: dict, train: str) -> None:
        spec["data"].update(path=str(pairs / "target"), control_dir="../control", resolution=SIDE)
        spec["data"]["cache"]["text_embeddings"] = False  # an edit embedding belongs to a (caption, image) pair
        if train == "full":  # samples edit a source image, before step 1 and after the last
            spec["sample"].update(prompts=["turn it into a red circle"],
                                  control_images=[str(pairs / "control" / "005.png")])

    return launch_cases(tmp_path_factory, MODEL, CASES, on_pairs)


class EditPipeline:
    """QwenImageEditPipeline.from_pretrained with the folder's processor as dstune loads it (transformers builds a
    Qwen2VLProcessor only with torchvision installed; dstune.models.qwen_image.model.load_processor)."""

    @staticmethod
    def from_pretrained(folder):
        from diffusers import QwenImageEditPipeline

        from dstune.models.qwen_image.model import load_processor

        return QwenImageEditPipeline.from_pretrained(folder, processor=load_processor(folder))


def _render(pipeline) -> torch.Tensor:
    from dstune.data.synthetic import render_shape

    source = render_shape(105, SIDE)[0]
    return pipeline(image=source, prompt="turn it into a red circle", height=SIDE, width=SIDE, num_inference_steps=2,
                    true_cfg_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="pt").images.float()


@pytest.mark.parametrize("name", list(CASES))
def test_trains_from_pairs_checks_and_logs(runs, name):
    run_dir, _, proc = runs[name]
    check_trains(run_dir, proc)


def test_full_export_loads_in_qwen_image_edit_pipeline_and_renders_from_a_source(runs):
    run_dir, _, proc = runs["edit-zero2"]
    assert proc.returncode == 0, explain(proc)
    assert f"{2 * PAIRS} entries, built now {2 * PAIRS}" in proc.stdout  # target and source latents
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(MODEL) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    pipeline = EditPipeline.from_pretrained(export)
    image = _render(pipeline)
    assert image.shape == (1, 3, SIDE, SIDE) and torch.isfinite(image).all()
    assert not torch.allclose(image, _render(EditPipeline.from_pretrained(base_folder(MODEL))))
    assert (run_dir / "samples" / f"step-{STEPS:06d}.png").is_file()  # rendered from sample.control_images


def test_lora_trains_adapters_only_and_loads_with_load_lora_weights(runs):
    check_lora_export(runs["edit-lora-zero3"][0], runs["edit-lora-zero3"][2], MODEL, EditPipeline, _render)


def test_zero2_resume_continues_exactly(runs, tmp_path):
    check_resume(*runs["edit-zero2"], tmp_path / "resumed", TRANSFORMER)


# ------------------------------------------------------------------------------------- Qwen-Image-Edit-2509 / 2511
# Several references per sample (builtin:tiny-qwen-image-edit-plus, QwenImageEditPlusPipeline): data.control_dir a
# list of two folders. Three launches: full under ZeRO 2 from cached target and reference latents (its export renders
# with the references, and the second reference changes the render), LoRA under ZeRO 3 with gradient checkpointing
# (the LoRA file loads with load_lora_weights and changes the image) and its exact resume from step 2. No samples
# while training: the pipeline resizes every reference to about 1024 x 1024 px before encoding it (about 30 s a render
# on a CPU); tests/unit/models/qwen_image/test_qwen_image_edit_plus.py renders them.

PLUS = "tiny-qwen-image-edit-plus"
PLUS_CASES = {"plus-zero2": (2, "full"), "plus-lora-zero3": (3, "lora")}


@pytest.fixture(scope="module")
def plus_runs(tmp_path_factory) -> dict:
    from dstune.data.synthetic import render_shape

    pairs = tmp_path_factory.mktemp("plus-pairs")
    write_pairs(pairs, PAIRS, SIDE)
    (pairs / "scene").mkdir()
    for number in range(PAIRS):  # the second reference: another shape
        render_shape(number + 50, SIDE)[0].save(pairs / "scene" / f"{number:03d}.png")

    def on_pairs(spec: dict, train: str) -> None:
        spec["data"].update(path=str(pairs / "target"), control_dir=["../control", "../scene"], resolution=SIDE)
        spec["data"]["cache"]["text_embeddings"] = False  # an embedding belongs to a caption and its references
        spec["sample"]["prompts"] = []

    return launch_cases(tmp_path_factory, PLUS, PLUS_CASES, on_pairs)


class EditPlusPipeline:
    """QwenImageEditPlusPipeline.from_pretrained with the folder's processor as dstune loads it (see EditPipeline)."""

    @staticmethod
    def from_pretrained(folder):
        from diffusers import QwenImageEditPlusPipeline

        from dstune.models.qwen_image.model import load_processor

        return QwenImageEditPlusPipeline.from_pretrained(folder, processor=load_processor(folder))


def _render_plus(pipeline, second: int = 55) -> torch.Tensor:
    from dstune.data.synthetic import render_shape

    references = [render_shape(105, SIDE)[0], render_shape(second, SIDE)[0]]
    return pipeline(image=references, prompt="turn it into a red circle", height=SIDE, width=SIDE,
                    num_inference_steps=2, true_cfg_scale=1.0, generator=torch.Generator().manual_seed(0),
                    output_type="pt").images.float()


def test_plus_full_from_the_cache_exports_a_folder_that_renders_with_the_references(plus_runs):
    run_dir, _, proc = plus_runs["plus-zero2"]
    check_trains(run_dir, proc)
    assert f"{3 * PAIRS} entries, built now {3 * PAIRS}" in proc.stdout  # target and both references' latents
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(PLUS) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    pipeline = EditPlusPipeline.from_pretrained(export)
    image = _render_plus(pipeline)
    assert image.shape == (1, 3, SIDE, SIDE) and torch.isfinite(image).all()
    assert not torch.allclose(image, _render_plus(pipeline, second=60))  # the second reference changes the render


def test_plus_lora_with_checkpointing_loads_with_load_lora_weights_and_resumes_exactly(plus_runs, tmp_path):
    run_dir, spec_path, proc = plus_runs["plus-lora-zero3"]
    check_trains(run_dir, proc)
    check_lora_export(run_dir, proc, PLUS, EditPlusPipeline, _render_plus)
    check_resume(run_dir, spec_path, proc, tmp_path / "resumed", Path("pytorch_lora_weights.safetensors"))
