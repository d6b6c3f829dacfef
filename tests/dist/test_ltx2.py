"""Real 2-rank DeepSpeed training of LTX-2.3 and LTX-2.5 audio+video (model.family video; the folder chooses the
model) on CPU, each model in both shared rows, in two launches of tests/dist/scripts/train_runs.py (several runs on
the same two processes):
- ZeRO-2 full from the latent and text caches (each clip's sound latents beside its posterior), ltx-trainer's sigma
  sampler: LTX-2.3 (builtin:tiny-ltx2-3) image-to-video on builtin:moving-shapes-av with samples saved with their
  sound and its export rendered by LTX2ImageToVideoPipeline with sound; LTX-2.5 (builtin:tiny-ltx2-5, Gemma 4)
  text-to-video, its export rendered by LTX2Pipeline;
- ZeRO-3 IC-LoRA with gradient checkpointing on a folder of those clips each with its reference clip
  (data.control_dir; the sound read from the clips every step), resumed from its step-2 checkpoint (the second
  launch) with the same losses and LoRA file, which LTX2InContextPipeline.load_lora_weights loads and which renders
  from a reference, another reference another clip: LTX-2.5 from the text cache (the references encoded every
  step), LTX-2.3 from the latent cache too (each reference's posterior cached beside its clip's).
LTX-2.0 (builtin:tiny-ltx2) runs on 2 ranks in tests/dist/test_sequence_parallel.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from flow_runs import STEPS, TRANSFORMER, base_folder, check_resumed, check_trains, resume_from_step_2
from harness import CACHE_DIR, explain, launch, metrics, write_spec
from video_runs import PROMPT, first_frame, video_spec

pytestmark = pytest.mark.dist

LTX2_TEXT_TOKENS = 32  # the tiny model's Gemma side (default 1024: the text encoder would be most of a step)
KEYS = {"max_sequence_length": LTX2_TEXT_TOKENS, "timestep_sampling": "shifted_logit_normal"}
RUNS = {  # run name -> (model, ZeRO stage, train, model keys, latent cache)
    "full-2-3": ("tiny-ltx2-3", 2, "full", {**KEYS, "image_to_video": True}, True),  # image-to-video with sound
    "full-2-5": ("tiny-ltx2-5", 2, "full", KEYS, True),
    "lora-2-5": ("tiny-ltx2-5", 3, "lora", KEYS, False),  # IC-LoRA: a reference clip per sample
    "lora-2-3": ("tiny-ltx2-3", 3, "lora", KEYS, True),  # IC-LoRA from the latent cache
}
RUNS_SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_runs.py"
REFERENCES = (5, 6)  # the moving-shapes clips the IC-LoRA export renders from (each another reference)


def clips_with_references(root: Path) -> Path:
    """targets/<n>.mp4 (+ caption): builtin:moving-shapes-av clips 0-3 with their sound; control/<n>.mp4: clip n + 4,
    its reference."""
    from dstune.data.synthetic import moving_shape_av_mp4, moving_shape

    targets, control = root / "targets", root / "control"
    targets.mkdir(parents=True), control.mkdir()
    for number in range(4):
        (targets / f"{number}.mp4").write_bytes(moving_shape_av_mp4(number, 32, 5))
        (targets / f"{number}.txt").write_text(moving_shape(number).caption)
        (control / f"{number}.mp4").write_bytes(moving_shape_av_mp4(number + 4, 32, 5))
    return targets


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{run name: (run dir, its resumed dir or None)}, and "launches": the two launches' processes. The first launch
    trains every row of RUNS; the second resumes each LoRA run from its step-2 checkpoint."""
    from dstune.builtin import ensure_builtin_model

    root = tmp_path_factory.mktemp("ltx2")
    out, lines, resumes = {}, [], []
    for name, (model, stage, train, keys, latents) in RUNS.items():
        ensure_builtin_model(model, CACHE_DIR)
        run_dir = root / name / "run"
        run_dir.parent.mkdir(parents=True)
        cache = {"latents": latents, "text_embeddings": True, "dir": str(run_dir.parent / "cache")}
        data = {"path": "builtin:moving-shapes-av", "cache": cache}
        if train == "lora":
            data.update(path=str(clips_with_references(run_dir.parent / "data")), control_dir="../control")
        spec = video_spec(run_dir, model, stage, train, data, keys)
        if keys.get("image_to_video"):
            image = first_frame(run_dir.parent / "images")
            spec["sample"] = {**spec["sample"], "prompts": [PROMPT], "control_images": [str(image)]}
        elif train == "full":
            spec["sample"] = {**spec["sample"], "prompts": []}  # the export renders; samples are the row above's
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        lines.append(str(spec_path))
        out[name] = (run_dir, run_dir.parent / "resumed" if train == "lora" else None)
        if train == "lora":
            resumes.append((spec_path, run_dir, out[name][1]))
    launches = []
    for listed in (lines, None):
        if listed is None:  # the second launch: each LoRA run resumed from its step-2 checkpoint
            listed = [" ".join([str(path), *resume_from_step_2(run_dir, resumed)]) for path, run_dir, resumed in resumes]
        runs_file = root / f"runs-{len(launches)}.txt"
        runs_file.write_text("\n".join(listed) + "\n")
        started = time.perf_counter()
        launches.append(launch(runs_file, num_ranks=2, script=RUNS_SCRIPT))
        print(f"launch {len(launches)} ({len(listed)} runs): {time.perf_counter() - started:.1f} s wall")
        assert launches[-1].returncode == 0, explain(launches[-1])
    return {**out, "launches": launches}


def _render_ltx2(pipeline, image: Path | None = None, reference: int | None = None) -> tuple:
    from PIL import Image

    given = {"image": Image.open(image).convert("RGB")} if image is not None else {}
    if reference is not None:
        from diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora import LTX2ReferenceCondition

        from dstune.data.synthetic import render_moving_shape

        frames = render_moving_shape(reference, 32, 5)[0]
        given = {"reference_conditions": [LTX2ReferenceCondition(frames=frames)]}
    result = pipeline(prompt=PROMPT, height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
                      max_sequence_length=LTX2_TEXT_TOKENS, generator=torch.Generator().manual_seed(0),
                      output_type="pt", **given)
    return result.frames.float(), result.audio.float()


@pytest.mark.parametrize("name", ["full-2-3", "full-2-5"])
def test_zero2_full_runs_from_caches_export_a_folder_the_pipeline_renders_with_sound(runs, name):
    """Audio+video from both caches: each clip's sound latents stored beside its posterior; the export renders with
    sound in LTX2ImageToVideoPipeline (LTX-2.3, image-to-video: the first frame's condition is the cached
    posterior's first latent frame; samples from the first frame, with sound) or LTX2Pipeline (LTX-2.5)."""
    import av
    import diffusers
    from safetensors.torch import load_file

    from dstune.cache.entries import read_entry

    (run_dir, _), proc = runs[name], runs["launches"][0]
    check_trains(run_dir, proc)
    assert "entries, built now" in proc.stdout
    # the loss's video and sound shares beside it, on the console and in metrics.jsonl (every clip has sound here)
    assert re.search(r"loss \d+\.\d+ \(video \d+\.\d+, audio \d+\.\d+\)", proc.stdout)
    for logged in metrics(run_dir):
        assert logged["loss_audio"] > 0 and logged["loss_video"] + logged["loss_audio"] == pytest.approx(logged["loss"])
    assert "text encoders: loaded on rank 0 only (the first of each node; 1 of 2 ranks)" in proc.stdout
    # the plan every rank starts from says which clips train with their sound (here: all of them)
    assert re.search(r"\bsound +all \d+ clips have a sound track: each trains its video and its sound", proc.stdout)
    entries = [read_entry(path) for path in (run_dir.parent / "cache").rglob("*.safetensors")]
    text = [entry for entry in entries if "audio_encoder_hidden_states" in entry]
    assert text and text[0]["encoder_hidden_states"].shape[0] == LTX2_TEXT_TOKENS
    clips = [entry for entry in entries if "latent_mean" in entry]
    assert clips and all(entry["has_sound"].item() == 1 and entry["sound_latent"].shape[0] == 2 for entry in clips)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(RUNS[name][0]) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    i2v = RUNS[name][3].get("image_to_video")
    pipeline = getattr(diffusers, "LTX2ImageToVideoPipeline" if i2v else "LTX2Pipeline").from_pretrained(export)
    frames, audio = _render_ltx2(pipeline, run_dir.parent / "images" / "first.png" if i2v else None)
    assert frames.shape == (1, 5, 3, 32, 32) and torch.isfinite(frames).all()
    assert audio.shape[:2] == (1, 2) and audio.shape[2] > 0 and torch.isfinite(audio).all()
    if i2v:
        assert (run_dir / "samples" / f"step-{STEPS:06d}.mp4").stat().st_size > 0
        with av.open(str(run_dir / "samples" / f"step-{STEPS:06d}" / "0.mp4")) as sample:  # the sample's own sound
            assert sample.streams.video and sample.streams.audio and sample.streams.audio[0].frames > 0


@pytest.mark.parametrize("name", ["lora-2-5", "lora-2-3"])
def test_ic_lora_zero3_resumes_exactly_and_renders_from_references_in_the_in_context_pipeline(runs, name):
    """IC-LoRA, audio+video, the clips' sound read from their MP4 files every step, the references too (LTX-2.5) or
    from the latent cache (LTX-2.3: each reference's entry beside its clip's); resumed from step 2 with the same
    losses and LoRA file; the LoRA file loads with LTX2InContextPipeline.load_lora_weights and changes the frames
    rendered from a reference, and another reference renders another clip."""
    from diffusers import LTX2InContextPipeline
    from safetensors.torch import load_file

    from dstune.cache.entries import read_entry

    (run_dir, resumed), proc = runs[name], runs["launches"][0]
    check_trains(run_dir, proc)
    if RUNS[name][4]:  # from the latent cache: a reference's entry (no text, no sound of its own use) per clip
        entries = [read_entry(path) for path in (run_dir.parent / "cache").rglob("*.safetensors")]
        assert len([entry for entry in entries if "latent_mean" in entry]) == 2 * 4  # 4 clips, 4 references
    export = run_dir / "export" / f"step-{STEPS:08d}"
    adapters = load_file(export / "pytorch_lora_weights.safetensors")
    assert adapters and all(k.startswith("transformer.") and ".lora_" in k for k in adapters)
    assert max(t.abs().max().item() for k, t in adapters.items() if ".lora_B." in k) > 0
    pipeline = LTX2InContextPipeline.from_pretrained(base_folder(RUNS[name][0]))
    before, _ = _render_ltx2(pipeline, reference=REFERENCES[0])
    pipeline.load_lora_weights(str(export), weight_name="pytorch_lora_weights.safetensors")
    after, _ = _render_ltx2(pipeline, reference=REFERENCES[0])
    other, _ = _render_ltx2(pipeline, reference=REFERENCES[1])
    assert after.shape == (1, 5, 3, 32, 32) and torch.isfinite(after).all() and not torch.allclose(after, before)
    assert (after - other).abs().mean() > 1e-3  # the reference changes the output
    check_resumed(run_dir, resumed, Path("pytorch_lora_weights.safetensors"))
