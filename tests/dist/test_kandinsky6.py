"""Real 2-rank DeepSpeed training of Kandinsky 6 (builtin:tiny-kandinsky6; model.family video, the folder chooses the
model) on CPU, two launches on builtin:moving-shapes-av (MP4 clips with sound) and one resume: text-to-video+audio in
full under ZeRO 2 from the latent cache (each clip's sound latents beside its posterior) and the text cache, samples
saved with their sound, its export rendered with sound by Kandinsky6TI2VAPipeline; image-to-video+audio LoRA under
ZeRO 3 with gradient checkpointing from the text cache (the clips and their sound read every step), resumed from its
step-2 checkpoint with the same losses and LoRA file, which loads into the pipeline's transformer and changes what
it renders from a first frame. Sequence parallelism: tests/dist/test_sequence_parallel.py."""

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

MODEL = "tiny-kandinsky6"
TEXT_TOKENS = 560  # the tiny tokenizer's template keeps ~500 tokens after the pipeline's crop, then the caption
LORA_TARGETS = ["to_query", "to_key", "to_value", "attn.out_layer", "self_attention.out_layer"]
KEYS = {"max_sequence_length": TEXT_TOKENS, "timestep_sampling": "uniform"}
RUNS = {  # run name -> (ZeRO stage, train, model keys)
    "full": (2, "full", {**KEYS, "shift": 3.0}),
    "lora": (3, "lora", {**KEYS, "image_to_video": True, "lora": {"rank": 4, "target_modules": LORA_TARGETS}}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from dstune.builtin import ensure_builtin_model

    ensure_builtin_model(MODEL, CACHE_DIR)
    out = {}
    for name, (stage, train, keys) in RUNS.items():
        run_dir = tmp_path_factory.mktemp(f"kandinsky6-{name}") / "run"
        cache = {"latents": name == "full", "text_embeddings": True, "dir": str(run_dir.parent / "cache")}
        spec = video_spec(run_dir, MODEL, stage, train, {"path": "builtin:moving-shapes-av", "cache": cache}, keys)
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        started = time.perf_counter()
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
        print(f"launch kandinsky6 {name}: {time.perf_counter() - started:.1f} s wall")
    return out


def _render(pipeline, image: Path | None = None) -> tuple:
    from PIL import Image

    given = {"image": Image.open(image).convert("RGB")} if image is not None else {}
    result = pipeline(
        prompt=PROMPT,
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=TEXT_TOKENS,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        **given,
    )
    return result.frames.float(), result.audio.float()


def test_full_zero2_from_both_caches_samples_and_exports_with_sound(runs):
    import av
    from diffusers import Kandinsky6TI2VAPipeline
    from safetensors.torch import load_file

    from dstune.cache.entries import read_entry

    run_dir, _, proc = runs["full"]
    check_trains(run_dir, proc)
    assert "entries, built now" in proc.stdout
    assert re.search(r"loss \d+\.\d+ \(video \d+\.\d+, audio \d+\.\d+\)", proc.stdout)
    for logged in metrics(run_dir):
        assert logged["loss_audio"] > 0 and logged["loss_video"] + logged["loss_audio"] == pytest.approx(logged["loss"])
    entries = [read_entry(path) for path in (run_dir.parent / "cache").rglob("*.safetensors")]
    text = [entry for entry in entries if "pooled_projections" in entry]
    assert text and text[0]["encoder_hidden_states"].shape == (TEXT_TOKENS, 32)
    clips = [entry for entry in entries if "latent_mean" in entry]
    assert clips and all(entry["has_sound"].item() == 1 and entry["sound_latent"].shape[0] == 8 for entry in clips)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(MODEL) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    frames, audio = _render(Kandinsky6TI2VAPipeline.from_pretrained(export))
    base_frames, _ = _render(Kandinsky6TI2VAPipeline.from_pretrained(base_folder(MODEL)))
    assert frames.shape == (1, 5, 3, 32, 32) and torch.isfinite(frames).all() and not torch.equal(frames, base_frames)
    assert audio.shape[0] == 1 and audio.shape[1] > 0 and torch.isfinite(audio).all() and audio.abs().max() > 0
    with av.open(str(run_dir / "samples" / f"step-{STEPS:06d}" / "0.mp4")) as sample:  # the sample's own sound
        assert sample.streams.video and sample.streams.audio and sample.streams.audio[0].frames > 0


def test_i2v_lora_zero3_checkpointed_resumes_exactly_and_loads_into_the_pipeline(runs, tmp_path):
    from diffusers import Kandinsky6TI2VAPipeline
    from safetensors.torch import load_file

    run_dir, spec_path, proc = runs["lora"]
    check_trains(run_dir, proc)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    adapters = load_file(export / "pytorch_lora_weights.safetensors")
    assert adapters and all(k.startswith("transformer.") and ".lora_" in k for k in adapters)
    assert max(t.abs().max().item() for k, t in adapters.items() if ".lora_B." in k) > 0
    image = first_frame(tmp_path / "images")
    pipeline = Kandinsky6TI2VAPipeline.from_pretrained(base_folder(MODEL))
    before, _ = _render(pipeline, image)
    pipeline.transformer.load_lora_adapter(
        str(export), weight_name="pytorch_lora_weights.safetensors", prefix="transformer"
    )
    after, audio = _render(pipeline, image)
    assert after.shape == (1, 5, 3, 32, 32) and torch.isfinite(after).all() and not torch.allclose(after, before)
    assert audio.shape[1] > 0 and torch.isfinite(audio).all()
    started = time.perf_counter()
    check_resume(run_dir, spec_path, proc, tmp_path / "resumed", Path("pytorch_lora_weights.safetensors"))
    print(f"launch kandinsky6 resume: {time.perf_counter() - started:.1f} s wall")
