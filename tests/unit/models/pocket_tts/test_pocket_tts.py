"""Pocket TTS (its card and class, dstune.models.pocket_tts, on the multi-codebook core) on builtin:tiny-pocket-tts
(transformers' PocketTTSForConditionalGeneration with its PocketTTSProcessor and audio tokenizer): dstune's loss equals
the class's own loss from `labels` on the processor's inputs and the same draws (one sample; a batch as the class
weights its frames), each frame's flow loss is read one position before it (a shifted reading is told apart), each
sample draws its own noise; the codec cache holds the processor's latents; two speakers are conditioned on their own
reference clips, following the speaker column; full and LoRA exports load with the class and its processor and
generate a WAV."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dstune.builtin import ensure_builtin_model
from dstune.data.audio import SpeechDataset, collate_speech, reference_clips, speech_records
from dstune.families import card_of
from dstune.families.flow_head_tts import chat_prompt
from dstune.families.randomness import sample_seed
from dstune.models.pocket_tts.card import POCKET_TTS_CARD
from dstune.models.pocket_tts.model import DISTILL_PURPOSE, FLOW_PURPOSE, TRAIN_KEYS, PocketTTS
from dstune.pretrained import build_model
from dstune.spec.models import DataSpec
from dstune.spec.speech_models import CodebooksModelSpec
from loaded_models import CACHE_DIR

soundfile = pytest.importorskip("soundfile")
SEED, ROWS = 7, (0, 5, 9)


@pytest.fixture(scope="module")
def folder():
    return ensure_builtin_model("builtin:tiny-pocket-tts", CACHE_DIR)


@pytest.fixture(scope="module")
def records():
    return speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))[0]


@pytest.fixture(scope="module")
def built(folder, records):
    spec = CodebooksModelSpec(family="tts_codebooks", pretrained="builtin:tiny-pocket-tts", max_sample_seconds=0.5)
    built = build_model(spec, CACHE_DIR, "cpu")
    built.take_voices(reference_clips(records, built.voice_references, built.sample_rate))
    built.trainable.train()  # the class's training loss (its self-distillation coin); no dropout in it
    return built


@pytest.fixture(scope="module")
def batch(built, records):
    dataset = SpeechDataset(records, built.sample_rate)
    return collate_speech([dataset[i] for i in ROWS])


def whole_pocket_tts(folder):
    from transformers import AutoProcessor, PocketTTSForConditionalGeneration

    model = PocketTTSForConditionalGeneration.from_pretrained(folder)
    model.config.latent_stats_ema_steps = 0  # dstune keeps the folder's latent statistics (docs/tts.md)
    return model.train(), AutoProcessor.from_pretrained(folder)


def distill_step(coin: bool) -> int:
    """A step whose self-distillation coin (probability 0.25) comes up `coin`."""
    for step in range(100):
        draw = torch.rand((), generator=torch.Generator().manual_seed(sample_seed(SEED, step, 0, DISTILL_PURPOSE)))
        if (float(draw) < 0.25) == coin:
            return step
    raise AssertionError("no such step")


def class_loss(model, encoded, rows, seed: int, step: int, eos_weight=None):
    """The class's own forward from `labels` on samples `rows` of our processor inputs, its noise and times from the
    global RNG seeded with `seed`, its self-distillation generator seeded as dstune seeds the step's coin."""
    rows = list(rows)
    length = int(encoded["attention_mask"][rows].sum(1).max())
    frames = int(encoded["labels_mask"][rows].sum(1).max())
    inputs = {k: encoded[k][rows] for k in TRAIN_KEYS if k in encoded}
    inputs["input_ids"], inputs["attention_mask"] = (
        inputs["input_ids"][:, :length],
        inputs["attention_mask"][:, :length],
    )
    inputs["labels"], inputs["labels_mask"] = inputs["labels"][:, :frames], inputs["labels_mask"][:, :frames]
    weight = model.config.eos_loss_weight
    model.config.eos_loss_weight = weight if eos_weight is None else eos_weight
    model.distill_generator = torch.Generator().manual_seed(sample_seed(SEED, step, 0, DISTILL_PURPOSE))
    torch.manual_seed(seed)
    try:
        return model(**inputs).loss.item()
    finally:
        model.config.eos_loss_weight = weight


def draw_seed(encoded, row: int, step: int) -> int:
    return sample_seed(SEED, step, int(encoded["indices"][row]), FLOW_PURPOSE)


def test_the_folder_is_pocket_tts(folder, built):
    assert card_of("tts_codebooks", folder) is POCKET_TTS_CARD
    assert type(built) is PocketTTS and built.card is POCKET_TTS_CARD


@pytest.mark.parametrize("distilled", [False, True])
def test_loss_equals_the_classs_own_loss_from_labels_on_the_same_draws(folder, built, batch, distilled):
    """One sample: dstune's loss is the class's forward from the labels with the same seeds. A batch: each sample's
    flow loss (the class's, alone, without the end-of-speech term) weighted by its frames, plus the class's
    end-of-speech term over the batch (its loss with and without that term on the same draws)."""
    model, _ = whole_pocket_tts(folder)
    step = distill_step(distilled)
    encoded = built.encode_batch(batch)
    with torch.no_grad():
        ours = built.loss(built.trainable, encoded, SEED, step).item()
        for row in range(len(ROWS)):
            single = built.encode_batch({k: v[row : row + 1] for k, v in batch.items()})
            alone = built.loss(built.trainable, single, SEED, step).item()
            theirs = class_loss(model, encoded, [row], draw_seed(encoded, row, step), step)
            assert alone == pytest.approx(theirs, rel=1e-5, abs=1e-6)
        flows = [
            class_loss(model, encoded, [row], draw_seed(encoded, row, step), step, eos_weight=0.0)
            for row in range(len(ROWS))
        ]
        everything = range(len(ROWS))
        eos = class_loss(model, encoded, everything, 0, step) - class_loss(model, encoded, everything, 0, step, 0.0)
    frames = encoded["labels_mask"].sum(1).tolist()
    assert len(set(frames)) > 1  # clips of different lengths: the weights matter
    expected = sum(f * n for f, n in zip(flows, frames)) / sum(frames) + eos
    assert ours == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_each_frame_is_read_one_position_before_it(folder, built, batch):
    """The flow loss reads frame k from the state of the position before it (the audio BOS for the first): with the
    states one position later (the frame's own, which has seen it), the same draws give another loss, far outside the
    parity tolerance. (The flow head's condition projection is scaled up so that the tiny random model's states weigh
    in the loss; the class gets the same weights.)"""
    import copy

    from transformers.loss.loss_lsd import end_of_speech_loss

    model, _ = whole_pocket_tts(folder)
    module = copy.deepcopy(built.trainable)
    with torch.no_grad():
        module.model.flow_head.cond_proj.weight.mul_(30.0)
    model.load_state_dict({k[len("model.") :]: v for k, v in module.state_dict().items()})
    step = distill_step(True)
    single = built.encode_batch({k: v[:1] for k, v in batch.items()})
    config = model.config
    seed, distill = draw_seed(single, 0, step), sample_seed(SEED, step, 0, DISTILL_PURPOSE)
    with torch.no_grad():
        theirs = class_loss(model, single, [0], seed, step)
        ours = module(
            **{k: single[k] for k in TRAIN_KEYS},
            seeds=torch.tensor([seed]),
            distill_seed=distill,
            anchor=torch.zeros(()),
        ).item()
        outer = module.model
        labels = single["labels"][0]
        normalized = (labels - outer.latent_mean) / outer.latent_std
        hidden = outer.model(
            input_ids=single["input_ids"],
            attention_mask=single["attention_mask"],
            audio_latents=normalized[None],
            audio_prompt_latents=single["audio_prompt_latents"],
            audio_prompt_latents_mask=single["audio_prompt_latents_mask"],
        ).last_hidden_state[0]
        ids = single["input_ids"][0]
        states = hidden[(ids == config.audio_bos_token_id) | (ids == config.audio_latent_token_id)]
        count = len(labels)
        eos_labels = torch.arange(count + 1) == count
        eos = config.eos_loss_weight * end_of_speech_loss(outer.eos_head(states)[:, 0], eos_labels)
        shifted = (module.flow_loss(states[1 : count + 1], normalized, seed, distill) + eos).item()
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert abs(shifted - theirs) > 1e-3 * abs(theirs)  # 100 times the parity tolerance


def test_the_draws_are_each_samples_own(built, batch):
    """A sample's loss does not depend on which others share its micro batch, and moves with the step."""
    encoded = built.encode_batch(batch)
    with torch.no_grad():
        together = built.loss(built.trainable, encoded, SEED, 3).item()
        parts = [built.encode_batch({k: v[r : r + 1] for k, v in batch.items()}) for r in range(len(ROWS))]
        again = built.loss(built.trainable, parts[0], SEED, 3).item()
        later = built.loss(built.trainable, parts[0], SEED, 4).item()
    assert again != pytest.approx(later, rel=1e-6)
    assert together != pytest.approx(again, rel=1e-3)


def test_codec_cache_holds_the_processors_latents(folder, built, batch, records, tmp_path):
    """The cached latents are the processor's labels for the same clip (its training encoding), and a cached batch
    gives the same inputs."""
    from safetensors.torch import load_file

    from dstune.cache.codec_tokens import encode_entries, plan_codec_entries

    chosen = [records[i] for i in ROWS]
    entries = plan_codec_entries(chosen, built)
    assert encode_entries(built, entries, {r.sample_id: r for r in chosen}, tmp_path) == (3, 0)
    cached = [load_file(tmp_path / e.relpath)["codes"] for e in entries]
    assert all(c.dtype == torch.float32 and c.shape[1] == 8 for c in cached)
    _, processor = whole_pocket_tts(folder)
    rendered = chat_prompt(built.processor, "1 2", voiced=False, training=True)
    for clip, wave in zip(cached, batch["audio"]):
        inputs = processor(text=rendered, audio=[wave.numpy()], return_tensors="pt", sampling_rate=24000)
        assert torch.allclose(inputs["labels"][0], clip, atol=1e-6)
    encoded = built.encode_batch(batch)
    from_cache = built.encode_batch({**{k: v for k, v in batch.items() if k != "audio"}, "codes": cached})
    assert all(torch.equal(encoded[k], from_cache[k]) for k in TRAIN_KEYS)


def test_two_speakers_are_conditioned_on_their_own_voices(built, batch, records):
    """Each clip's voice prompt is a reference clip of its own speaker (the speaker column), never of the other: swap
    the column and the voices swap; a speaker's first clip is conditioned on its second, not on itself."""
    speakers = ["ann" if n % 2 else "bob" for n in range(len(records))]
    named = [dataclasses.replace(r, speaker=s) for r, s in zip(records, speakers)]
    built.take_voices(reference_clips(named, built.voice_references, built.sample_rate))
    try:
        references = {name: [sample_id for sample_id, _ in clips] for name, clips in built.references.items()}
        assert references == {
            "bob": [records[0].sample_id, records[2].sample_id],
            "ann": [records[1].sample_id, records[3].sample_id],
        }
        two = {**{k: v[:2] for k, v in batch.items()}, "sample_ids": [records[0].sample_id, records[5].sample_id]}
        voices = built.encode_batch({**two, "speakers": ["bob", "ann"]})
        swapped = built.encode_batch({**two, "speakers": ["ann", "bob"]})
        bob_first = built.voice_latents(built.voice_of("bob", records[0].sample_id))
        ann = built.voice_latents(built.voice_of("ann", records[5].sample_id))
        assert built.voice_of("bob", records[0].sample_id)[0] == records[2].sample_id  # not itself

        def voice(encoded, row):
            return encoded["audio_prompt_latents"][row][encoded["audio_prompt_latents_mask"][row].bool()]

        assert torch.equal(voice(voices, 0), bob_first) and torch.equal(voice(voices, 1), ann)
        assert not torch.equal(voice(voices, 0), voice(voices, 1))
        assert torch.equal(voice(swapped, 1), built.voice_latents(built.voice_of("bob", records[5].sample_id)))
        assert torch.equal(voice(swapped, 0), built.voice_latents(built.voice_of("ann", records[0].sample_id)))
        with torch.no_grad():  # the conditioning reaches the loss
            assert built.loss(built.trainable, voices, SEED, 1) != built.loss(built.trainable, swapped, SEED, 1)
        unknown = built.encode_batch({**two, "speakers": ["cid", "ann"]})  # a held-out speaker: no voice prompt
        assert unknown["audio_prompt_latents_mask"].sum(1).tolist() == [len(ann)]  # the processor's: voiced rows
        voice_id = built.trainable.model.config.audio_prompt_token_id
        assert (unknown["input_ids"] == voice_id).sum(1).tolist() == [0, len(ann)]
    finally:
        built.take_voices(reference_clips(records, built.voice_references, built.sample_rate))


def _generate_wav(folder, path, voice=None):
    """The class's own generate through its processor's chat template, decoded by the processor's audio tokenizer."""
    from transformers import AutoProcessor, PocketTTSForConditionalGeneration

    model, processor = PocketTTSForConditionalGeneration.from_pretrained(folder), AutoProcessor.from_pretrained(folder)
    content = ([{"type": "audio", "audio": voice}] if voice is not None else []) + [{"type": "text", "text": "Hello."}]
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, return_dict=True, return_tensors="pt"
    )
    torch.manual_seed(0)
    latents = model.generate(**inputs, max_new_tokens=4)
    processor.save_audio(processor.decode(latents[0]), str(path))
    return soundfile.read(path)


def test_export_loads_with_its_processor_and_generates_a_wav(folder, built, batch, tmp_path):
    from transformers import PocketTTSForConditionalGeneration

    name = "flow_head.cond_proj.weight"
    state = {k: v.clone() + (0.01 if k == "model." + name else 0.0) for k, v in built.trainable.state_dict().items()}
    out = built.export(state, tmp_path / "export")
    model = PocketTTSForConditionalGeneration.from_pretrained(out)
    assert torch.equal(model.state_dict()[name], state["model." + name])
    wave, rate = _generate_wav(out, tmp_path / "out.wav")
    assert rate == 24000 and 0 < len(wave) <= 4 * 1920 and np.isfinite(wave).all()
    voiced, _ = _generate_wav(out, tmp_path / "voiced.wav", voice=batch["audio"][1].numpy())
    assert not (len(voiced) == len(wave) and np.allclose(voiced, wave))  # the reference voice changed the speech
    from dstune.export import speak

    clip = speak(out, "12 34", tmp_path / "said.wav", seconds=0.4, temperature=0.7, seed=0)  # dstune synthesize
    assert clip.sample_rate == 24000 and len(clip.wave) > 0 and soundfile.read(tmp_path / "said.wav")[1] == 24000


def test_samples_speak_in_the_datas_voice(built):
    clips = built.sample(built.trainable, ["12 34"], type("Sample", (), {"seed": 1, "voice_prompts": []})())
    assert clips[0].sample_rate == 24000 and len(clips[0].wave) > 0 and np.isfinite(clips[0].wave).all()
    assert built.trainable.training  # put back in train mode


def test_lora_export_is_a_peft_adapter_and_a_merged_folder(folder, tmp_path):
    from transformers import PocketTTSForConditionalGeneration

    from dstune.families.lora import apply_train_mode, export_lora

    spec = CodebooksModelSpec(
        family="tts_codebooks", pretrained="builtin:tiny-pocket-tts", train="lora", lora={"rank": 4}
    )
    lora_built = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(lora_built, spec, 0, "peft")
    names = [n for n, p in lora_built.trainable.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and ".layers." in n and "flow_head" not in n for n in names)
    with torch.no_grad():
        for name, param in lora_built.trainable.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    export_lora(lora_built, lora_built.trainable.state_dict(), tmp_path, spec)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = PocketTTSForConditionalGeneration.from_pretrained(tmp_path)
    base = PocketTTSForConditionalGeneration.from_pretrained(folder)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])
    wave, rate = _generate_wav(tmp_path, tmp_path / "merged.wav")
    assert rate == 24000 and len(wave) > 0
