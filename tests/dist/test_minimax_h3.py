"""Real 2-rank DeepSpeed training of MiniMax-H3 text-to-video with stereo sound (builtin:tiny-minimax-h3, a diffusers
modular pipeline folder; model.family video) on CPU, two launches on builtin:moving-shapes-av's 22-frame clips
(17k+5) at 24 fps: in full under ZeRO 2 from the latent cache (each clip's sound rows beside its posterior) and the
text cache (the text encoder on one rank of the node), samples rendered through the modular blocks with their sound
(from the prompts' cached text), its export loaded by
ModularPipeline.from_pretrained rendering other frames than the base; LoRA under ZeRO 3 with gradient checkpointing
training the first-frame workflow (fl2va: model.image_to_video) under the distillation guard
(model.cfg_augmented_target: a second forward a clip without gradient), each clip's keyframe latent and sound from the
latent cache and its text (the caption after the frame's vision block) encoded every step on both ranks, resumed from
its step-2 checkpoint with the same losses and LoRA file. Its sequence split runs in
tests/dist/test_sequence_parallel.py."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from flow_runs import STEPS, TRANSFORMER, base_folder, check_resume, check_trains
from harness import CACHE_DIR, launch, write_spec
from video_runs import PROMPT, video_spec

pytestmark = pytest.mark.dist

MODEL = "tiny-minimax-h3"
KEYS = {"max_sequence_length": 16, "sample_frames": 124}  # 124: the shortest clip its pipeline renders (5 s)
RUNS = {"full": (2, "full"), "lora": (3, "lora")}  # run name -> (ZeRO stage, train)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from dstune.builtin import ensure_builtin_model

    ensure_builtin_model(MODEL, CACHE_DIR)
    out = {}
    for name, (stage, train) in RUNS.items():
        run_dir = tmp_path_factory.mktemp(f"minimax-h3-{name}") / "run"
        cache = {"latents": True, "text_embeddings": name == "full", "dir": str(run_dir.parent / "cache")}
        data = {"path": "builtin:moving-shapes-av", "resolution": 32, "video": {"frames": 22}, "cache": cache}
        # the LoRA run trains fl2va (its text cannot be cached) with the distillation guard (an uncond forward)
        guard = {"image_to_video": True, "cfg_augmented_target": 4.0} if name == "lora" else {}
        keys = {**KEYS, **guard}
        spec = write_spec(run_dir.parent / "spec.yaml", video_spec(run_dir, MODEL, stage, train, data, keys))
        started = time.perf_counter()
        out[name] = (run_dir, spec, launch(spec, num_ranks=2))
        print(f"launch {name}: {time.perf_counter() - started:.1f} s wall")
    return out


def render(pipeline_folder: Path, transformer) -> tuple:
    """One t2va render of the base folder's parts around `transformer`, through dstune's sampling (the modular
    blocks without their text block: no Qwen3VLProcessor is needed)."""
    from dstune.pretrained import build_model
    from dstune.spec.models import SampleSpec, VideoModelSpec

    spec = VideoModelSpec(family="video", pretrained=str(pipeline_folder), **KEYS)
    model = build_model(spec, CACHE_DIR, "cpu")
    [clip] = model.sample(transformer, [PROMPT], SampleSpec(prompts=[PROMPT], steps=2, seed=0), 32)
    frames = torch.stack([torch.tensor(list(frame.getdata()), dtype=torch.float32) for frame in clip])
    return frames, torch.as_tensor(clip.sound)


def test_full_run_from_both_caches_samples_with_sound_and_exports_a_folder_its_modular_pipeline_loads(runs):
    import av
    from diffusers import MiniMaxH3Transformer3DModel, ModularPipeline
    from safetensors.torch import load_file

    from dstune.cache.entries import read_entry
    from dstune.families.folders import modular_entries

    run_dir, _, proc = runs["full"]
    check_trains(run_dir, proc)
    assert "entries, built now" in proc.stdout
    assert "text encoders: loaded on rank 0 only (the first of each node; 1 of 2 ranks)" in proc.stdout
    assert re.search(r"loss \d+\.\d+ \(video \d+\.\d+, audio \d+\.\d+\)", proc.stdout)  # both streams' shares
    entries = [read_entry(path) for path in (run_dir.parent / "cache").rglob("*.safetensors")]
    clips = [entry for entry in entries if "latent_mean" in entry]
    assert clips and all(entry["latent_mean"].shape[1] == 7 for entry in clips)  # 22 frames -> 7 latent frames
    assert all(entry["has_sound"].item() == 1 and entry["sound_latent"].shape[-1] == 4 for entry in clips)
    with av.open(str(run_dir / "samples" / f"step-{STEPS:06d}" / "0.mp4")) as sample:  # the sample's own sound
        assert sample.streams.video[0].frames == KEYS["sample_frames"] and sample.streams.audio[0].frames > 0
    export = run_dir / "export" / f"step-{STEPS:08d}"
    trained, start = load_file(export / TRANSFORMER), load_file(base_folder(MODEL) / TRANSFORMER)
    assert set(trained) == set(start) and any(not torch.equal(trained[k], start[k]) for k in start)
    assert modular_entries(export)["transformer"]["pretrained_model_name_or_path"] == str(export.resolve())
    loaded = ModularPipeline.from_pretrained(str(export))
    loaded.load_components(names=["transformer"], dtype=torch.float32)
    assert all(torch.equal(loaded.transformer.state_dict()[k], trained[k]) for k in trained)
    base = MiniMaxH3Transformer3DModel.from_pretrained(base_folder(MODEL), subfolder="transformer")
    frames, sound = render(export, loaded.transformer)
    base_frames, base_sound = render(base_folder(MODEL), base)
    assert sound.shape[0] == 2 and sound.shape == base_sound.shape and torch.isfinite(sound).all()
    assert (frames - base_frames).abs().max() > 0 or (sound - base_sound).abs().max() > 1e-4


def test_fl2va_guarded_lora_zero3_with_checkpointing_from_cached_keyframes_resumes_exactly(runs, tmp_path):
    from safetensors.torch import load_file

    from dstune.cache.entries import read_entry

    run_dir, spec_path, proc = runs["lora"]
    check_trains(run_dir, proc)
    assert "text encoders: loaded on rank 0 only" not in proc.stdout  # fl2va's text is encoded on every rank
    entries = [read_entry(path) for path in (run_dir.parent / "cache").rglob("*.safetensors")]
    clips = [entry for entry in entries if "latent_mean" in entry]
    assert clips and all(entry["keyframe_latent"].shape == (4, 1, 2, 2) for entry in clips)  # the first frame's
    assert all(entry["keyframe_pixels"].shape == (3, 32, 32) for entry in clips)
    export = run_dir / "export" / f"step-{STEPS:08d}"
    adapters = load_file(export / "pytorch_lora_weights.safetensors")
    assert adapters and all(k.startswith("transformer.") and ".lora_" in k for k in adapters)
    assert max(t.abs().max().item() for k, t in adapters.items() if ".lora_B." in k) > 0
    check_resume(run_dir, spec_path, proc, tmp_path / "resumed", Path("pytorch_lora_weights.safetensors"))
