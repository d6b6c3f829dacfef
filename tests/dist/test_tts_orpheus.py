"""Real 2-rank DeepSpeed runs of tts_lm in Orpheus's own format on CPU: builtin:tiny-orpheus (the orpheus token
layout, SNAC codes, two added text tokens) trains fully under ZeRO 3, and as LoRA under ZeRO 2; both resume exactly;
the full run exports a folder in Orpheus's format that synthesizes a 24 kHz WAV, the LoRA run (two speakers) a merged
folder and a peft adapter that agree, with the speakers' map beside them that `dstune synthesize --speaker` reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from harness import CACHE_DIR, explain, launch, write_spec
from tts_runs import STEPS, check_resume_continues_exactly, check_trains_and_samples, tts_spec, two_speaker_folder

pytestmark = pytest.mark.dist

ORPHEUS_CASES = {"orpheus-zero3": 3}
LORA_CASES = {"orpheus-lora-zero2": 2}  # LoRA on the Llama's attention; its resume is the full case's path


def _orpheus_spec(run_dir: Path, stage: int) -> dict:
    """Orpheus's format: SNAC codes (cached) in its token layout, read from the built-in model's folder, with two
    new text tokens (a vocabulary extension: the embeddings grow from 156938 to 156940 ids before ZeRO-3)."""
    spec = tts_spec(run_dir, 2)
    spec["model"] = {"family": "tts_lm", "pretrained": "builtin:tiny-orpheus", "codec": "snac",
                     "token_layout": "orpheus", "max_sample_seconds": 0.3, "added_tokens": ["12", "345"],
                     "sample_temperature": 0.0}  # greedy: the argmax moves with training; near-uniform draws may not
    spec["train"]["optimizer"]["lr"] = 3e-2
    spec["data"] = {"path": "builtin:tones", "max_clip_seconds": 0.5,
                    "cache": {"codec_tokens": True, "dir": str(run_dir.parent / "codec-cache")}}
    spec["deepspeed"] = {"zero_stage": stage}
    return spec


def _lora_spec(run_dir: Path, stage: int) -> dict:
    """The orpheus case as LoRA (train: lora, default targets q/k/v/o_proj) without added tokens (refused with LoRA),
    on two speakers (a .list of ann's and bob's clips: the orpheus layout names each in its prompt)."""
    spec = _orpheus_spec(run_dir, stage)
    del spec["model"]["added_tokens"]
    spec["model"].update({"train": "lora", "lora": {"rank": 4}})
    spec["data"]["path"] = str(two_speaker_folder(run_dir.parent / "speakers"))
    return spec


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Two launches shared by the tests below (the resumes are in their own tests)."""
    out = {}
    for name, stage in [*ORPHEUS_CASES.items(), *LORA_CASES.items()]:
        run_dir = tmp_path_factory.mktemp(f"tts-{name}") / "run"
        spec = _lora_spec(run_dir, stage) if name in LORA_CASES else _orpheus_spec(run_dir, stage)
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
    return out


@pytest.mark.parametrize("name", [*ORPHEUS_CASES, *LORA_CASES])
def test_trains_checks_samples_and_exports(runs, name):
    run_dir, _, proc = runs[name]
    check_trains_and_samples(run_dir, proc, 24000)


@pytest.mark.parametrize("name", [*ORPHEUS_CASES, *LORA_CASES])
def test_resume_continues_exactly(runs, name, tmp_path):
    check_resume_continues_exactly(*runs[name], tmp_path / "resumed")


@pytest.mark.parametrize("name", list(ORPHEUS_CASES))
def test_orpheus_export_keeps_its_format_and_speaks(runs, name):
    """The export is Orpheus's kind of folder: its tokenizer with the named ids, the Llama at 156938 ids, SNAC's two
    files in codec/ and the orpheus layout; it generates ids that decode with SNAC to a 24 kHz WAV."""
    import json

    import soundfile
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dstune.models.tts_lm.model import TtsLm

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
    clip = TtsLm.synthesize(folder, "42", 0.3, 0.8, 0)
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

    from dstune.models.tts_lm.model import TtsLm
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
    clip = TtsLm.synthesize(folder, "42", 0.3, 0.8, 0)
    assert clip.sample_rate == 24000 and clip.wave.size >= 2048 and np.isfinite(clip.wave).all()


@pytest.mark.parametrize("name", list(LORA_CASES))
def test_the_speakers_map_reaches_the_export_and_synthesize(runs, name, tmp_path, capsys):
    """Two speakers end to end: the run prints the map validate made, the export at the end of training and
    `dstune export` of the checkpoint (a fresh process's model: the map from the checkpoint) both write
    speakers.json, and `dstune synthesize --speaker bob` speaks bob's prompt ("bob: 42"); an unknown name is exit 2
    listing the speakers."""
    import json

    import soundfile

    from dstune.cli import main
    from dstune.models.tts_lm.model import TtsLm

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    assert "ann -> ann, bob -> bob" in " ".join(proc.stdout.split())
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    assert json.loads((folder / "speakers.json").read_text())["speakers"] == {"ann": "ann", "bob": "bob"}
    assert main(["export", str(run_dir), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "speakers.json").read_text() == (folder / "speakers.json").read_text()
    wav = tmp_path / "bob.wav"
    assert main(["synthesize", str(folder), "42", "-o", str(wav), "--seconds", "0.3", "--speaker", "bob"]) == 0
    said, _ = soundfile.read(wav, dtype="float32")
    assert np.array_equal(said, TtsLm.synthesize(folder, "bob: 42", 0.3, 0.8, 0).wave)
    capsys.readouterr()
    assert main(["synthesize", str(folder), "42", "-o", str(tmp_path / "x.wav"), "--speaker", "carl"]) == 2
    assert "its speakers are ann, bob" in capsys.readouterr().err
