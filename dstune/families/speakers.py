"""How a speech model hears a dataset's speakers (torch-free): `Voices`, each speaker name of the data mapped to what
the model is given for it (a speaker id, a dialogue tag, a "Speaker N" script line, a speaker vector, a name in the
prompt: each model's card says which), and why a dataset is refused where the model cannot tell its speakers apart.

One rule for every model that numbers its speakers: the data's speaker names, sorted (Python's string order), take
0, 1, 2 ... in that order; clips that name no speaker beside clips that do are one more speaker, "(none)", sorted
first. Each card's `voices` makes the map (validate prints it, start-up gives it to the class, the checkpoint and the
export keep it: `speakers.json` beside an exported model, which `dstune synthesize --speaker NAME` reads).
`data.speakers: blend` leaves the speaker column out: every clip is the model's default voice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

SPEAKERS_FILE = "speakers.json"  # beside an exported speech model
NO_SPEAKER = ""  # the speaker of a clip whose data names none
NO_SPEAKER_LABEL = "(none)"
BLEND = "blend"  # data.speakers: every clip trains the model's default voice
_SHOWN = 8  # speakers named in a refusal


class UnknownSpeaker(LookupError):
    """`dstune synthesize --speaker NAME` names no speaker the export knows."""


class SpeakersRefused(ValueError):
    """The dataset's speakers cannot train this model as they are: `key` is the spec key to report at."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key, self.message = key, message


@dataclass(frozen=True)
class Voices:
    """What `model` is given for each speaker of the data (`given`: name -> the model's form, e.g. "0", "[S2]"; ""
    is the model's default voice), `how` in words; `blended`: data.speakers: blend, these speakers all trained as
    the default voice."""

    model: str
    how: str
    given: dict[str, str] = field(default_factory=dict)
    blended: tuple[str, ...] = ()

    def of(self, speaker: str) -> str:
        """The model's form of one clip's speaker ("": its default voice, as for a clip of a dataset without
        speakers)."""
        if self.blended or (speaker == NO_SPEAKER and NO_SPEAKER not in self.given):
            return ""
        return self.given[speaker]

    def rows(self) -> list[tuple[str, str]]:
        """The validate report's rows."""
        if self.blended:
            text = f"{len(self.blended)} ({shown(self.blended)}), blended into {self.model}'s default voice"
            return [("speakers", f"{text} (data.speakers: blend)")]
        pairs = ", ".join(f"{label(name)} -> {form or 'its default voice'}" for name, form in self.given.items())
        return [
            ("speakers", f"{len(self.given)} (names sorted): {pairs}"),
            ("speaker input", f"{self.model}: {self.how}"),
        ]

    def as_json(self) -> dict:
        return {"model": self.model, "how": self.how, "speakers": dict(self.given), "blended": list(self.blended)}

    @classmethod
    def from_json(cls, saved: dict) -> "Voices":
        return cls(saved["model"], saved["how"], dict(saved["speakers"]), tuple(saved.get("blended") or ()))


def heard_speakers(card, speakers: Sequence[str], texts: Sequence[str]) -> list[Optional[str]]:
    """Each clip's speaker where the model is given it (None where its transcript names its own turns: a
    dialogue's clip is no speaker's, and no speaker-less one either)."""
    return [speaker if card.takes_speaker(text) else None for speaker, text in zip(speakers, texts)]


def voices_for(card, model_spec, mode: str, speakers: Sequence[str], texts: Sequence[str]) -> Optional[Voices]:
    """How the model of `card` hears the clips' `speakers` (one name per clip, "" = none; `texts` their
    transcripts: a dialogue's that names its own turns is left out) under data.speakers `mode`: None where no clip
    names a speaker; SpeakersRefused where the model cannot tell the speakers apart."""
    names = data_speakers([s for s in heard_speakers(card, speakers, texts) if s is not None])
    if not names:
        return None
    if mode == BLEND:
        return Voices(card.name, "every clip its default voice", {}, tuple(names))
    return card.voices(model_spec, names)


def resumed_map_problem(saved: Optional[dict], voices: Optional[Voices], checkpoint: str) -> Optional[str]:
    """Why a run cannot resume from a checkpoint whose speaker map (its saved `speakers`, None: trained without
    speakers) `voices` would change, or None: every speaker it trained that the data still names keeps what the
    model is given for it (new speakers may join with forms of their own, trained ones may be left out)."""
    old = Voices.from_json(saved) if saved else None
    old_given = old.given if old is not None and not old.blended else {}
    new_given = voices.given if voices is not None and not voices.blended else {}
    moved = [
        f"{label(n)} {old_given[n]!r} -> {new_given[n]!r}"
        for n in old_given
        if n in new_given and new_given[n] != old_given[n]
    ]
    taken = {form: name for name, form in old_given.items()}
    reused = [
        f"{label(n)} takes {form!r}, {label(taken[form])}'s"
        for n, form in new_given.items()
        if n not in old_given and form in taken
    ]
    blend_changed = bool(old is not None and old.blended) != bool(voices is not None and voices.blended)
    if not (moved or reused or blend_changed):
        return None
    what = "; ".join((["data.speakers changed between separate and blend"] if blend_changed else []) + moved + reused)
    return (
        f"{checkpoint} was trained with another speaker map than the data now gives ({what}): the model would hear "
        "its speakers as others. Resume with the speakers and data.speakers it trained with, or start a new run "
        "(another output.dir) from its export."
    )


def one_voice(model: str, names: Sequence[str], why: str, fix: str) -> Voices:
    """A model with one voice: a dataset of one named speaker trains it (its clips without a speaker too); several
    named ones are refused (`why` it has one voice, `fix`: how to train them apart)."""
    named = [name for name in names if name != NO_SPEAKER]
    if len(named) > 1:
        raise refusal(model, named, why, fix)
    return Voices(model, f"one voice ({why})", {name: "" for name in names})


def label(name: str) -> str:
    return name if name != NO_SPEAKER else NO_SPEAKER_LABEL


def shown(names: Sequence[str]) -> str:
    text = ", ".join(label(n) for n in names[:_SHOWN])
    return text + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def data_speakers(speakers: Sequence[str]) -> list[str]:
    """The data's speakers in their order (module docstring): the names sorted, "" first where some clips name no
    speaker beside clips that do; [] where no clip names one."""
    names = sorted(set(speakers))
    return names if any(names) else []


def refusal(model: str, names: Sequence[str], why: str, fix: str) -> SpeakersRefused:
    """Several speakers for a model that cannot tell them apart: which speakers, why, and how to go on."""
    return SpeakersRefused(
        "data.path",
        f"the data names {len(names)} speakers ({shown(names)}), but {why}, so every clip would train the same voice, "
        f"a blend of them all. {fix}Or set data.speakers: blend to train them as that one voice (docs/tts.md, "
        "Speakers).",
    )


def speaker_names(given: Optional[dict]) -> str:
    return ", ".join(label(n) for n in (given or {})) or "none"


def write_voices(voices: Optional[Voices], folder: Path) -> None:
    """speakers.json in an export folder (nothing for a model trained without speakers)."""
    if voices is not None:
        (Path(folder) / SPEAKERS_FILE).write_text(json.dumps(voices.as_json(), indent=2) + "\n")


def read_voices(folder: Path) -> Optional[Voices]:
    """The speakers.json of an export folder, None where there is none."""
    path = Path(folder) / SPEAKERS_FILE
    if not path.is_file():
        return None
    try:
        return Voices.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a speakers file dstune wrote ({err})") from None


def synthesis_speaker(folder: Path, name: Optional[str]) -> Optional[str]:
    """`dstune synthesize --speaker NAME`: the model's form of NAME from the export's speakers.json (None without
    --speaker: the model's default voice); UnknownSpeaker naming the known speakers for an unknown one."""
    voices = read_voices(folder)
    if name is None:
        return None
    if voices is None or voices.blended or name not in voices.given or name == NO_SPEAKER:
        known = "" if voices is None or voices.blended else speaker_names(voices.given)
        why = (
            f"it has no {SPEAKERS_FILE} (trained without speakers)"
            if voices is None
            else "its speakers were blended into one voice (data.speakers: blend)"
            if voices.blended
            else f"its speakers are {known}"
        )
        raise UnknownSpeaker(f"--speaker {name}: {folder} does not know this speaker: {why}")
    return voices.given[name]
