"""Real 2-rank DeepSpeed training of LTX-2 audio+video (model.family video; the folder chooses the model) on CPU, two
launches on MP4 clips with sound: LTX-2.3 (builtin:tiny-ltx2-3) image-to-video in full under ZeRO 2 on
builtin:moving-shapes-av from the latent cache (each clip's sound latents beside its posterior) and the text cache,
ltx-trainer's sigma sampler, samples saved with their sound, its export rendered by LTX2ImageToVideoPipeline with
sound; LTX-2.5 (builtin:tiny-ltx2-5, Gemma 4) IC-LoRA under ZeRO 3 with gradient checkpointing and the text cache
only, on a folder of those clips each with its reference clip (data.control_dir; the sound read from the clips every
step), resumed from its step-2 checkpoint with the same losses and LoRA file, which
LTX2InContextPipeline.load_lora_weights loads, and which renders from a reference, another reference another clip.
LTX-2.0 (builtin:tiny-ltx2) runs on 2 ranks in tests/dist/test_sequence_parallel.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from flow_runs import STEPS, TRANSFORMER, base_folder, check_resume, check_trains
from harness import CACHE_DIR, launch, metrics, write_spec
from video_runs import PROMPT, first_frame, video_spec

pytestmark = pytest.mark.dist

LTX2_TEXT_TOKENS = 32  # the tiny model's Gemma side (default 1024: the text encoder would be most of a step)
KEYS = {"max_sequence_length": LTX2_TEXT_TOKENS, "timestep_sampling": "shifted_logit_normal"}
RUNS = {  # run name -> (model, ZeRO stage, train, model keys)
    "full": ("tiny-ltx2-3", 2, "full", {**KEYS, "image_to_video": True}),  # image-to-video with sound
    "lora": ("tiny-ltx2-5", 3, "lora", KEYS),  # IC-LoRA: a reference clip per sample
}
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
    """The ZeRO-2 full run from both caches (image-to-video with sound), and the ZeRO-3 LoRA run with gradient
    checkpointing from the text cache only (text-to-video with sound, read from the MP4s every step)."""
    from dstune.builtin import ensure_builtin_model

    out = {}
    for name, (model, stage, train, keys) in RUNS.items():
        ensure_builtin_model(model, CACHE_DIR)
        run_dir = tmp_path_factory.mktemp(f"ltx2-{name}") / "run"
        cache = {"latents": name == "full", "text_embeddings": True, "dir": str(run_dir.parent / "cache")}
        data = {"path": "builtin:moving-shapes-av", "cache": cache}
        if name == "lora":
            data.update(path=str(clips_with_references(run_dir.parent / "data")), control_dir="../control")
        spec = video_spec(run_dir, model, stage, train, data, keys)
        if keys.get("image_to_video"):
            image = first_frame(run_dir.parent / "images")
            spec["sample"] = {**spec["sample"], "prompts": [PROMPT], "control_images": [str(image)]}
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        started = time.perf_counter()
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
        print(f"launch {name}: {time.perf_counter() - started:.1f} s wall")
    return out


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


def test_i2v_full_run_from_caches_exports_a_folder_the_pipeline_renders_with_sound(runs):
    """Image-to-video, audio+video from both caches: each clip's sound latents stored beside its posterior (the
    first frame's condition is the cached posterior's first latent frame); samples from the first frame, with sound;
    the export renders in LTX2ImageToVideoPipeline."""
    import av
    from diffusers import LTX2ImageToVideoPipeline
    from safetensors.torch import load_file

    from dstune.cache.entries import read_entry

    run_dir, _, proc = runs["full"]
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
    assert text and text[0]["encoder_hidden_states"].shape == (LTX2_TEXT_TOKENS, 16)
    clips = [entry for entry in entries if "latent_mean" in entry]
    assert clips and all(entry["has_sound"].item() == 1 and entry["sound_latent"].shape[0] == 2 for entry in clips)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(RUNS["full"][0]) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    image = run_dir.parent / "images" / "first.png"
    frames, audio = _render_ltx2(LTX2ImageToVideoPipeline.from_pretrained(export), image)
    assert frames.shape == (1, 5, 3, 32, 32) and torch.isfinite(frames).all()
    assert audio.shape[:2] == (1, 2) and audio.shape[2] > 0 and torch.isfinite(audio).all()
    assert (run_dir / "samples" / f"step-{STEPS:06d}.mp4").stat().st_size > 0
    with av.open(str(run_dir / "samples" / f"step-{STEPS:06d}" / "0.mp4")) as sample:  # the sample's own sound
        assert sample.streams.video and sample.streams.audio and sample.streams.audio[0].frames > 0


def test_ic_lora_zero3_resumes_exactly_and_renders_from_references_in_the_in_context_pipeline(runs, tmp_path):
    """LTX-2.5 IC-LoRA, audio+video, the clips' sound and references read from their MP4 files every step (no latent
    cache); the LoRA file loads with LTX2InContextPipeline.load_lora_weights and changes the frames rendered from a
    reference, and another reference renders another clip."""
    from diffusers import LTX2InContextPipeline
    from safetensors.torch import load_file

    run_dir, spec_path, proc = runs["lora"]
    check_trains(run_dir, proc)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    adapters = load_file(export / "pytorch_lora_weights.safetensors")
    assert adapters and all(k.startswith("transformer.") and ".lora_" in k for k in adapters)
    assert max(t.abs().max().item() for k, t in adapters.items() if ".lora_B." in k) > 0
    pipeline = LTX2InContextPipeline.from_pretrained(base_folder(RUNS["lora"][0]))
    before, _ = _render_ltx2(pipeline, reference=REFERENCES[0])
    pipeline.load_lora_weights(str(export), weight_name="pytorch_lora_weights.safetensors")
    after, _ = _render_ltx2(pipeline, reference=REFERENCES[0])
    other, _ = _render_ltx2(pipeline, reference=REFERENCES[1])
    assert after.shape == (1, 5, 3, 32, 32) and torch.isfinite(after).all() and not torch.allclose(after, before)
    assert (after - other).abs().mean() > 1e-3  # the reference changes the output
    started = time.perf_counter()
    check_resume(run_dir, spec_path, proc, tmp_path / "resumed", Path("pytorch_lora_weights.safetensors"))
    print(f"launch ltx2 resume: {time.perf_counter() - started:.1f} s wall")
