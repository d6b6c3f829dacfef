"""The codec-token TTS LM class (dstune.models.tts_lm) with the orpheus layout on builtin:tiny-orpheus: SNAC codes in
Orpheus's frame order, the loss equal to the causal-LM loss with labels built as Orpheus's fine-tuning script builds
them, export and synthesis."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dstune.builtin import ensure_builtin_model
from dstune.data.audio import SpeechDataset, collate_speech, speech_records
from dstune.families.base import FamilyError
from dstune.families.speakers import voices_for
from dstune.families.speech_codecs import decode_codes, encode_clip
from dstune.pretrained import build_model
from dstune.spec.models import DataSpec
from dstune.models.tts_lm.model import TtsLm, audio_tokens
from dstune.models.tts_lm.spec import TtsLmModelSpec
from loaded_models import CACHE_DIR

pytest.importorskip("snac")
soundfile = pytest.importorskip("soundfile")

# Orpheus's ids, written out here as its fine-tuning notebook defines them (not read from dstune)
START_OF_TEXT, END_OF_TEXT, START_OF_SPEECH, END_OF_SPEECH = 128000, 128009, 128257, 128258
START_OF_HUMAN, END_OF_HUMAN, START_OF_AI, END_OF_AI, AUDIO_START = 128259, 128260, 128261, 128262, 128266


@pytest.fixture(scope="module")
def cache_dir():
    ensure_builtin_model("builtin:tiny-orpheus", CACHE_DIR)
    return CACHE_DIR


@pytest.fixture(scope="module")
def built(cache_dir):
    return build_model(
        TtsLmModelSpec(family="tts_lm", pretrained="builtin:tiny-orpheus", codec="snac", max_sample_seconds=0.4),
        cache_dir,
        "cpu",
    )


@pytest.fixture(scope="module")
def batch(built):
    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))
    dataset = SpeechDataset(records, built.sample_rate)
    return collate_speech([dataset[i] for i in range(3)])


def orpheus_codes_list(levels) -> list[int]:
    """Orpheus's interleave of SNAC's three levels (1, 2, 4 codes per frame), with a 4096 offset per position."""
    out = []
    for i in range(levels[0].shape[1]):
        frame = [
            levels[0][0][i],
            levels[1][0][2 * i],
            levels[2][0][4 * i],
            levels[2][0][4 * i + 1],
            levels[1][0][2 * i + 1],
            levels[2][0][4 * i + 2],
            levels[2][0][4 * i + 3],
        ]
        out += [int(code) + AUDIO_START + position * 4096 for position, code in enumerate(frame)]
    return out


def orpheus_example(tokenizer, text: str, codes_list: list[int]) -> tuple[list[int], list[int]]:
    """input_ids and labels as Orpheus's fine-tuning script makes them: labels are the input ids, unmasked."""
    text_tokens = tokenizer.encode(text, add_special_tokens=True) + [END_OF_TEXT]
    input_ids = (
        [START_OF_HUMAN]
        + text_tokens
        + [END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
        + codes_list
        + [END_OF_SPEECH, END_OF_AI]
    )
    return input_ids, list(input_ids)


def test_layout_is_read_from_the_folder_and_codes_follow_orpheus_frame_order(built, batch):
    assert built.layout["name"] == "orpheus" and built.sample_rate == 24000
    wave = batch["audio"][0]
    codes = encode_clip(built.codec, "snac", wave, 7, built.layout["frame_order"])
    with torch.no_grad():
        levels = built.codec.encode(wave.reshape(1, 1, -1).float())
    assert audio_tokens(built.layout, codes).tolist() == orpheus_codes_list(levels)
    wave_back = decode_codes(built.codec, "snac", codes, built.layout["frame_order"])
    with torch.no_grad():
        reference = built.codec.decode(levels).reshape(-1).numpy()
    assert np.array_equal(wave_back, reference)


def test_loss_equals_the_causal_lm_loss_on_orpheus_labels(built, batch):
    """Loss parity: the batch padded as DataCollatorForSeq2Seq pads (labels -100), one token mean."""
    encoded = built.encode_batch(batch)
    rows = []
    for text, wave in zip(batch["texts"], batch["audio"]):
        with torch.no_grad():
            levels = built.codec.encode(wave.reshape(1, 1, -1).float())
        rows.append(orpheus_example(built.tokenizer, text, orpheus_codes_list(levels)))
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [0] * (length - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (length - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids, _ in rows])
    lm = built.trainable
    with torch.no_grad():
        reference = lm(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        ours = built.loss(lm, encoded, 0, 0)
    assert torch.equal(encoded["labels"], labels) and torch.equal(encoded["attention_mask"], mask)
    assert abs(ours.item() - reference.item()) < 1e-5


def test_a_gptsovits_speaker_is_named_in_the_orpheus_prompt(built, tmp_path):
    """The speaker column of a .list reaches the tokens as Orpheus's multi-speaker prompts write it ("ann: text");
    a text that names its speaker already is left as it is."""
    for number, name in enumerate(("a.wav", "b.wav")):
        (tmp_path / "wavs").mkdir(exist_ok=True)
        soundfile.write(tmp_path / "wavs" / name, np.zeros(4800 + 2400 * number, dtype=np.float32), 24000)
    (tmp_path / "metadata.list").write_text("wavs/a.wav|ann|en|Hello there.\nwavs/b.wav|bob|en|bob: Hi.\n")
    records, _ = speech_records(DataSpec(path=str(tmp_path / "metadata.list")))
    dataset = SpeechDataset(records, built.sample_rate)
    built.voices = voices_for(
        built.card, built.model_spec, "separate", [r.speaker for r in records], [r.caption for r in records]
    )
    try:
        assert built.voices.given == {"ann": "ann", "bob": "bob"}  # the orpheus layout names each voice
        encoded = built.encode_batch(collate_speech([dataset[0], dataset[1]]))
    finally:
        built.voices = None
    for row, spoken in enumerate(("ann: Hello there.", "bob: Hi.")):
        prompt = [START_OF_HUMAN] + built.tokenizer.encode(spoken, add_special_tokens=True) + [END_OF_TEXT]
        assert encoded["input_ids"][row, : len(prompt)].tolist() == prompt


def test_export_synthesizes_with_snac(built, tmp_path):
    out = built.export(built.trainable.state_dict(), tmp_path / "export")
    assert json.loads((out / "dstune_tts.json").read_text())["name"] == "orpheus"
    assert sorted(p.name for p in (out / "codec").iterdir()) == ["config.json", "pytorch_model.bin"]
    clip = TtsLm.synthesize(out, "7", seconds=0.3, temperature=0.0, seed=0)
    assert clip.sample_rate == 24000 and 0 < clip.wave.size and np.isfinite(clip.wave).all()
    from dstune.cli import main

    assert (
        main(["synthesize", str(out), "7", "-o", str(tmp_path / "seven.wav"), "--seconds", "0.3", "--temperature", "0"])
        == 0
    )
    wave, rate = soundfile.read(tmp_path / "seven.wav")
    assert rate == 24000 and np.array_equal(wave.astype(np.float32), clip.wave)


def test_a_spec_layout_that_disagrees_with_the_folder_is_refused(cache_dir):
    with pytest.raises(ValueError, match="token_layout dstune writes one code per codebook"):
        TtsLmModelSpec(family="tts_lm", pretrained="builtin:tiny-orpheus", codec="snac", token_layout="dstune")
    with pytest.raises(
        FamilyError, match="codec .snac. != model.codec .encodec.|cannot load it as EncodecModel"
    ):  # set, not left out
        build_model(
            TtsLmModelSpec(family="tts_lm", pretrained="builtin:tiny-orpheus", codec="encodec"), cache_dir, "cpu"
        )


def test_added_text_tokens_grow_the_embeddings_and_survive_the_export(cache_dir, tmp_path):
    spec = TtsLmModelSpec(family="tts_lm", pretrained="builtin:tiny-orpheus", codec="snac", added_tokens=["bir", "şey"])
    built = build_model(spec, cache_dir, "cpu")
    assert built.tokenizer.convert_tokens_to_ids(["bir", "şey"]) == [156938, 156939]
    assert built.trainable.get_input_embeddings().num_embeddings == 156940 == built.layout["vocab_size"]
    encoded = built.encode_batch({"index": [0], "texts": ["bir şey"], "audio": [torch.randn(4096) * 0.1]})
    assert 156939 in encoded["input_ids"][0].tolist()
    loss = built.loss(built.trainable, encoded, 0, 0)
    loss.backward()
    assert built.trainable.get_input_embeddings().weight.grad[156939].abs().sum() > 0
    out = built.export(built.trainable.state_dict(), tmp_path / "export")
    again = build_model(
        TtsLmModelSpec(family="tts_lm", pretrained=str(out), codec="snac", added_tokens=["şey"]), cache_dir, "cpu"
    )
    assert again.tokenizer.convert_tokens_to_ids("şey") == 156939 and again.layout["vocab_size"] == 156940


def test_added_tokens_on_audio_ids_are_refused(cache_dir):
    """A token the tokenizer already has among the audio ids cannot be a new text token."""
    with pytest.raises(FamilyError, match="ids the layout uses for audio or special tokens"):
        build_model(
            TtsLmModelSpec(
                family="tts_lm", pretrained="builtin:tiny-orpheus", codec="snac", added_tokens=["<custom_token_20>"]
            ),
            cache_dir,
            "cpu",
        )


def test_lora_settings_default_to_the_llama_attention_and_refuse_added_tokens():
    from pydantic import ValidationError

    lora = TtsLmModelSpec(family="tts_lm", train="lora", lora={"rank": 4})
    assert lora.lora_settings.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert TtsLmModelSpec(**lora.model_dump()).lora_settings == lora.lora_settings  # as a checkpoint's spec reloads
    assert TtsLmModelSpec(family="tts_lm", train="lora").lora_settings.rank == 16
    assert TtsLmModelSpec(family="tts_lm").lora_settings is None
    with pytest.raises(ValidationError, match="added_tokens with train: lora"):
        TtsLmModelSpec(family="tts_lm", train="lora", added_tokens=["12"])
    with pytest.raises(ValidationError, match="lora settings are given but `train` is 'full'"):
        TtsLmModelSpec(family="tts_lm", lora={"rank": 4})


def test_lora_adapters_go_on_the_llama_with_the_installed_peft(cache_dir):
    """The LoRA path of tts_lm with the transformers and peft installed here (transformers >= 5.24's own
    add_adapter refuses peft < 0.22): adapters on q/k/v/o_proj only, only they trainable, untrained B = 0 so the
    loss is the base model's; a target that names no layer is refused naming the LM's class."""
    from dstune.families.lora import apply_train_mode

    spec = TtsLmModelSpec(
        family="tts_lm", pretrained="builtin:tiny-orpheus", codec="snac", train="lora", lora={"rank": 4}
    )
    model = build_model(spec, cache_dir, "cpu")
    summary = apply_train_mode(model, spec, seed=3)
    lm = model.trainable
    trainable = [name for name, p in lm.named_parameters() if p.requires_grad]
    assert "training: LoRA rank 4" in summary and trainable
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert {name.split(".lora_")[0].rsplit(".", 1)[1] for name in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    ids = torch.arange(1, 9).unsqueeze(0)
    plain = build_model(
        TtsLmModelSpec(family="tts_lm", pretrained="builtin:tiny-orpheus", codec="snac"), cache_dir, "cpu"
    )
    with torch.no_grad():
        assert torch.allclose(lm(input_ids=ids).logits, plain.trainable(input_ids=ids).logits, atol=1e-6)

    wrong = TtsLmModelSpec(
        family="tts_lm",
        pretrained="builtin:tiny-orpheus",
        codec="snac",
        train="lora",
        lora={"rank": 4, "target_modules": ["to_q"]},
    )
    with pytest.raises(FamilyError, match=r"model.lora.target_modules \['to_q'\]: .*Name layers of LlamaForCausalLM"):
        apply_train_mode(build_model(wrong, cache_dir, "cpu"), wrong, seed=3)


def test_codec_left_out_is_the_folders_in_validate_and_at_start_up(cache_dir):
    """`pretrained: builtin:tiny-orpheus` without `codec:`: validate resolves SNAC from the folder's dstune_tts.json,
    and the model start-up builds from that resolved spec loads (it used to say encodec here and refuse there)."""
    from dstune.spec.load import SpecSource, validate_data
    from dstune.validate import validate_spec
    from dstune.world import world_from_flags

    data = {
        "model": {"family": "tts_lm", "pretrained": "builtin:tiny-orpheus"},
        "data": {"path": "builtin:tones"},
        "train": {"micro_batch_size": 1, "max_steps": 2},
    }
    source = SpecSource("spec.yaml", {})
    resolved = validate_spec(validate_data(data, source), source, world_from_flags(num_gpus=1))
    assert resolved.spec.model.codec == "snac"
    assert build_model(resolved.spec.model, cache_dir, "cpu").codec_kind == "snac"
    unresolved = TtsLmModelSpec(
        family="tts_lm", pretrained="builtin:tiny-orpheus"
    )  # built without validate: same answer
    assert unresolved.codec is None and build_model(unresolved, cache_dir, "cpu").layout["codec"] == "snac"
    plain = validate_spec(
        validate_data({**data, "model": {"family": "tts_lm", "pretrained": "builtin:tiny-tts-lm"}}, source),
        source,
        world_from_flags(num_gpus=1),
    )
    assert plain.spec.model.codec == "encodec"


def test_validate_prints_the_voice_each_speaker_is_named_by(cache_dir, tmp_path, capsys):
    """The codec-token LM's layouts already handle speakers (orpheus: "ann: text"; dstune's layout refuses several):
    validate prints the orpheus layout's map (and --json holds it)."""
    from speaker_data import two_speaker_list, validate_output

    root = two_speaker_list(tmp_path / "data", rate=24000)
    model = {"family": "tts_lm", "pretrained": "builtin:tiny-orpheus", "codec": "snac"}
    code, out = validate_output(capsys, tmp_path, model, {"path": str(root)})
    assert code == 0 and "speakers 2 (names sorted): ann -> ann, bob -> bob" in out
    assert "the 'orpheus' layout names the voice: each clip's prompt is 'NAME: text'" in out
    from dstune.cli import main

    assert main(["validate", str(tmp_path / "spec.yaml"), "--num-gpus", "1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["speakers"]
    assert shown["speakers"] == {"ann": "ann", "bob": "bob"} and shown["blended"] == []
