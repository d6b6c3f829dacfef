"""Real 2-rank DeepSpeed runs of the tts_lm family on CPU: ZeRO 2 (builtin:tones, codec-token cache, duration
buckets) and ZeRO 3 (an LJSpeech folder of 16 kHz WAVs resampled to the codec's 8 kHz, with clips the length
rules skip and one unreadable file); both pass the batch check, write WAV samples and export a folder that
transformers reloads and that generates audio. ZeRO 3 resumes exactly; the codec-token cache two ranks built is
byte-for-byte what one process builds. The speecht5 family trains under ZeRO 2 and ZeRO 3 (its 0-dim parameters
and layerdrop are the pitfalls), resumes exactly (its prenet dropout is always on, so its RNG must be restored) and
exports a folder SpeechT5ForTextToSpeech reloads and speaks with. The orpheus layout's runs are in
test_tts_orpheus.py (a module of their own, so that the two share pytest-xdist's workers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from harness import CACHE_DIR, explain, launch, write_spec
from tts_runs import STEPS, check_resume_continues_exactly, check_trains_and_samples, codebooks_spec, tts_spec

pytestmark = pytest.mark.dist

CASES = {"zero2": 2, "zero3": 3}
SPEECHT5_CASES = {"speecht5-zero2": 2, "speecht5-zero3": 3}
# tts_codebooks: Sesame CSM, Dia and VibeVoice (stage, train, built-in model)
CODEBOOKS_CASES = {"csm-zero3-full": (3, "full", "builtin:tiny-csm"), "csm-zero2-lora": (2, "lora", "builtin:tiny-csm"),
                   "dia-zero3-full": (3, "full", "builtin:tiny-dia"), "dia-zero2-lora": (2, "lora", "builtin:tiny-dia"),
                   "vibevoice-zero3-full": (3, "full", "builtin:tiny-vibevoice"),
                   "vibevoice-zero2-lora": (2, "lora", "builtin:tiny-vibevoice"),
                   "pocket-tts-zero3-full": (3, "full", "builtin:tiny-pocket-tts"),
                   "pocket-tts-zero2-lora": (2, "lora", "builtin:tiny-pocket-tts"),
                   "gradium-phonon-zero3-full": (3, "full", "builtin:tiny-gradium-phonon"),
                   "gradium-phonon-zero2-lora": (2, "lora", "builtin:tiny-gradium-phonon")}
CODEBOOKS_RATES = {"csm": 24000, "dia": 44100, "vib": 24000, "poc": 24000, "gra": 24000}


def _speecht5_spec(run_dir: Path, stage: int) -> dict:
    spec = tts_spec(run_dir, 2)
    spec["model"] = {"family": "speecht5", "pretrained": "builtin:tiny-speecht5", "max_sample_seconds": 0.5}
    spec["data"] = {"path": "builtin:tones", "max_clip_seconds": 0.5, "num_workers": 0}
    spec["deepspeed"] = {"zero_stage": stage}
    return spec


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Eighteen launches shared by the tests below (the resumes are in their own tests)."""
    out = {}
    for name, stage in [*CASES.items(), *SPEECHT5_CASES.items(), *CODEBOOKS_CASES.items()]:
        run_dir = tmp_path_factory.mktemp(f"tts-{name}") / "run"
        if name in CODEBOOKS_CASES:
            spec = codebooks_spec(run_dir, *stage)
        else:
            spec = _speecht5_spec(run_dir, stage) if name in SPEECHT5_CASES else tts_spec(run_dir, stage)
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2))
    return out


@pytest.mark.parametrize("name", [*CASES, *SPEECHT5_CASES, *CODEBOOKS_CASES])
def test_trains_checks_samples_and_exports(runs, name):
    run_dir, _, proc = runs[name]
    rate = 16000 if name in SPEECHT5_CASES else CODEBOOKS_RATES[name[:3]] if name in CODEBOOKS_CASES else 8000
    check_trains_and_samples(run_dir, proc, rate, may_end_silent=name.startswith("dia"))


def test_length_rules_and_bad_files_are_reported(runs):
    _, _, proc = runs["zero3"]
    assert proc.returncode == 0, explain(proc)
    assert "1 of 22 clips are shorter than 0.15 s" in proc.stdout
    assert "1 of 22 clips are longer than 0.8 s" in proc.stdout
    assert "1 clip(s) missing or unreadable" in proc.stdout and "LJ999.wav" in proc.stdout


@pytest.mark.parametrize("name", list(CASES))
def test_export_reloads_in_transformers_and_speaks(runs, name):
    from transformers import AutoModelForCausalLM, EncodecModel

    from dstune.models.tts_lm.model import TtsLm

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    lm = AutoModelForCausalLM.from_pretrained(folder)
    EncodecModel.from_pretrained(folder / "codec")
    trained = load_file(folder / "model.safetensors")
    assert set(trained) == set(lm.state_dict())
    clip = TtsLm.synthesize(folder, "42", 0.3, 0.8, 0)
    assert clip.sample_rate == 8000 and clip.wave.size > 0 and np.isfinite(clip.wave).all()


# One resume per model: tts_lm under ZeRO-3, SpeechT5 under ZeRO-2, CSM's LoRA (its adapters and the frozen codec
# outside the engine), Dia's ZeRO-3 full run with gradient checkpointing, VibeVoice's ZeRO-3 full run (its diffusion
# draws per sample and step); each costs a launch.
@pytest.mark.parametrize("name", ["zero3", "speecht5-zero2", "csm-zero2-lora", "dia-zero3-full", "vibevoice-zero3-full",
                                  "pocket-tts-zero3-full", "gradium-phonon-zero3-full"])
def test_resume_continues_exactly(runs, name, tmp_path):
    check_resume_continues_exactly(*runs[name], tmp_path / "resumed")


def test_codec_cache_of_two_ranks_equals_one_process(runs, tmp_path):
    """Every entry the 2-rank build wrote has the key and the codes one process computes for the same clip."""
    from dstune.cache.entries import entry_problem
    from dstune.cache.codec_tokens import encode_entries, plan_codec_entries
    from dstune.data.audio import speech_records
    from dstune.pretrained import build_model
    from dstune.spec.models import DataSpec
    from dstune.models.tts_lm.spec import TtsLmModelSpec

    run_dir, _, proc = runs["zero2"]
    assert proc.returncode == 0, explain(proc)
    assert "codec-token cache" in proc.stdout and "built now" in proc.stdout
    two_ranks = run_dir.parent / "codec-cache"
    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.5))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched ranks (OMP_NUM_THREADS=1)
    try:
        built = build_model(TtsLmModelSpec(family="tts_lm"), CACHE_DIR, "cpu")
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

    from dstune.models.speecht5.model import SpeechT5

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    model = SpeechT5ForTextToSpeech.from_pretrained(folder)
    assert model.speecht5.encoder.prenet.encode_positions.alpha.dim() == 0  # promoted for ZeRO, squeezed back
    trained = load_file(folder / "model.safetensors")
    base = SpeechT5ForTextToSpeech.from_pretrained(CACHE_DIR / "builtin" / "tiny-speecht5-v1")
    assert any(not torch.equal(trained[k], v) for k, v in base.state_dict().items() if k in trained)
    clip = SpeechT5.synthesize(folder, "42", 0.3, 0.0, 0)
    assert clip.sample_rate == 16000 and clip.wave.size > 0 and np.isfinite(clip.wave).all()


@pytest.mark.parametrize("name", [name for name in CODEBOOKS_CASES if name.startswith("csm")])
def test_csm_export_loads_with_its_processor_and_generates_a_wav(runs, name, tmp_path):
    """The export is a folder CsmForConditionalGeneration + AutoProcessor load (the codec inside), with the trained
    weights, whose own generate + processor.save_audio write a WAV; a LoRA export also holds the peft adapter."""
    import soundfile
    from peft import PeftModel
    from transformers import AutoProcessor, CsmForConditionalGeneration

    from dstune.models.csm.model import decodable_codes

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    model, processor = CsmForConditionalGeneration.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)
    base = CsmForConditionalGeneration.from_pretrained(CACHE_DIR / "builtin" / "tiny-csm-v1")
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    assert changed and not any(k.startswith("codec_model.") for k in changed)  # trained, the codec untouched
    if name.endswith("lora"):
        merged = PeftModel.from_pretrained(base, folder / "adapter").merge_and_unload()
        assert all(torch.allclose(merged.state_dict()[k], model.state_dict()[k], atol=1e-6) for k in changed)
    torch.manual_seed(0)
    audio = model.generate(**processor("<|begin_of_text|>[0]42<|end_of_text|>"), output_audio=True,
                           max_new_tokens=4, **decodable_codes(model.config.vocab_size,
                                                               model.codec_model.config.codebook_size))
    processor.save_audio(audio, str(tmp_path / "42.wav"))
    wave, rate = soundfile.read(tmp_path / "42.wav")
    assert rate == 24000 and wave.size > 0 and np.isfinite(wave).all()


@pytest.mark.parametrize("name", [name for name in CODEBOOKS_CASES if name.startswith("dia")])
def test_dia_export_loads_with_its_processor_and_generates_a_wav(runs, name, tmp_path):
    """The export is a folder DiaForConditionalGeneration + DiaProcessor load (the processor naming the same DAC),
    with the trained weights, whose own generate + batch_decode + save_audio write a WAV; a LoRA export also holds
    the peft adapter, which gives the merged weights on the base folder."""
    import soundfile
    from peft import PeftModel
    from transformers import DiaForConditionalGeneration, DiaProcessor

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    model, processor = DiaForConditionalGeneration.from_pretrained(folder).eval(), DiaProcessor.from_pretrained(folder)
    base = DiaForConditionalGeneration.from_pretrained(CACHE_DIR / "builtin" / "tiny-dia-v1")
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    assert changed
    if name.endswith("lora"):
        assert all(".lora" not in k for k in model.state_dict())
        merged = PeftModel.from_pretrained(base, folder / "adapter").merge_and_unload()
        assert all(torch.allclose(merged.state_dict()[k], model.state_dict()[k], atol=1e-6) for k in changed)
    # With a voice prompt (a clip and its transcript), as Dia clones a voice. After 4 steps the model may stop at
    # once (EOS is the commonest label), and the processor cannot decode zero frames; decoding from the prompt on
    # always has frames.
    from dstune.data.synthetic import render_tones

    prompt = render_tones("42")  # 16 kHz
    prompt = np.interp(np.arange(int(len(prompt) * 44100 / 16000)) * 16000 / 44100, np.arange(len(prompt)), prompt)
    inputs = processor(text=["[S1] 42 [S2] 7."], audio=[prompt.astype(np.float32)], sampling_rate=44100)
    torch.manual_seed(0)
    sequence = model.generate(**inputs, max_new_tokens=20)
    assert torch.equal(sequence[:, : inputs["decoder_input_ids"].shape[1] - 15, 0],
                       inputs["decoder_input_ids"][:, :-15, 0])  # the prompt's codes, continued
    processor.save_audio(processor.batch_decode(sequence), str(tmp_path / "42.wav"))
    wave, rate = soundfile.read(tmp_path / "42.wav")
    assert rate == 44100 and wave.size >= len(prompt) // 512 * 512 and np.isfinite(wave).all()


@pytest.mark.parametrize("name", [name for name in CODEBOOKS_CASES if name.startswith("vibevoice")])
def test_vibevoice_export_loads_with_its_processor_and_generates_a_wav(runs, name, tmp_path):
    """The export is a folder VibeVoiceForConditionalGeneration + AutoProcessor load (its tokenizers inside, never
    trained), with the trained weights, whose own generate (after a reference voice) + processor.save_audio write a
    WAV; a LoRA export also holds the peft adapter, which gives the merged weights on the base folder."""
    import soundfile
    from peft import PeftModel
    from transformers import AutoProcessor, VibeVoiceForConditionalGeneration

    from dstune.data.synthetic import render_tones

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    model = VibeVoiceForConditionalGeneration.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    base = VibeVoiceForConditionalGeneration.from_pretrained(CACHE_DIR / "builtin" / "tiny-vibevoice-v1")
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    frozen = ("model.audio_tower.", "model.semantic_tokenizer_encoder.", "model.semantic_connector.")
    assert changed and not any(k.startswith(frozen) for k in changed)
    if name.endswith("lora"):
        merged = PeftModel.from_pretrained(base, folder / "adapter").merge_and_unload()
        assert all(torch.allclose(merged.state_dict()[k], model.state_dict()[k], atol=1e-6) for k in changed)
    voice = render_tones("89")  # 16 kHz
    voice = np.interp(np.arange(int(len(voice) * 1.5)) / 1.5, np.arange(len(voice)), voice).astype(np.float32)
    content = [{"type": "text", "text": "42"}, {"type": "audio", "audio": voice}]
    inputs = processor.apply_chat_template([{"role": "0", "content": content}], tokenize=True, return_dict=True,
                                           return_tensors="pt")
    torch.manual_seed(0)
    audio = model.generate(**inputs, max_new_tokens=6)
    processor.save_audio(audio, str(tmp_path / "42.wav"))
    wave, rate = soundfile.read(tmp_path / "42.wav")
    assert rate == 24000 and wave.size > 0 and wave.size % 3200 == 0 and np.isfinite(wave).all()


@pytest.mark.parametrize("name", [name for name in CODEBOOKS_CASES if name.startswith("pocket-tts")])
def test_pocket_tts_export_loads_with_its_processor_and_generates_a_wav(runs, name, tmp_path):
    """The export is a folder PocketTTSForConditionalGeneration + AutoProcessor (its audio tokenizer named by the
    processor, never trained) load, with the trained weights, whose own generate after a voice prompt, decoded by the
    processor, writes a WAV; a LoRA export also holds the peft adapter, which gives the merged weights on the base."""
    import soundfile
    from peft import PeftModel
    from transformers import AutoProcessor, PocketTTSForConditionalGeneration

    from dstune.data.synthetic import render_tones

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    model = PocketTTSForConditionalGeneration.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    base = PocketTTSForConditionalGeneration.from_pretrained(CACHE_DIR / "builtin" / "tiny-pocket-tts-v1")
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    assert changed and torch.equal(base.latent_mean, model.latent_mean)  # the latent statistics are the base's
    if name.endswith("lora"):
        merged = PeftModel.from_pretrained(base, folder / "adapter").merge_and_unload()
        assert all(torch.allclose(merged.state_dict()[k], model.state_dict()[k], atol=1e-6) for k in changed)
    voice = render_tones("89")  # 16 kHz
    voice = np.interp(np.arange(int(len(voice) * 1.5)) / 1.5, np.arange(len(voice)), voice).astype(np.float32)
    content = [{"type": "audio", "audio": voice}, {"type": "text", "text": "42"}]
    inputs = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=True, return_dict=True,
                                           return_tensors="pt")
    torch.manual_seed(0)
    latents = model.generate(**inputs, max_new_tokens=6)
    processor.save_audio(processor.decode(latents[0]), str(tmp_path / "42.wav"))
    wave, rate = soundfile.read(tmp_path / "42.wav")
    assert rate == 24000 and 0 < len(wave) <= 6 * 1920 and np.isfinite(wave).all()


@pytest.mark.parametrize("name", [name for name in CODEBOOKS_CASES if name.startswith("gradium-phonon")])
def test_gradium_phonon_export_loads_with_its_processor_and_generates_a_wav(runs, name, tmp_path):
    """The export is a folder GradiumPhononTTSForConditionalGeneration + AutoProcessor load, with the trained weights
    (the latent statistics the base's), beside its speaker codec (MimiEncoderModel); the class's own generate after a
    voice prompt (the speaker codec's latents of a clip, given to the processor), decoded by the processor, writes a
    WAV; a LoRA export also holds the peft adapter, which gives the merged weights on the base."""
    import soundfile
    from peft import PeftModel
    from transformers import AutoProcessor, GradiumPhononTTSForConditionalGeneration, MimiEncoderModel

    from dstune.data.synthetic import render_tones
    from dstune.families.flow_head_tts import chat_prompt
    from dstune.models.gradium_phonon.model import speaker_latents

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    folder = run_dir / "export" / f"step-{STEPS:08d}"
    model = GradiumPhononTTSForConditionalGeneration.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    base = GradiumPhononTTSForConditionalGeneration.from_pretrained(CACHE_DIR / "builtin" / "tiny-gradium-phonon-v1")
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    assert changed and torch.equal(base.latent_mean, model.latent_mean)  # the latent statistics are the base's
    if name.endswith("lora"):
        merged = PeftModel.from_pretrained(base, folder / "adapter").merge_and_unload()
        assert all(torch.allclose(merged.state_dict()[k], model.state_dict()[k], atol=1e-6) for k in changed)
    voice = render_tones("89")  # 16 kHz
    voice = np.interp(np.arange(int(len(voice) * 1.5)) / 1.5, np.arange(len(voice)), voice).astype(np.float32)
    latents = speaker_latents(MimiEncoderModel.from_pretrained(folder / "speaker_codec"), processor, voice)
    inputs = processor(text=[chat_prompt(processor, "42", voiced=True)], audio_prompt_latents=[latents],
                       return_tensors="pt")
    torch.manual_seed(0)
    generated = model.generate(**inputs, max_new_tokens=6)
    processor.save_audio(processor.decode(generated[0]), str(tmp_path / "42.wav"))
    wave, rate = soundfile.read(tmp_path / "42.wav")
    assert rate == 24000 and 0 < len(wave) <= 6 * 1920 and np.isfinite(wave).all()
