"""Real 2-rank DeepSpeed runs of the tts_lm family on CPU: ZeRO 2 (builtin:tones, codec-token cache, duration
buckets) and ZeRO 3 (an LJSpeech folder of 16 kHz WAVs resampled to the codec's 8 kHz, with clips the length
rules skip and one unreadable file); both pass the batch check, write WAV samples and export a folder that
transformers reloads and that generates audio. ZeRO 3 resumes exactly; the codec-token cache two ranks built is
byte-for-byte what one process builds. The speecht5 family trains under ZeRO 2 and ZeRO 3 (its 0-dim parameters
and layerdrop are the pitfalls), resumes exactly (its prenet dropout is always on, so its RNG must be restored) and
exports a folder SpeechT5ForTextToSpeech reloads and speaks with. builtin:tiny-orpheus (the orpheus token layout,
SNAC codes) trains fully under ZeRO 3, resumes exactly and exports a folder that synthesizes a 24 kHz WAV."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from harness import CACHE_DIR, base_spec, explain, launch, metrics, write_spec

pytestmark = pytest.mark.dist

STEPS = 4
CASES = {"zero2": 2, "zero3": 3}
SPEECHT5_CASES = {"speecht5-zero2": 2, "speecht5-zero3": 3}
ORPHEUS_CASES = {"orpheus-zero3": 3}
LORA_CASES = {"orpheus-lora-zero2": 2}  # LoRA on the Llama's attention; its resume is the full case's path


def _ljspeech_folder(root: Path) -> Path:
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


def _spec(run_dir: Path, stage: int) -> dict:
    data = {"path": "builtin:tones", "max_clip_seconds": 0.5, "duration_bucket_seconds": 0.25,
            "cache": {"codec_tokens": True, "dir": str(run_dir.parent / "codec-cache")}}
    if stage == 3:
        data = {"path": str(_ljspeech_folder(run_dir.parent / "lj")), "format": "ljspeech",
                "min_clip_seconds": 0.15, "max_clip_seconds": 0.8, "skip_bad_files": True}
    return base_spec(
        run_dir, model={"family": "tts_lm", "pretrained": "builtin:tiny-tts-lm", "max_sample_seconds": 0.3},
        data=data,
        train={"global_batch_size": 8, "micro_batch_size": 4, "gradient_accumulation_steps": None, "max_steps": STEPS,
               "optimizer": {"type": "adamw", "lr": 1e-2}},
        deepspeed={"zero_stage": stage},
        output={"save_every_steps": 2, "keep_last": 5, "export": "diffusers"},
        sample={"prompts": ["123", "90"]})


def _speecht5_spec(run_dir: Path, stage: int) -> dict:
    spec = _spec(run_dir, 2)
    spec["model"] = {"family": "speecht5", "pretrained": "builtin:tiny-speecht5", "max_sample_seconds": 0.5}
    spec["data"] = {"path": "builtin:tones", "max_clip_seconds": 0.5, "num_workers": 0}
    spec["deepspeed"] = {"zero_stage": stage}
    return spec


def _orpheus_spec(run_dir: Path, stage: int) -> dict:
    """Orpheus's format: SNAC codes (cached) in its token layout, read from the built-in model's folder, with two
    new text tokens (a vocabulary extension: the embeddings grow from 156938 to 156940 ids before ZeRO-3)."""
    spec = _spec(run_dir, 2)
    spec["model"] = {"family": "tts_lm", "pretrained": "builtin:tiny-orpheus", "codec": "snac",
                     "token_layout": "orpheus", "max_sample_seconds": 0.3, "added_tokens": ["12", "345"],
                     "sample_temperature": 0.0}  # greedy: the argmax moves with training; near-uniform draws may not
    spec["train"]["optimizer"]["lr"] = 3e-2
    spec["data"] = {"path": "builtin:tones", "max_clip_seconds": 0.5,
                    "cache": {"codec_tokens": True, "dir": str(run_dir.parent / "codec-cache")}}
    spec["deepspeed"] = {"zero_stage": stage}
    return spec


def _lora_spec(run_dir: Path, stage: int) -> dict:
    """The orpheus case as LoRA (train: lora, default targets q/k/v/o_proj) without added tokens (refused with LoRA)."""
    spec = _orpheus_spec(run_dir, stage)
    del spec["model"]["added_tokens"]
    spec["model"].update({"train": "lora", "lora": {"rank": 4}})
    return spec


def _case_spec(name: str, run_dir: Path, stage: int) -> dict:
    if name in LORA_CASES:
        return _lora_spec(run_dir, stage)
    if name in SPEECHT5_CASES:
        return _speecht5_spec(run_dir, stage)
    return _orpheus_spec(run_dir, stage) if name in ORPHEUS_CASES else _spec(run_dir, stage)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Six launches shared by the tests below (the resumes are in their own tests)."""
    out = {}
    for name, stage in [*CASES.items(), *SPEECHT5_CASES.items(), *ORPHEUS_CASES.items(), *LORA_CASES.items()]:
        run_dir = tmp_path_factory.mktemp(f"tts-{name}") / "run"
        spec = _case_spec(name, run_dir, stage)
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
    return out


@pytest.mark.parametrize("name", [*CASES, *SPEECHT5_CASES, *ORPHEUS_CASES, *LORA_CASES])
def test_trains_checks_samples_and_exports(runs, name):
    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    assert "batch check passed" in proc.stdout
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(np.isfinite(m["loss"]) for m in logged)
    assert logged[-1]["loss"] < logged[0]["loss"]
    first, last = run_dir / "samples" / "step-000000", run_dir / "samples" / f"step-{STEPS:06d}"
    import soundfile

    before, rate = soundfile.read(first / "00.wav")
    after, _ = soundfile.read(last / "00.wav")
    expected_rate = 16000 if name in SPEECHT5_CASES else 24000 if name in {**ORPHEUS_CASES, **LORA_CASES} else 8000
    assert rate == expected_rate and len(before) > 0 and len(after) > 0
    assert len(before) != len(after) or not np.array_equal(before, after)  # training changed what it says


def test_length_rules_and_bad_files_are_reported(runs):
    _, _, proc = runs["zero3"]
    assert proc.returncode == 0, explain(proc)
    assert "1 of 22 clips are shorter than 0.15 s" in proc.stdout
    assert "1 of 22 clips are longer than 0.8 s" in proc.stdout
    assert "1 clip(s) missing or unreadable" in proc.stdout and "LJ999.wav" in proc.stdout


@pytest.mark.parametrize("name", list(CASES))
def test_export_reloads_in_transformers_and_speaks(runs, name):
    from transformers import AutoModelForCausalLM, EncodecModel

    from dstune.families.tts_lm import synthesize

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    lm = AutoModelForCausalLM.from_pretrained(folder)
    EncodecModel.from_pretrained(folder / "codec")
    trained = load_file(folder / "model.safetensors")
    assert set(trained) == set(lm.state_dict())
    clip = synthesize(folder, "42", seconds=0.3)
    assert clip.sample_rate == 8000 and clip.wave.size > 0 and np.isfinite(clip.wave).all()


@pytest.mark.parametrize("name", ["zero3", "speecht5-zero2", "orpheus-zero3", "orpheus-lora-zero2"])
def test_resume_continues_exactly(runs, name, tmp_path):
    run_dir, spec_path, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    resumed_dir = tmp_path / "resumed"
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


def test_codec_cache_of_two_ranks_equals_one_process(runs, tmp_path):
    """Every entry the 2-rank build wrote has the key and the codes one process computes for the same clip."""
    from dstune.cache.entries import entry_problem
    from dstune.cache.codec_tokens import encode_entries, plan_codec_entries
    from dstune.data.audio import speech_records
    from dstune.pretrained import build_model
    from dstune.spec.models import DataSpec, TtsLmModel

    run_dir, _, proc = runs["zero2"]
    assert proc.returncode == 0, explain(proc)
    assert "codec-token cache" in proc.stdout and "built now" in proc.stdout
    two_ranks = run_dir.parent / "codec-cache"
    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.5))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched ranks (OMP_NUM_THREADS=1)
    try:
        built = build_model(TtsLmModel(family="tts_lm"), CACHE_DIR, "cpu")
        entries = plan_codec_entries(records, built)
        assert all(entry_problem(two_ranks / e.relpath, e, full=True) is None for e in entries)
        one = tmp_path / "one"
        assert encode_entries(built, entries, {r.sample_id: r for r in records}, one) == (len(entries), 0)
    finally:
        torch.set_num_threads(threads)
    for entry in entries:
        assert torch.equal(load_file(one / entry.relpath)["codes"], load_file(two_ranks / entry.relpath)["codes"])


@pytest.mark.parametrize("name", list(SPEECHT5_CASES))
def test_speecht5_export_reloads_and_speaks(runs, name):
    from transformers import SpeechT5ForTextToSpeech

    from dstune.families.speecht5 import synthesize

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    model = SpeechT5ForTextToSpeech.from_pretrained(folder)
    assert model.speecht5.encoder.prenet.encode_positions.alpha.dim() == 0  # promoted for ZeRO, squeezed back
    trained = load_file(folder / "model.safetensors")
    base = SpeechT5ForTextToSpeech.from_pretrained(CACHE_DIR / "builtin" / "tiny-speecht5-v1")
    assert any(not torch.equal(trained[k], v) for k, v in base.state_dict().items() if k in trained)
    clip = synthesize(folder, "42", seconds=0.3)
    assert clip.sample_rate == 16000 and clip.wave.size > 0 and np.isfinite(clip.wave).all()


@pytest.mark.parametrize("name", list(ORPHEUS_CASES))
def test_orpheus_export_keeps_its_format_and_speaks(runs, name):
    """The export is Orpheus's kind of folder: its tokenizer with the named ids, the Llama at 156938 ids, SNAC's two
    files in codec/ and the orpheus layout; it generates ids that decode with SNAC to a 24 kHz WAV."""
    import json

    import soundfile
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dstune.families.tts_lm import synthesize

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    assert json.loads((folder / "dstune_tts.json").read_text())["name"] == "orpheus"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<custom_token_4>", "12", "345"]) == [
        128000, 128260, 156938, 156939]
    assert 156938 in tokenizer("9123").input_ids  # the new token is what the text is read as
    lm = AutoModelForCausalLM.from_pretrained(folder)
    assert lm.config.vocab_size == 156940 == json.loads((folder / "dstune_tts.json").read_text())["vocab_size"]
    base = AutoModelForCausalLM.from_pretrained(CACHE_DIR / "builtin" / "tiny-orpheus-v2").get_input_embeddings()
    rows = lm.get_input_embeddings().weight.detach()
    assert not torch.equal(rows[:156938], base.weight)
    mean_start = base.weight.detach().mean(0)  # where the new rows started; "12" occurs in the data, so it moved
    assert not torch.allclose(rows[156938], mean_start)
    clip = synthesize(folder, "42", seconds=0.3)
    assert clip.sample_rate == 24000 and clip.wave.size >= 2048 and np.isfinite(clip.wave).all()
    soundfile.write(run_dir / "spoken.wav", clip.wave, clip.sample_rate)
    assert soundfile.info(run_dir / "spoken.wav").samplerate == 24000


@pytest.mark.parametrize("name", list(LORA_CASES))
def test_orpheus_lora_trains_adapters_only_and_exports_both_ways(runs, name):
    """Only adapters train (the checkpoint holds them alone; every non-attention weight of the merged export is the
    base's); the export's adapter/ loads with peft onto the base folder and equals the merged folder, which
    synthesizes a 24 kHz WAV."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dstune.families.tts_lm import synthesize
    from dstune.export import consolidated_state_dict

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    assert "training: LoRA rank 4" in proc.stdout and "(q_proj, k_proj, v_proj, o_proj)" in proc.stdout
    checkpointed = consolidated_state_dict(run_dir / "checkpoints", f"step-{STEPS:08d}", 2, [])
    assert checkpointed and all(".lora_A." in k or ".lora_B." in k for k in checkpointed)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    base_folder = CACHE_DIR / "builtin" / "tiny-orpheus-v2"
    base = AutoModelForCausalLM.from_pretrained(base_folder).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(folder)
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, base[k])}
    assert changed and all(k.rsplit(".", 2)[-2] in {"q_proj", "k_proj", "v_proj", "o_proj"} for k in changed)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder), folder / "adapter")
    ids = torch.tensor([[128000, 128259, 20, 21, 128260, 128261, 128257]])
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)
    clip = synthesize(folder, "42", seconds=0.3)
    assert clip.sample_rate == 24000 and clip.wave.size >= 2048 and np.isfinite(clip.wave).all()
