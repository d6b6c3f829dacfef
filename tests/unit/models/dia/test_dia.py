"""Dia (its card and class, dstune.models.dia, on the multi-codebook core) on builtin:tiny-dia (transformers'
DiaForConditionalGeneration with its DiaProcessor and DAC): the batch and the loss equal what the processor builds for
training (output_labels=True: delay pattern, BOS/PAD masks, left-padded audio) and the class's own loss from it; the
labels are the delayed codes one position ahead; the codec cache holds the processor's DAC codes; [S1]/[S2] dialogue
text is kept; full and LoRA exports load with DiaForConditionalGeneration + DiaProcessor and generate a WAV, also
after a voice prompt."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dstune.builtin import ensure_builtin_model
from dstune.data.audio import SpeechDataset, collate_speech, speech_records
from dstune.families import card_of
from dstune.families.speakers import voices_for
from dstune.models.dia.card import DIA_CARD
from dstune.models.dia.model import Dia, dac_wave, dia_text, generate_codes
from dstune.pretrained import build_model
from dstune.spec.speech_models import CodebooksModelSpec
from dstune.spec.models import DataSpec
from loaded_models import CACHE_DIR

soundfile = pytest.importorskip("soundfile")
TEXT_KEYS = ("input_ids", "attention_mask")
DECODER_KEYS = ("decoder_input_ids", "decoder_attention_mask", "labels")


@pytest.fixture(scope="module")
def folder():
    return ensure_builtin_model("builtin:tiny-dia", CACHE_DIR), CACHE_DIR


@pytest.fixture(scope="module")
def built(folder):
    spec = CodebooksModelSpec(family="tts_codebooks", pretrained="builtin:tiny-dia", max_sample_seconds=0.2)
    return build_model(spec, folder[1], "cpu")


@pytest.fixture(scope="module")
def batch(built):
    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))
    dataset = SpeechDataset(records, built.sample_rate)
    chosen = collate_speech([dataset[i] for i in (0, 5, 9)])  # 0.26 s, 0.52 s, 0.26 s: the audio is left-padded
    chosen["texts"] = ["[S1] one two. [S2] three.", chosen["texts"][1], "[S2] " + chosen["texts"][2]]
    return chosen


def whole_dia(folder):
    from transformers import DiaForConditionalGeneration, DiaProcessor

    return DiaForConditionalGeneration.from_pretrained(folder).eval(), DiaProcessor.from_pretrained(folder)


def processor_inputs(processor, texts, audio):
    """Dia's documented training inputs: the processor with generation=False and output_labels=True."""
    return processor(
        text=texts,
        audio=[w.numpy() for w in audio],
        generation=False,
        output_labels=True,
        sampling_rate=processor.feature_extractor.sampling_rate,
    )


def test_the_folder_is_dias(folder, built):
    assert card_of("tts_codebooks", folder[0]) is DIA_CARD and type(built) is Dia and built.card is DIA_CARD


def test_batch_and_loss_equal_the_processors_labels_and_the_classs_own_loss(folder, built, batch):
    model, processor = whole_dia(folder[0])
    texts = [dia_text(t, DIA_CARD.speaker_tags) for t in batch["texts"]]
    assert texts[1].startswith("[S1] ") and texts[0] == batch["texts"][0]  # untagged text is spoken by [S1]
    inputs = processor_inputs(processor, texts, batch["audio"])
    encoded = built.encode_batch(batch)
    for key in TEXT_KEYS + DECODER_KEYS:
        assert torch.equal(encoded[key], inputs[key].long()), key
    assert (encoded["decoder_attention_mask"][:, 0] == 0).any()  # a shorter clip was left-padded, as the processor does
    assert {1, 2} <= set(encoded["input_ids"][0].tolist())  # [S1] and [S2] are their own ids
    with torch.no_grad():
        theirs = model(**inputs).loss
        built.trainable.eval()
        ours = built.loss(built.trainable, encoded, 0, 0)
        built.trainable.train()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_a_batch_of_one_clip_trains_with_the_processors_labels(folder, built, batch):
    """micro_batch_size 1 (what a user of the real 1.6 B Dia on a small GPU sets): the labels of one clip are the
    processor's and contiguous, as transformers' loss views them flat, and the class's loss backpropagates."""
    model, processor = whole_dia(folder[0])
    one = {"audio": batch["audio"][:1], "texts": batch["texts"][:1], "index": batch["index"][:1]}
    encoded = built.encode_batch(one)
    inputs = processor_inputs(processor, [dia_text(one["texts"][0], DIA_CARD.speaker_tags)], one["audio"])
    assert torch.equal(encoded["labels"], inputs["labels"].long()) and encoded["labels"].is_contiguous()
    with torch.no_grad():
        theirs = model(**inputs).loss
    built.trainable.zero_grad(set_to_none=True)
    ours = built.loss(built.trainable, encoded, 0, 0)
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert all(p.grad is not None for p in built.trainable.parameters() if p.requires_grad)
    built.trainable.zero_grad(set_to_none=True)


def _loss_with_shift(logits, encoded, config, shift):
    """Mean cross-entropy of every labelled (codebook, position t), predicting the delayed sequence's code at
    t - 1 + shift: shift 1 is the next position."""
    sequence = encoded["decoder_input_ids"]  # (B, T, C)
    batch, length, channels = sequence.shape
    labels = encoded["labels"].reshape(batch, channels, length)
    last = labels[:, :, -1].clamp(min=0).unsqueeze(1)  # the sequence's final row (masked positions are never used)
    full = torch.cat([sequence, last, torch.full_like(last, config.decoder_config.pad_token_id)], 1)
    rows, chans, positions = (labels != -100).nonzero(as_tuple=True)
    targets = full[rows, positions + shift, chans]
    return torch.nn.functional.cross_entropy(
        logits.reshape(batch, channels, length, -1)[rows, chans, positions], targets
    ).item()


def test_labels_are_the_delayed_codes_one_position_ahead(built, batch):
    """The class's loss (no shift inside) equals the cross-entropy against the next position of the delayed
    sequence, and not against the same position or the one after next (a label shifted one too few or too many);
    the first frame's codebook 0 is predicted from BOS."""
    encoded = built.encode_batch(batch)
    config = built.trainable.model.config
    with torch.no_grad():
        out = built.trainable(**{k: encoded[k] for k in TEXT_KEYS + DECODER_KEYS})
    right = _loss_with_shift(out.logits.float(), encoded, config, 1)
    assert out.loss.item() == pytest.approx(right, rel=1e-5)
    for wrong in (0, 2):
        assert abs(out.loss.item() - _loss_with_shift(out.logits.float(), encoded, config, wrong)) > 1e-3
    channel0 = encoded["labels"].reshape(3, config.decoder_config.num_channels, -1)[0, 0]
    first = int((channel0 != -100).nonzero()[0])
    assert encoded["decoder_input_ids"][0, first, 0] == config.decoder_config.bos_token_id


def test_codec_cache_holds_the_processors_dac_codes(folder, built, batch, tmp_path):
    from dstune.cache.codec_tokens import encode_entries, plan_codec_entries
    from safetensors.torch import load_file

    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))
    chosen = [records[i] for i in (0, 5, 9)]
    entries = plan_codec_entries(chosen, built)
    assert encode_entries(built, entries, {r.sample_id: r for r in chosen}, tmp_path) == (3, 0)
    cached = [load_file(tmp_path / e.relpath)["codes"].long() for e in entries]
    assert all(c.shape[0] == 9 for c in cached)
    _, processor = whole_dia(folder[0])
    inputs = processor_inputs(processor, [dia_text(t, DIA_CARD.speaker_tags) for t in batch["texts"]], batch["audio"])
    from_cache = built.encode_batch({**batch, "codes": cached})
    for key in DECODER_KEYS:
        assert torch.equal(from_cache[key], inputs[key].long()), key
    unpadded = [built.codec.encode(w.reshape(1, 1, -1)).audio_codes[0] for w in batch["audio"]]
    assert any(not torch.equal(u, c[:, : u.shape[1]]) or u.shape != c.shape for u, c in zip(unpadded, cached))


def _generate_wav(folder, path, seed=0, **prompt):
    model, processor = whole_dia(folder)
    inputs = processor(text=["[S1] 12. [S2] 34."], **prompt)
    torch.manual_seed(seed)
    sequence = model.generate(**inputs, max_new_tokens=24)
    processor.save_audio(processor.batch_decode(sequence), str(path))
    wave, rate = soundfile.read(path)
    return wave, rate


def test_export_loads_with_its_processor_and_generates_a_wav(folder, built, tmp_path):
    from transformers import DiaForConditionalGeneration

    from dstune.export import speak

    state = {
        k: v.clone() + (0.01 if k.endswith("logits_dense.weight") else 0.0)
        for k, v in built.trainable.state_dict().items()
    }
    out = built.export(state, tmp_path / "export")
    model = DiaForConditionalGeneration.from_pretrained(out)
    assert torch.equal(model.logits_dense.weight, state["model.logits_dense.weight"])
    wave, rate = _generate_wav(out, tmp_path / "out.wav")
    assert rate == 44100 and len(wave) > 0 and np.isfinite(wave).all()
    clip = speak(out, "[S1] 12", tmp_path / "said.wav", seconds=0.2, temperature=1.8, seed=0)  # `dstune synthesize`
    assert clip.sample_rate == 44100 and len(clip.wave) > 0 and soundfile.read(tmp_path / "said.wav")[1] == 44100


def test_voice_prompt_is_continued_and_left_out_of_the_clip(folder, built, batch):
    """With reference audio and its transcript, generate continues the prompt's codes (the processor puts them
    in the decoder's input) and the clip holds only what follows them."""
    model, processor = whole_dia(folder[0])
    prompt = batch["audio"][0].numpy()
    prompted = processor(text=["[S1] 89 [S1] 12"], audio=[prompt], sampling_rate=44100)
    frames = int(np.ceil(len(prompt) / 512))
    with torch.no_grad():
        codes = generate_codes(model, processor, dia_text("89 12", DIA_CARD.speaker_tags), 20, 1.8, 0, prompt)
        plain = generate_codes(model, processor, dia_text("12", DIA_CARD.speaker_tags), 20, 1.8, 0)
    assert prompted["decoder_input_ids"].shape[1] == frames + 1 + 15  # BOS, the prompt's frames, the delay
    assert codes.shape[0] == 9 and codes.shape[1] <= 20 and (codes < 1024).all()
    assert codes.shape != plain.shape or not torch.equal(codes, plain)  # the prompt changed what was said
    with torch.no_grad():
        clip = built.speak(model, "12", 0, (prompt, "[S1] 89"))  # a sample after sample.voice_prompts' clip
    assert clip.sample_rate == 44100 and np.isfinite(clip.wave).all()


def test_lora_export_is_a_peft_adapter_and_a_merged_folder(folder, tmp_path):
    from peft import PeftModel
    from transformers import DiaForConditionalGeneration

    from dstune.families.lora import apply_train_mode, export_lora

    spec = CodebooksModelSpec(family="tts_codebooks", pretrained="builtin:tiny-dia", train="lora", lora={"rank": 4})
    lora_built = build_model(spec, folder[1], "cpu")
    apply_train_mode(lora_built, spec, 0, "peft")
    names = [n for n, p in lora_built.trainable.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any("encoder" in n for n in names) and any("cross_attention" in n for n in names)
    with torch.no_grad():
        for name, param in lora_built.trainable.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    export_lora(lora_built, lora_built.trainable.state_dict(), tmp_path, spec)
    merged = DiaForConditionalGeneration.from_pretrained(tmp_path)
    base = DiaForConditionalGeneration.from_pretrained(folder[0])
    name = "model.decoder.layers.0.cross_attention.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    assert torch.allclose(merged.state_dict()[name], adapted.state_dict()[name], atol=1e-6)
    wave, rate = _generate_wav(tmp_path, tmp_path / "lora.wav")
    assert rate == 44100 and len(wave) > 0


def _reference_clip(folder: Path) -> Path:
    """A reference clip (the first tones clip at 16 kHz, resampled by the sampler) and its transcript beside it."""
    from dstune.data.synthetic import render_tones

    folder.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(folder / "voice.wav"), render_tones("89"), 16000)
    (folder / "voice.txt").write_text("[S1] 89")
    return folder / "voice.wav"


def test_samples_continue_sample_voice_prompts(built, tmp_path):
    """With sample.voice_prompts each training sample is generated after its reference clip and transcript (read,
    resampled to the DAC's rate), which is what generate_codes does with that clip; without, from the text alone."""
    from dstune.spec.models import SampleSpec

    reference = _reference_clip(tmp_path / "voices")
    spec = SampleSpec(prompts=["12"], voice_prompts=[str(reference)], seed=3)
    module = built.trainable
    prompted = built.sample(module, ["12"], spec)[0]
    plain = built.sample(module, ["12"], SampleSpec(prompts=["12"], seed=3))[0]
    audio, text = built.voice_prompt(reference)
    assert text == "[S1] 89" and abs(len(audio) - 44100 * len(soundfile.read(reference)[0]) / 16000) <= 1
    with torch.no_grad():
        module.eval()
        words = dia_text(f"{text} 12", DIA_CARD.speaker_tags)
        codes = generate_codes(
            module.model, built.processor, words, int(0.2 * 44100 / 512), built.temperature, 3000, audio
        )
        module.train()
    assert np.array_equal(prompted.wave, dac_wave(built.codec, codes))
    assert prompted.wave.shape != plain.wave.shape or not np.array_equal(prompted.wave, plain.wave)


def _validate(capsys, tmp_path, pretrained: str, sample: dict, family: str = "tts_codebooks"):
    import yaml

    from dstune.cli import main

    spec = {
        "model": {"family": family, "pretrained": pretrained},
        "data": {"path": "builtin:tones"},
        "train": {"micro_batch_size": 1, "max_steps": 2},
        "sample": sample,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    code = main(["validate", str(path), "--num-gpus", "1"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_validate_checks_voice_prompts(capsys, tmp_path):
    reference = _reference_clip(tmp_path / "voices")
    assert (
        _validate(capsys, tmp_path, "builtin:tiny-dia", {"prompts": ["12"], "voice_prompts": [str(reference)]})[0] == 0
    )
    reference.with_suffix(".txt").unlink()
    code, out = _validate(capsys, tmp_path, "builtin:tiny-dia", {"prompts": ["12"], "voice_prompts": [str(reference)]})
    assert code == 1 and "sample.voice_prompts.0" in out and "voice.txt is missing" in out
    code, out = _validate(capsys, tmp_path, "builtin:tiny-dia", {"prompts": ["12", "3"], "voice_prompts": ["a.wav"]})
    assert code == 1 and "sample.voice_prompts has 1 clip(s) for 2 prompt(s)" in out
    code, out = _validate(capsys, tmp_path, "builtin:tiny-csm", {"prompts": ["12"], "voice_prompts": [str(reference)]})
    assert code == 1 and "CsmForConditionalGeneration is not given a reference voice here" in out
    code, out = _validate(
        capsys, tmp_path, "builtin:tiny-tts-lm", {"prompts": ["12"], "voice_prompts": ["a.wav"]}, family="tts_lm"
    )
    assert code == 1 and "model.family tts_lm does not continue a reference voice" in out


def test_dialogue_jsonl_and_gptsovits_list_with_speaker_balance(built, capsys, tmp_path):
    """The dataset formats with speakers: a metadata.jsonl of dialogue clips (transcripts tagged [S1]/[S2]) and a
    GPT-SoVITS .list plan with data.speaker_balance for tiny-dia, and their clips become the class's inputs with
    the tags as Dia's own ids (an untagged line spoken by [S1])."""
    import json

    import yaml

    from dstune.cli import main
    from dstune.data.synthetic import render_tones

    root = tmp_path / "dialogues"
    (root / "clips").mkdir(parents=True)
    lines, rows = [], []
    for number, (speaker, text) in enumerate(
        [("ann", "[S1] 12 [S2] 34"), ("bob", "[S2] 5"), ("ann", "67"), ("bob", "[S1] 8 [S2] 9")]
    ):
        soundfile.write(str(root / "clips" / f"{number}.wav"), render_tones(text[-2:].strip()), 16000)
        lines.append(json.dumps({"audio": f"clips/{number}.wav", "text": text, "speaker": speaker}))
        rows.append(f"clips/{number}.wav|{speaker}|en|{text}")
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    (root / "metadata.list").write_text("\n".join(rows) + "\n")
    for data_format in ("jsonl", "gptsovits"):
        spec = {
            "model": {"family": "tts_codebooks", "pretrained": "builtin:tiny-dia"},
            "data": {"path": str(root), "format": data_format, "speaker_balance": True},
            "train": {"micro_batch_size": 2, "max_steps": 2},
        }
        (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        assert main(["validate", str(tmp_path / "spec.yaml"), "--num-gpus", "2"]) == 0, capsys.readouterr()
        capsys.readouterr()
        records, _ = speech_records(DataSpec(path=str(root), format=data_format, speaker_balance=True))
        assert sorted({r.speaker for r in records}) == ["ann", "bob"]
        dataset = SpeechDataset(records, built.sample_rate)
        built.voices = voices_for(
            DIA_CARD, built.model_spec, "separate", [r.speaker for r in records], [r.caption for r in records]
        )
        try:
            encoded = built.encode_batch(collate_speech([dataset[i] for i in range(4)]))
        finally:
            built.voices = None
        first_ids = encoded["input_ids"][:, 0].tolist()
        assert first_ids == [1, 2, 1, 1]  # [S1], [S2], the untagged clip of ann ([S1]), [S1]
        assert 2 in encoded["input_ids"][3].tolist() and torch.isfinite(built.loss(built.trainable, encoded, 0, 0))


def test_two_speakers_take_dias_tags_and_a_third_is_refused(folder, built, tmp_path, capsys):
    """A two-speaker .list (bob listed first): the sorted names take Dia's tags (ann [S1], bob [S2]) and each clip's
    ids are DiaProcessor's for its tagged text; validate prints the map, and refuses a third speaker (Dia has two
    voices) with the reason and the fix, or takes it blended with data.speakers: blend; dialogue transcripts (tagged
    turns) keep their own tags whatever their speaker column says."""
    from speaker_data import speaker_batch, two_speaker_list, validate_output

    _, processor = whole_dia(folder[0])
    root = two_speaker_list(tmp_path / "data")
    batch = speaker_batch(built, root)
    try:
        assert built.voices.given == {"ann": "[S1]", "bob": "[S2]"}
        encoded = built.encode_batch(batch)
    finally:
        built.voices = None
    inputs = processor_inputs(processor, [f"[S2] {batch['texts'][0]}", f"[S1] {batch['texts'][1]}"], batch["audio"])
    assert torch.equal(encoded["input_ids"], inputs["input_ids"])
    assert encoded["input_ids"][:, 0].tolist() == [2, 1]  # bob's clip [S2], ann's [S1]
    model = {"family": "tts_codebooks", "pretrained": "builtin:tiny-dia"}
    code, out = validate_output(capsys, tmp_path, model, {"path": str(root)})
    assert code == 0 and "speakers 2 (names sorted): ann -> [S1], bob -> [S2]" in out
    two_speaker_list(root, [("bob", "34"), ("ann", "12"), ("cy", "5")])
    code, out = validate_output(capsys, tmp_path, model, {"path": str(root)})
    assert code == 1 and "the data names 3 speakers (ann, bob, cy), but Dia has 2 voices, [S1] and [S2]" in out
    assert "Train 2 speakers per run" in out and "data.speakers: blend" in out
    code, out = validate_output(capsys, tmp_path, model, {"path": str(root), "speakers": "blend"})
    assert code == 0 and "3 (ann, bob, cy), blended into Dia's default voice (data.speakers: blend)" in out
    two_speaker_list(root, [("bob", "[S1] 34 [S2] 1"), ("ann", "[S2] 12"), ("cy", "[S1] 5")])
    code, out = validate_output(capsys, tmp_path, model, {"path": str(root)})  # dialogues: their own turns
    assert code == 0 and "names sorted" not in out
