"""Described token layouts without torch: the presets' ids, the template, and the offline checks that name what is
wrong (vocabulary size, token ranges, codec frame rate vs sample rate, frame order)."""

from __future__ import annotations

import pytest

from dstune.models.tts_lm.token_layouts import (
    describe,
    dstune_layout,
    layout_problems,
    orpheus_layout,
    prompt_ids,
    training_ids,
)


def test_orpheus_preset_ids_are_orpheus_ids():
    layout = orpheus_layout()
    special = layout["special_tokens"]
    assert (
        special["start_of_speech"],
        special["end_of_speech"],
        special["start_of_human"],
        special["end_of_human"],
        special["start_of_ai"],
        special["end_of_ai"],
        special["pad_token"],
    ) == tuple(range(128257, 128264))
    assert layout["audio_offset"] == 128266 and layout["vocab_size"] == 128266 + 7 * 4096
    assert layout["frame_rate"] == 24000 / 2048 and layout["codes_per_frame"] == [1, 2, 4]
    assert prompt_ids(layout, [128000, 5, 6]) == [128259, 128000, 5, 6, 128009, 128260, 128261, 128257]
    assert layout_problems(layout) == []


def test_orpheus_labels_every_token_and_dstune_only_the_audio():
    ids, labels = training_ids(orpheus_layout(), [1, 2], [128266, 128266 + 4096])
    assert ids == [128259, 1, 2, 128009, 128260, 128261, 128257, 128266, 132362, 128258, 128262] and labels == ids
    layout = dstune_layout("bytes", 256, 2, 32, "encodec", 8000, 50.0)
    ids, labels = training_ids(layout, [7], [256, 288])
    assert ids == [7, 320, 256, 288, 321] and labels == [-100, -100, 256, 288, 321]


def test_a_layout_written_before_descriptions_reads_as_dstune():
    legacy = {
        "text": "bytes",
        "text_vocab_size": 256,
        "audio_offset": 256,
        "num_codebooks": 2,
        "codebook_size": 32,
        "audio_bos": 320,
        "audio_eos": 321,
        "pad": 322,
        "vocab_size": 323,
        "codec": "encodec",
        "sampling_rate": 8000,
        "frame_rate": 50.0,
    }
    layout = describe(legacy)
    assert layout["name"] == "dstune" and layout["frame_order"] == [[0, 0], [1, 0]] and layout_problems(layout) == []
    assert layout == dstune_layout("bytes", 256, 2, 32, "encodec", 8000, 50.0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vocab_size": 150000}, "audio ids 128266..156937 go past vocab_size 150000"),
        ({"frame_rate": 12.0}, "frame_rate 12.0 != sampling_rate 24000 / samples_per_frame 2048"),
        ({"frame_order": [[0, 0], [1, 0], [2, 0], [2, 1], [1, 1], [2, 2], [2, 2]]}, "does not write each of the"),
        ({"after_text": ["end_of_text", "start_of_robot"]}, "after_text: 'start_of_robot' is not in special_tokens"),
        ({"loss_on": "text"}, "loss_on: 'text' is neither"),
    ],
)
def test_layout_problems_name_what_is_wrong(change, message):
    assert any(message in problem for problem in layout_problems({**orpheus_layout(), **change}))


def test_special_tokens_outside_the_vocabulary_or_among_audio_ids_are_refused():
    layout = orpheus_layout()
    bad = {**layout, "special_tokens": {**layout["special_tokens"], "end_of_ai": 130000, "pad_token": 200000}}
    problems = layout_problems(bad, vocab_size=128256)
    assert "special token end_of_ai = 130000 falls among the audio ids 128266..156937" in problems
    assert "special token pad_token = 200000 is outside 0..156937" in problems
    assert "the LM has 128256 ids, fewer than the layout's vocab_size 156938" in problems


def test_validate_checks_a_model_folders_layout_offline(tmp_path):
    """`dstune validate` reads dstune_tts.json and config.json of a local tts_lm folder (no torch, no model load)."""
    import json

    from dstune.spec.load import SpecError
    from dstune.validate import load_and_validate
    from dstune.world import world_from_flags

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 128256}))
    (folder / "dstune_tts.json").write_text(json.dumps({**orpheus_layout(), "frame_rate": 12.5}))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model: {{family: tts_lm, pretrained: '{folder}', codec: snac, token_layout: orpheus}}\n"
        "data: {path: 'builtin:tones', max_clip_seconds: 0.6}\n"
        "train: {global_batch_size: 8, micro_batch_size: 4, max_steps: 3}\n"
    )
    with pytest.raises(SpecError) as caught:
        load_and_validate(str(spec), world=world_from_flags(world_size=2), cross_check=False)
    message = str(caught.value)
    assert "spec.yaml:1: model.token_layout: the token layout of" in message
    assert "the LM has 128256 ids, fewer than the layout's vocab_size 156938" in message
    assert "frame_rate 12.5 != sampling_rate 24000 / samples_per_frame 2048 = 11.71875" in message
