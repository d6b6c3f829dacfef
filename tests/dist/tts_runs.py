"""What the 2-rank tts runs share (tests/dist/test_tts.py: tts_lm and speecht5; test_tts_orpheus.py: the orpheus
layout): the base spec, the LJSpeech-style folder, and the checks every run and every resume gets."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from harness import base_spec, explain, launch, metrics

STEPS = 4
# the flow-head TTS models (an LSD flow head over continuous codec latents, a voice prompt)
FLOW_HEAD_BUILTINS = ("builtin:tiny-pocket-tts", "builtin:tiny-gradium-phonon")


def two_speaker_folder(root: Path) -> Path:
    """A GPT-SoVITS .list of 16 tone clips (0.26-0.39 s at 16 kHz), spoken in turn by ann and bob."""
    import soundfile

    from dstune.data.synthetic import render_tones

    (root / "wavs").mkdir(parents=True)
    rows = []
    for number in range(16):
        text = str(100 + 37 * number)[: 2 + number % 2]
        soundfile.write(root / "wavs" / f"{number:02d}.wav", render_tones(text), 16000)
        rows.append(f"wavs/{number:02d}.wav|{'ann' if number % 2 else 'bob'}|en|{text}")
    (root / "metadata.list").write_text("\n".join(rows) + "\n")
    return root


def ljspeech_folder(root: Path) -> Path:
    """20 usable clips (0.2-0.7 s tone sequences at 16 kHz), one too short, one too long, one broken file."""
    import soundfile

    from dstune.data.synthetic import render_tones

    (root / "wavs").mkdir(parents=True)
    lines = []
    texts = [str(1000 + 37 * i)[: 2 + i % 4] for i in range(20)] + ["7", "12345678"]
    for number, text in enumerate(texts):
        soundfile.write(root / "wavs" / f"LJ{number:03d}.wav", render_tones(text), 16000)
        lines.append(f"LJ{number:03d}|digits {text}|{text}")
    (root / "wavs" / "LJ999.wav").write_bytes(b"RIFF not really a wav")
    lines.append("LJ999|broken|broken")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root


def tts_spec(run_dir: Path, stage: int) -> dict:
    data = {"path": "builtin:tones", "max_clip_seconds": 0.5, "duration_bucket_seconds": 0.25,
            "cache": {"codec_tokens": True, "dir": str(run_dir.parent / "codec-cache")}}
    if stage == 3:
        data = {"path": str(ljspeech_folder(run_dir.parent / "lj")), "format": "ljspeech",
                "min_clip_seconds": 0.15, "max_clip_seconds": 0.8, "skip_bad_files": True}
    return base_spec(
        run_dir, model={"family": "tts_lm", "pretrained": "builtin:tiny-tts-lm", "max_sample_seconds": 0.3},
        data=data,
        train={"global_batch_size": 8, "micro_batch_size": 4, "gradient_accumulation_steps": None, "max_steps": STEPS,
               "optimizer": {"type": "adamw", "lr": 1e-2}},
        deepspeed={"zero_stage": stage},
        output={"save_every_steps": 2, "keep_last": 5, "export": "diffusers"},
        sample={"prompts": ["123", "90"]})


def codebooks_spec(run_dir: Path, stage: int, train: str, pretrained: str = "builtin:tiny-csm") -> dict:
    """A tts_codebooks run (builtin:tiny-csm, -dia, -vibevoice, -pocket-tts or -gradium-phonon) on builtin:tones through the codec-token cache:
    ZeRO-3 full with gradient checkpointing, or LoRA (any stage)."""
    spec = tts_spec(run_dir, 2)
    spec["model"] = {"family": "tts_codebooks", "pretrained": pretrained, "max_sample_seconds": 0.3,
                     "train": train, "gradient_checkpointing": stage == 3}
    # Dia's, VibeVoice's and the flow-head models' samples after a reference clip (sample.voice_prompts)
    if pretrained in ("builtin:tiny-dia", "builtin:tiny-vibevoice", *FLOW_HEAD_BUILTINS) and stage == 3:
        import soundfile

        from dstune.data.synthetic import render_tones

        run_dir.parent.mkdir(parents=True, exist_ok=True)
        soundfile.write(str(run_dir.parent / "voice.wav"), render_tones("89"), 16000)
        (run_dir.parent / "voice.txt").write_text("[S2] 89")
        spec["sample"]["voice_prompts"] = [str(run_dir.parent / "voice.wav")] * len(spec["sample"]["prompts"])
    if train == "lora":  # rank-4 adapters start at B = 0: a larger step, so that 4 steps change what it says
        spec["model"]["lora"] = {"rank": 4}
        if pretrained in FLOW_HEAD_BUILTINS:  # the flow head's MLPs and projection too: the backbone's
            # attention alone barely moves the flow loss of a random tiny head in 4 steps
            spec["model"]["lora"]["target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "proj"]
        # VibeVoice's adapters overshoot at 0.1 (its loss rose over the 4 steps): a smaller step
        spec["train"]["optimizer"]["lr"] = 0.02 if pretrained == "builtin:tiny-vibevoice" else 0.1
    spec["deepspeed"] = {"zero_stage": stage}
    return spec


def check_trains_and_samples(run_dir: Path, proc, sample_rate: int, may_end_silent: bool = False) -> None:
    """The run passed the batch check, its loss fell over STEPS finite steps, and its WAV samples at `sample_rate`
    changed between step 0 and the last step. `may_end_silent`: the last samples may be empty (Dia stops where EOS
    is codebook 0's most likely code, which it is after a few steps of a tiny model: every clip ends in EOS)."""
    import soundfile

    assert proc.returncode == 0, explain(proc)
    assert "batch check passed" in proc.stdout
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(np.isfinite(m["loss"]) for m in logged)
    assert logged[-1]["loss"] < logged[0]["loss"]
    first, last = run_dir / "samples" / "step-000000", run_dir / "samples" / f"step-{STEPS:06d}"
    before, rate = soundfile.read(first / "00.wav")
    after, _ = soundfile.read(last / "00.wav")
    assert rate == sample_rate and len(before) > 0 and (len(after) > 0 or may_end_silent)
    assert soundfile.info(str(last / "00.wav")).samplerate == sample_rate
    assert len(before) != len(after) or not np.array_equal(before, after)  # training changed what it says


def check_resume_continues_exactly(run_dir: Path, spec_path: Path, proc, resumed_dir: Path) -> None:
    """Resumed from step 2's checkpoint into `resumed_dir`, steps 3-4 see the same samples and losses and end at the
    same weights as the uninterrupted run."""
    assert proc.returncode == 0, explain(proc)
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed_dir / "checkpoints" / "step-00000002")
    (resumed_dir / "checkpoints" / "latest").write_text("step-00000002")
    again = launch(spec_path, num_ranks=2, args=("--resume", "latest", "--set", f"output.dir={resumed_dir}"))
    assert again.returncode == 0, explain(again)
    first, second = metrics(run_dir), metrics(resumed_dir)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)
        assert after["samples"] == before["samples"]
    a = load_file(run_dir / "export" / f"step-{STEPS:08d}" / "model.safetensors")
    b = load_file(resumed_dir / "export" / f"step-{STEPS:08d}" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
