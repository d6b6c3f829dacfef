"""Sesame CSM (its card and class, dstune.models.csm, on the multi-codebook core) on builtin:tiny-csm (transformers'
CsmForConditionalGeneration with its Mimi codec): the loss equals the class's own loss from the labels CsmProcessor
builds (output_labels=True), the frame labels sit at the frame's own position (the class shifts them), the codec cache
holds the class's own Mimi codes, and full and LoRA exports load with from_pretrained + AutoProcessor and generate a
WAV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dstune.builtin import ensure_builtin_model
from dstune.data.audio import SpeechDataset, collate_speech, speech_records
from dstune.families import card_of
from dstune.models.csm.card import CSM_CARD
from dstune.models.csm.model import Csm, decodable_codes
from dstune.families.base import FamilyError
from dstune.pretrained import build_model
from dstune.spec.models import DataSpec
from dstune.spec.speech_models import CodebooksModelSpec
from loaded_models import CACHE_DIR

soundfile = pytest.importorskip("soundfile")


@pytest.fixture(scope="module")
def folder():
    return ensure_builtin_model("builtin:tiny-csm", CACHE_DIR), CACHE_DIR


@pytest.fixture(scope="module")
def built(folder):
    return build_model(CodebooksModelSpec(family="tts_codebooks", max_sample_seconds=0.4), folder[1], "cpu")


@pytest.fixture(scope="module")
def batch(built):
    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))
    dataset = SpeechDataset(records, built.sample_rate)
    return collate_speech([dataset[i] for i in (0, 5, 9)])


def whole_csm(folder):
    from transformers import AutoProcessor, CsmForConditionalGeneration

    return CsmForConditionalGeneration.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)


def test_loss_equals_the_classs_own_loss_from_the_processors_labels(folder, built, batch):
    """The reference is CSM's documented recipe: the processor turns (text, audio) into ids, input_values and
    labels (output_labels=True: every frame trains the depth decoder), and the class encodes the audio itself."""
    model, processor = whole_csm(folder[0])
    texts = [f"<|begin_of_text|>[0]{t}<|end_of_text|><|AUDIO|><|audio_eos|>" for t in batch["texts"]]
    inputs = processor(
        texts,
        audio=[w.numpy() for w in batch["audio"]],
        output_labels=True,
        depth_decoder_labels_ratio=1.0,
        padding_side="right",
    )
    with torch.no_grad():
        theirs = model(**inputs)
        encoded = built.encode_batch(batch)
        ours = built.trainable(**{k: encoded[k] for k in ("input_ids", "frame_codes", "attention_mask", "labels")})
        loss = built.loss(built.trainable, encoded, 0, 0)
    assert torch.equal(encoded["input_ids"], inputs["input_ids"])  # the same sequence, padding included
    assert ours.backbone_loss.item() == pytest.approx(theirs.backbone_loss.item(), rel=1e-5)
    assert ours.depth_decoder_loss.item() == pytest.approx(theirs.depth_decoder_loss.item(), rel=1e-5)
    assert loss.item() == pytest.approx(theirs.loss.item(), rel=1e-5)


def _backbone_loss_from(logits, encoded, shift):
    """Cross-entropy of codebook 0 of every labelled frame at t, predicted from position t - shift."""
    labels = encoded["labels"][..., 0]
    rows, positions = (labels != -100).nonzero(as_tuple=True)
    return torch.nn.functional.cross_entropy(logits[rows, positions - shift], labels[rows, positions]).item()


def test_frame_labels_are_predicted_from_the_previous_position(built, batch):
    """The first frame is predicted from <|end_of_text|>, frame t from frame t-1's position, the EOS frame from the
    last frame's: dstune's backbone loss equals that cross-entropy and not the one a label shifted by one position
    too many or too few gives."""
    encoded = built.encode_batch(batch)
    with torch.no_grad():
        out = built.trainable(**{k: encoded[k] for k in ("input_ids", "frame_codes", "attention_mask", "labels")})
    logits = out.logits.float()
    first = (encoded["labels"][0, :, 0] != -100).nonzero()[0, 0]
    assert encoded["input_ids"][0, first - 1] == built.processor.tokenizer.eos_token_id
    assert out.backbone_loss.item() == pytest.approx(_backbone_loss_from(logits, encoded, 1), rel=1e-5)
    for wrong in (0, 2):
        assert abs(out.backbone_loss.item() - _backbone_loss_from(logits, encoded, wrong)) > 1e-3


def test_codec_cache_holds_the_classs_own_mimi_codes(folder, built, batch, tmp_path):
    from dstune.cache.codec_tokens import encode_entries, plan_codec_entries
    from safetensors.torch import load_file

    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))
    chosen = [records[i] for i in (0, 5, 9)]
    entries = plan_codec_entries(chosen, built)
    assert encode_entries(built, entries, {r.sample_id: r for r in chosen}, tmp_path) == (3, 0)
    cached = [load_file(tmp_path / e.relpath)["codes"].long() for e in entries]
    model, _ = whole_csm(folder[0])
    with torch.no_grad():
        for codes, wave in zip(cached, batch["audio"]):
            own = model.codec_model.encode(wave.reshape(1, 1, -1)).audio_codes[0]
            assert codes.shape[0] == model.config.num_codebooks == 4 and torch.equal(codes, own)
    from_cache = built.encode_batch({**batch, "codes": cached})
    from_audio = built.encode_batch(batch)
    assert all(torch.equal(from_cache[k], from_audio[k]) for k in ("input_ids", "frame_codes", "labels"))


def test_export_loads_with_its_processor_and_generates_a_wav(folder, built, tmp_path):
    from transformers import AutoProcessor, CsmForConditionalGeneration

    state = {
        k: v.clone() + (0.01 if k.endswith("lm_head.weight") else 0.0) for k, v in built.trainable.state_dict().items()
    }
    out = built.export(state, tmp_path / "export")
    model = CsmForConditionalGeneration.from_pretrained(out).eval()
    processor = AutoProcessor.from_pretrained(out)
    assert torch.equal(model.lm_head.weight, state["model.lm_head.weight"])
    inputs = processor("<|begin_of_text|>[0]12<|end_of_text|>")
    torch.manual_seed(0)
    audio = model.generate(
        **inputs, output_audio=True, max_new_tokens=4, **decodable_codes(model.config.vocab_size, 32)
    )  # ids 32..34 are not codes
    processor.save_audio(audio, str(tmp_path / "out.wav"))
    wave, rate = soundfile.read(tmp_path / "out.wav")
    assert rate == 24000 and len(wave) > 0 and np.isfinite(wave).all()
    from dstune.export import speak

    clip = speak(out, "12", tmp_path / "said.wav", seconds=0.3, temperature=0.8, seed=0)  # `dstune synthesize`
    assert clip.sample_rate == 24000 and len(clip.wave) > 0 and soundfile.read(tmp_path / "said.wav")[1] == 24000


def test_lora_export_is_a_peft_adapter_and_a_merged_folder(folder, tmp_path):
    from peft import PeftModel
    from transformers import CsmForConditionalGeneration

    from dstune.families.lora import apply_train_mode, export_lora

    spec = CodebooksModelSpec(family="tts_codebooks", train="lora", lora={"rank": 4})
    lora_built = build_model(spec, folder[1], "cpu")
    apply_train_mode(lora_built, spec, 0, "peft")
    names = [n for n, p in lora_built.trainable.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names) and not any("codec" in n for n in names)
    with torch.no_grad():
        for name, param in lora_built.trainable.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    export_lora(lora_built, lora_built.trainable.state_dict(), tmp_path, spec)
    merged = CsmForConditionalGeneration.from_pretrained(tmp_path)
    base = CsmForConditionalGeneration.from_pretrained(folder[0])
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    name = "backbone_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        merged.state_dict()[name], CsmForConditionalGeneration.from_pretrained(folder[0]).state_dict()[name]
    )
    assert torch.allclose(merged.state_dict()[name], adapted.state_dict()[name], atol=1e-6)


def _lora_step(folder, batch, checkpointing: bool) -> tuple[float, dict]:
    """(loss, adapter gradients) of one LoRA step on `batch`, with or without gradient checkpointing."""
    from dstune.families.lora import apply_train_mode

    spec = CodebooksModelSpec(
        family="tts_codebooks", train="lora", lora={"rank": 4}, gradient_checkpointing=checkpointing
    )
    lora_built = build_model(spec, folder[1], "cpu")
    apply_train_mode(lora_built, spec, 0, "peft")
    with torch.no_grad():
        for name, param in lora_built.trainable.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)  # so that A's gradient is not zero
    loss = lora_built.loss(lora_built.trainable, lora_built.encode_batch(batch), 0, 0)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in lora_built.trainable.named_parameters() if p.requires_grad}


def test_lora_with_gradient_checkpointing_trains_as_without_it(folder, batch):
    """transformers' gradient_checkpointing_enable makes every input embedding's output require grad (for reentrant
    checkpointing); with LoRA the depth decoder's frozen embedding then gives a leaf, which CSM's forward writes into
    in place, and the step stopped with a RuntimeError. Non-reentrant checkpointing needs no such hook."""
    plain_loss, plain = _lora_step(folder, batch, checkpointing=False)
    loss, grads = _lora_step(folder, batch, checkpointing=True)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert set(grads) == set(plain) and all(grads[n] is not None for n in grads)
    assert all(torch.allclose(grads[n], plain[n], rtol=1e-4, atol=1e-7) for n in grads)


def test_the_folder_is_csms_and_a_folder_of_another_class_is_refused(folder, built, tmp_path):
    assert card_of("tts_codebooks", folder[0]) is CSM_CARD and type(built) is Csm and built.card is CSM_CARD
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(
        FamilyError,
        match="names \\['LlamaForCausalLM'\\], none of the classes model.family tts_codebooks trains "
        "\\(CsmForConditionalGeneration",
    ):
        card_of("tts_codebooks", tmp_path)


def test_two_speakers_take_the_processors_speaker_ids(folder, built, tmp_path, capsys):
    """A two-speaker .list of names (bob listed first): the sorted names take CSM's speaker ids (ann 0, bob 1), where
    before the names went into the prompt ("[bob]34"); each clip's ids are what CsmProcessor makes of the turn
    "[N]text" as CSM's chat template writes a turn of role N; validate prints the map."""
    from speaker_data import speaker_batch, two_speaker_list, validate_output

    _, processor = whole_csm(folder[0])
    root = two_speaker_list(tmp_path / "data", rate=24000)
    batch = speaker_batch(built, root)
    try:
        assert built.voices.given == {"ann": "0", "bob": "1"}
        encoded = built.encode_batch(batch)
    finally:
        built.voices = None
    assert batch["speakers"] == ["bob", "ann"]
    texts = [f"<|begin_of_text|>[{n}]{t}<|end_of_text|><|AUDIO|><|audio_eos|>" for n, t in zip("10", batch["texts"])]
    inputs = processor(texts, audio=[w.numpy() for w in batch["audio"]], padding_side="right")
    assert torch.equal(encoded["input_ids"], inputs["input_ids"])
    prefix = processor.tokenizer("[1]", add_special_tokens=False).input_ids
    assert encoded["input_ids"][0, 1 : 1 + len(prefix)].tolist() == prefix  # bob's turn is speaker 1's
    code, out = validate_output(capsys, tmp_path, {"family": "tts_codebooks", "pretrained": "builtin:tiny-csm"},
                                {"path": str(root)})  # fmt: skip
    assert code == 0 and "speakers 2 (names sorted): ann -> 0, bob -> 1" in out and "[N]text" in out
