"""VibeVoice (its card and class, dstune.models.vibevoice, on the multi-codebook core) on builtin:tiny-vibevoice
(transformers' VibeVoiceForConditionalGeneration with its acoustic tokenizer and VibeVoiceProcessor): dstune's loss
equals the class's own loss (its LM loss from the labels and its compute_diffusion_loss, weighted by
diffusion_loss_weight) from the processor's audio values, on the same draws; the text labels are the next token and
each latent is diffused from the state before its own placeholder (the one generate conditions on), never from a state
that has seen it; the codec cache holds the class's own latents; "Speaker N:" scripts become the chat template's
turns; full and LoRA exports load with the class and its processor and generate a WAV, also in the voice of a
reference clip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dstune.builtin import ensure_builtin_model
from dstune.data.audio import SpeechDataset, collate_speech, speech_records
from dstune.families import card_of
from dstune.families.randomness import sample_seed
from dstune.spec.speech_models import CodebooksModelSpec
from dstune.models.vibevoice.card import VIBEVOICE_CARD
from dstune.models.vibevoice.model import DIFFUSION_PURPOSE, TRAIN_KEYS, VibeVoice, turns
from dstune.pretrained import build_model
from dstune.spec.models import DataSpec
from loaded_models import CACHE_DIR

soundfile = pytest.importorskip("soundfile")
SEED, STEP = 7, 3


@pytest.fixture(scope="module")
def folder():
    return ensure_builtin_model("builtin:tiny-vibevoice", CACHE_DIR), CACHE_DIR


@pytest.fixture(scope="module")
def built(folder):
    spec = CodebooksModelSpec(family="tts_codebooks", pretrained="builtin:tiny-vibevoice", max_sample_seconds=0.5)
    built = build_model(spec, folder[1], "cpu")
    built.trainable.eval()
    return built


@pytest.fixture(scope="module")
def batch(built):
    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))
    dataset = SpeechDataset(records, built.sample_rate)
    chosen = collate_speech([dataset[i] for i in (0, 5, 9)])  # 2, 4 and 2 latents
    chosen["texts"] = ["Speaker 0: one two.\nSpeaker 1: three.", chosen["texts"][1], chosen["texts"][2]]
    return chosen


def whole_vibevoice(folder):
    from transformers import AutoProcessor, VibeVoiceForConditionalGeneration

    return VibeVoiceForConditionalGeneration.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)


def class_loss(model, processor, encoded, audio, rows, seed, condition=None):
    """The class's own forward on samples `rows`: our ids and labels, the processor's audio values for the clips
    (sample=False: the encoder's mean, as dstune caches it), the diffusion read at `condition` (default: ours),
    from the global RNG seeded with `seed`; condition=False: no diffusion, the LM loss alone."""
    values = processor.feature_extractor(
        [audio[r].numpy() for r in rows], sampling_rate=24000, return_tensors="pt", return_attention_mask=True
    )
    condition = encoded["condition_mask"] if condition is None else condition
    rows = list(rows)
    length = int(encoded["attention_mask"][rows].sum(1).max())
    torch.manual_seed(seed)
    return model(
        input_ids=encoded["input_ids"][rows, :length],
        attention_mask=encoded["attention_mask"][rows, :length],
        labels=encoded["labels"][rows, :length],
        input_values=values["input_values"],
        padding_mask=values["padding_mask"],
        acoustic_loss_mask=None if condition is False else condition[rows, :length],
        sample=False,
        ddpm_batch_multiplier=VIBEVOICE_CARD.noise_draws,
        num_diffusion_steps=1000,
    ).loss


def draw_seed(encoded, row):
    return sample_seed(SEED, STEP, int(encoded["indices"][row]), DIFFUSION_PURPOSE)


def test_the_folder_is_vibevoices(folder, built):
    assert card_of("tts_codebooks", folder[0]) is VIBEVOICE_CARD
    assert type(built) is VibeVoice and built.card is VIBEVOICE_CARD


def test_loss_equals_the_classs_own_lm_and_diffusion_loss_on_the_same_draws(folder, built, batch):
    """One sample: dstune's loss is the class's forward from the processor's audio values with the same seed. A
    batch: the class's LM loss over the batch, and each sample's diffusion loss (the class's, weight 1) averaged
    over the batch's latents, weighted as the class weights them."""
    model, processor = whole_vibevoice(folder[0])
    encoded = built.encode_batch(batch)
    weight = model.config.diffusion_loss_weight
    assert 0 < weight < 1
    with torch.no_grad():
        ours = built.loss(built.trainable, encoded, SEED, STEP).item()
        for row in range(3):
            single = built.encode_batch({k: v[row : row + 1] for k, v in batch.items()})
            alone = built.loss(built.trainable, single, SEED, STEP).item()
            theirs = class_loss(model, processor, encoded, batch["audio"], [row], draw_seed(encoded, row))
            assert alone == pytest.approx(theirs.item(), rel=1e-5)
        lm = class_loss(model, processor, encoded, batch["audio"], range(3), 0, condition=False).item()
        model.config.diffusion_loss_weight = 1.0
        diffusion = [
            class_loss(model, processor, encoded, batch["audio"], [row], draw_seed(encoded, row)).item()
            for row in range(3)
        ]
        model.config.diffusion_loss_weight = weight
    latents = encoded["audio_mask"].sum(1).tolist()
    assert latents == [2, 4, 2]
    expected = (1 - weight) * lm + weight * sum(d * n for d, n in zip(diffusion, latents)) / sum(latents)
    assert ours == pytest.approx(expected, rel=1e-5)


def test_the_draws_are_each_samples_own(built, batch):
    """The loss of a sample does not depend on which others share its micro batch, and moves with the step."""
    encoded = built.encode_batch(batch)
    with torch.no_grad():
        _, _, together = built.trainable(
            **{k: encoded[k] for k in TRAIN_KEYS},
            seeds=torch.tensor([draw_seed(encoded, r) for r in range(3)]),
        )
        first = built.encode_batch({k: v[:1] for k, v in batch.items()})
        _, _, alone = built.trainable(**{k: first[k] for k in TRAIN_KEYS}, seeds=torch.tensor([draw_seed(encoded, 0)]))
        again = built.loss(built.trainable, first, SEED, STEP)
        later = built.loss(built.trainable, first, SEED, STEP + 1)
    assert together.item() != pytest.approx(alone.item(), rel=1e-3)  # 3 samples' average, not the first's
    assert again.item() != pytest.approx(later.item(), rel=1e-6)


def test_text_labels_are_the_next_token(built, batch):
    """The class shifts the labels: its LM loss is the cross-entropy of logits[t] against ids[t + 1] over the
    labelled positions, not against ids[t] or ids[t + 2] (labels shifted one too few or too many)."""
    encoded = built.encode_batch(batch)
    model = built.trainable.model
    with torch.no_grad():
        out = model(**{k: encoded[k] for k in ("input_ids", "attention_mask", "labels")})
    logits, labels = out.logits.float(), encoded["labels"]

    def with_shift(shift):
        rows, positions = (labels[:, shift:] != -100).nonzero(as_tuple=True)
        targets = labels[rows, positions + shift] if shift else labels[rows, positions]
        return torch.nn.functional.cross_entropy(logits[rows, positions], targets).item()

    assert out.loss.item() == pytest.approx(with_shift(1), rel=1e-5)
    for wrong in (0, 2):
        assert abs(out.loss.item() - with_shift(wrong)) > 1e-3
    audio = encoded["audio_mask"][0].nonzero()[:, 0]
    assert (labels[0, audio] == model.config.audio_token_id).all()  # "continue the speech", as generate reads it
    assert labels[0, audio[0] - 1] == model.config.audio_bos_token_id
    assert labels[0, audio[-1] + 1] == model.config.audio_eos_token_id
    assert (labels[encoded["attention_mask"] == 0] == -100).all() and (encoded["attention_mask"] == 0).any()


def test_each_latent_is_diffused_from_the_state_before_it(built, batch):
    """The condition of latent i is the LM state one position before its placeholder: the audio BOS for the first,
    which is where generate reads it (the prompt ends with the BOS). That state has not seen latent i (its gradient
    is zero), while the processor's mask (the placeholders themselves) reads a state that has seen it; a condition
    two positions back changes the loss too."""
    encoded = built.encode_batch(batch)
    model = built.trainable.model
    audio, condition = encoded["audio_mask"], encoded["condition_mask"]
    first = int(audio[0].nonzero()[0])
    assert (
        condition[0].nonzero()[0] == first - 1 and encoded["input_ids"][0, first - 1] == model.config.audio_bos_token_id
    )
    prompt = built.prompt_ids(batch["texts"][0])
    assert prompt[-1] == model.config.audio_bos_token_id and len(prompt) == first

    def hidden_gradient(mask):
        latents = encoded["latents"].clone().requires_grad_(True)
        inner = model.model
        features = (latents + inner.latent_bias_factor) * inner.latent_scaling_factor
        embeds = model.get_input_embeddings()(encoded["input_ids"]).masked_scatter(
            audio.unsqueeze(-1).expand(-1, -1, 32), inner.multi_modal_projector(features)
        )
        hidden = model(inputs_embeds=embeds, attention_mask=encoded["attention_mask"]).last_hidden_state
        hidden[0][mask[0]][0].sum().backward()  # the first latent's condition
        return latents.grad[0].abs().sum().item()

    assert hidden_gradient(condition) == 0.0
    assert hidden_gradient(audio) > 0.0  # the processor's acoustic_loss_mask: the state has seen the latent
    seeds = torch.tensor([draw_seed(encoded, r) for r in range(3)])
    keys = {k: encoded[k] for k in TRAIN_KEYS if k != "condition_mask"}
    two_back = torch.zeros_like(condition)
    two_back[:, :-2] = audio[:, 2:]
    with torch.no_grad():
        losses = [
            built.trainable(**keys, condition_mask=m, seeds=seeds)[2].item() for m in (condition, audio, two_back)
        ]
    # the random tiny head leans little on its condition, but beyond float rounding (about 1e-7 here)
    assert abs(losses[0] - losses[1]) > 1e-6 and abs(losses[0] - losses[2]) > 1e-6


def test_speaker_scripts_become_the_templates_turns(built):
    default = VIBEVOICE_CARD.default_speaker
    assert turns("Speaker 1: Hi.\nSpeaker 2: Hello there.", "", default) == [("1", "Hi."), ("2", "Hello there.")]
    assert turns("plain  words", "3", default) == [("3", "plain words")]
    assert turns("plain", "", default) == [("0", "plain")]  # a clip without a speaker: the default speaker
    text = built.processor.tokenizer.decode(built.prompt_ids("Speaker 1: Hi.\nSpeaker 2: Yo."))
    assert " Text input:\n Speaker 1: Hi.\n Speaker 2: Yo.\n Speech output:\n<|vision_start|>" in text


def test_codec_cache_holds_the_classs_own_latents(folder, built, batch, tmp_path):
    from safetensors.torch import load_file

    from dstune.cache.codec_tokens import encode_entries, plan_codec_entries

    records, _ = speech_records(DataSpec(path="builtin:tones", max_clip_seconds=0.6))
    chosen = [records[i] for i in (0, 5, 9)]
    entries = plan_codec_entries(chosen, built)
    assert encode_entries(built, entries, {r.sample_id: r for r in chosen}, tmp_path) == (3, 0)
    cached = [load_file(tmp_path / e.relpath)["codes"] for e in entries]
    assert all(c.dtype == torch.float32 and c.shape[1] == 8 for c in cached)
    model, processor = whole_vibevoice(folder[0])
    values = processor.feature_extractor(
        [w.numpy() for w in batch["audio"]], sampling_rate=24000, return_tensors="pt", return_attention_mask=True
    )
    with torch.no_grad():
        theirs = model.model.get_audio_features(values["input_values"], values["padding_mask"], sample=False)
    assert torch.allclose(torch.cat(cached), theirs.last_hidden_state, atol=1e-5)
    from_cache = built.encode_batch({**batch, "codes": cached})
    assert torch.equal(from_cache["latents"], torch.cat(cached))


def _generate_wav(folder, path, voice=None):
    """The class's own generate through its processor's chat template (at most 4 new tokens: up to 4 latents of
    3200 samples each)."""
    model, processor = whole_vibevoice(folder)
    content = [{"type": "text", "text": "Hello."}] + ([{"type": "audio", "audio": voice}] if voice is not None else [])
    inputs = processor.apply_chat_template(
        [{"role": "0", "content": content}], tokenize=True, return_dict=True, return_tensors="pt"
    )
    torch.manual_seed(0)
    audio = model.generate(**inputs, max_new_tokens=4)
    processor.save_audio(audio, str(path))
    return soundfile.read(path)


def test_export_loads_with_its_processor_and_generates_a_wav(folder, built, batch, tmp_path):
    from transformers import VibeVoiceForConditionalGeneration

    state = {
        k: v.clone() + (0.01 if k.endswith("diffusion_head.cond_proj.weight") else 0.0)
        for k, v in built.trainable.state_dict().items()
    }
    out = built.export(state, tmp_path / "export")
    model = VibeVoiceForConditionalGeneration.from_pretrained(out)
    name = "model.diffusion_head.cond_proj.weight"
    assert torch.equal(model.state_dict()[name], state["model." + name])
    wave, rate = _generate_wav(out, tmp_path / "out.wav")
    assert rate == 24000 and len(wave) in (3200, 6400, 9600, 12800) and np.isfinite(wave).all()
    voiced, _ = _generate_wav(out, tmp_path / "voiced.wav", voice=batch["audio"][1].numpy())
    assert len(voiced) == len(wave) and not np.allclose(voiced, wave)  # the reference voice changed the speech
    from dstune.export import speak

    clip = speak(out, "Speaker 0: 12", tmp_path / "said.wav", seconds=0.4, temperature=0.0, seed=0)  # synthesize
    assert clip.sample_rate == 24000 and len(clip.wave) > 0 and soundfile.read(tmp_path / "said.wav")[1] == 24000


def test_lora_export_is_a_peft_adapter_and_a_merged_folder(folder, tmp_path):
    from transformers import VibeVoiceForConditionalGeneration

    from dstune.families.lora import apply_train_mode, export_lora

    spec = CodebooksModelSpec(
        family="tts_codebooks", pretrained="builtin:tiny-vibevoice", train="lora", lora={"rank": 4}
    )
    lora_built = build_model(spec, folder[1], "cpu")
    apply_train_mode(lora_built, spec, 0, "peft")
    names = [n for n, p in lora_built.trainable.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and "language_model" in n for n in names)
    with torch.no_grad():
        for name, param in lora_built.trainable.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    export_lora(lora_built, lora_built.trainable.state_dict(), tmp_path, spec)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = VibeVoiceForConditionalGeneration.from_pretrained(tmp_path)
    base = VibeVoiceForConditionalGeneration.from_pretrained(folder[0])
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])
    wave, rate = _generate_wav(tmp_path, tmp_path / "merged.wav")
    assert rate == 24000 and len(wave) > 0


def test_with_the_processors_labels_the_lm_learns_to_stop_speaking(folder, built, batch):
    """Why the placeholders stay targets: generate continues the speech while the LM's choice after the speech BOS
    is the placeholder. Four AdamW steps of the class's LM loss with the processor's labels (placeholders masked)
    make <audio EOS> the choice there; with dstune's labels the placeholder stays it."""
    from transformers import VibeVoiceForConditionalGeneration

    encoded = built.encode_batch(batch)
    audio = encoded["audio_mask"]
    first = int(audio[0].nonzero()[0])  # the BOS before it conditions the first latent and predicts "continue"
    choices = {}
    for name, labels in (("ours", encoded["labels"]), ("processor's", encoded["labels"].masked_fill(audio, -100))):
        model = VibeVoiceForConditionalGeneration.from_pretrained(folder[0]).train()
        optimizer = torch.optim.AdamW(model.model.language_model.parameters(), lr=1e-2)
        for _ in range(4):
            optimizer.zero_grad()
            model(
                input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], labels=labels
            ).loss.backward()
            optimizer.step()
        with torch.no_grad():
            logits = model.eval()(input_ids=encoded["input_ids"][:1, :first]).logits[0, -1]
        allowed = [model.config.audio_token_id, model.config.audio_eos_token_id]
        choices[name] = allowed[int(logits[allowed].argmax())]
    assert choices["ours"] == model.config.audio_token_id
    assert choices["processor's"] == model.config.audio_eos_token_id


def test_a_folder_in_the_original_layout_is_refused_by_validate_and_start_up(tmp_path, capsys):
    """microsoft/VibeVoice-1.5B's own config.json (decoder_config, acoustic_tokenizer_config) names the class, which
    would load it as a default-sized model without its weights: validate and the build both refuse it."""
    import json

    import yaml

    from dstune.cli import main
    from dstune.families.base import FamilyError

    folder = tmp_path / "VibeVoice-1.5B"
    folder.mkdir()
    original = {"architectures": ["VibeVoiceForConditionalGeneration"], "model_type": "vibevoice"}
    original.update(decoder_config={"model_type": "qwen2", "hidden_size": 1536}, acoustic_vae_dim=64)
    (folder / "config.json").write_text(json.dumps(original))
    spec = {"model": {"family": "tts_codebooks", "pretrained": str(folder)}, "data": {"path": "builtin:tones"}}
    spec["train"] = {"micro_batch_size": 2, "max_steps": 10}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["validate", str(tmp_path / "spec.yaml"), "--num-gpus", "2"]) == 1
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "model.pretrained" in text and "original VibeVoice layout" in text
    with pytest.raises(FamilyError, match="original VibeVoice layout"):
        build_model(CodebooksModelSpec(family="tts_codebooks", pretrained=str(folder)), tmp_path / "cache", "cpu")


def test_two_speakers_take_the_templates_speaker_numbers(folder, built, tmp_path, capsys):
    """A two-speaker .list of names (bob listed first): the sorted names take VibeVoice's speaker numbers (ann 0,
    bob 1), where before every named speaker became speaker 0; each clip's ids start with what the processor's chat
    template makes of a turn of that speaker; validate prints the map."""
    from speaker_data import speaker_batch, two_speaker_list, validate_output

    root = two_speaker_list(tmp_path / "data", rate=24000)
    batch = speaker_batch(built, root)
    try:
        assert built.voices.given == {"ann": "0", "bob": "1"}
        encoded = built.encode_batch(batch)
    finally:
        built.voices = None
    processor, ids = built.processor, encoded["input_ids"]
    for row, (number, text) in enumerate(zip("10", batch["texts"])):
        turn = [{"role": number, "content": [{"type": "text", "text": text}]}]
        rendered = processor.apply_chat_template(turn, tokenize=False)
        reference = processor.tokenizer(rendered, add_special_tokens=False).input_ids
        assert ids[row, : len(reference)].tolist() == reference
        assert f" Speaker {number}: {text}" in rendered
    code, out = validate_output(capsys, tmp_path, {"family": "tts_codebooks", "pretrained": "builtin:tiny-vibevoice"},
                                {"path": str(root)})  # fmt: skip
    assert code == 0 and "speakers 2 (names sorted): ann -> 0, bob -> 1" in out and '"Speaker N: text"' in out
