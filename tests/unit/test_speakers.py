"""The speaker map every speech model shares (dstune.families.speakers): the sorted names take the model's ids in
order, clips without a speaker beside named ones are one more speaker sorted first, dialogue transcripts are left out,
the map survives speakers.json, and a resume whose data would move a trained speaker to another id is refused."""

from __future__ import annotations

from dstune.families.speakers import Voices, read_voices, resumed_map_problem, voices_for, write_voices
from dstune.models.csm.card import CSM_CARD
from dstune.models.dia.card import DIA_CARD
from dstune.spec.speech_models import CodebooksModelSpec

MODEL = CodebooksModelSpec(family="tts_codebooks")


def csm(speakers, mode="separate"):
    return voices_for(CSM_CARD, MODEL, mode, speakers, ["12"] * len(speakers))


def test_sorted_names_take_the_ids_in_order_whatever_the_files_order():
    assert csm(["bob", "ann", "bob", "cy"]).given == {"ann": "0", "bob": "1", "cy": "2"}
    assert csm(["cy", "ann", "bob"]).given == csm(["ann", "bob", "cy"]).given
    assert csm(["", "bob", "ann"]).given == {"": "0", "ann": "1", "bob": "2"}  # "(none)" first
    assert csm(["", ""]) is None  # no speakers: the model's default voice, no map
    blended = csm(["bob", "ann"], "blend")
    assert blended.blended == ("ann", "bob") and blended.of("bob") == "" and blended.of("ann") == ""


def test_dialogue_transcripts_keep_their_turns_and_are_not_counted():
    voices = voices_for(
        DIA_CARD, MODEL, "separate", ["d1", "d2", "d3", "ann"], ["[S1] a [S2] b", "[S2] c", "[S1] d", "e"]
    )
    assert voices.given == {"ann": "[S1]"}


def test_the_map_survives_speakers_json(tmp_path):
    voices = csm(["bob", "ann", ""])
    write_voices(voices, tmp_path)
    assert read_voices(tmp_path) == voices
    write_voices(None, tmp_path / "none")  # trained without speakers: no file
    assert read_voices(tmp_path / "none") is None


def test_a_resume_that_would_move_a_trained_speaker_is_refused():
    trained = csm(["bob", "ann"]).as_json()  # ann 0, bob 1
    assert resumed_map_problem(trained, csm(["bob", "ann", "cy"]), "checkpoint x") is None  # cy joins as 2
    moved = resumed_map_problem(trained, csm(["bob", "ann", "aaron"]), "checkpoint x")  # aaron sorts first
    assert moved.startswith("checkpoint x was trained with another speaker map") and "ann '0' -> '1'" in moved
    assert "Resume with the speakers and data.speakers it trained with" in moved
    assert resumed_map_problem(trained, csm(["ann"]), "checkpoint x") is None  # bob left out, ann keeps 0
    assert "ann '0' -> '1'" in resumed_map_problem(trained, csm(["ann", ""]), "checkpoint x")  # "(none)" sorts first
    assert "takes '0', ann's" in resumed_map_problem(csm(["ann"]).as_json(), csm(["", "ann"]), "c")
    assert "between separate and blend" in resumed_map_problem(trained, csm(["bob", "ann"], "blend"), "c")
    assert (
        resumed_map_problem(None, None, "c") is None and resumed_map_problem(trained, csm(["ann", "bob"]), "c") is None
    )
    assert isinstance(Voices.from_json(trained), Voices)
