"""A tiny two-speaker speech dataset (a GPT-SoVITS .list of tone clips) and the batch a model is given for it, for the
speaker tests of every speech model."""

from __future__ import annotations

from pathlib import Path

from dstune.data.audio import SpeechDataset, collate_speech, speech_records
from dstune.data.synthetic import render_tones
from dstune.families.speakers import voices_for
from dstune.spec.models import DataSpec

CLIPS = (("bob", "34"), ("ann", "12"))  # listed bob first: the map numbers the sorted names, not the file's order


def two_speaker_list(root: Path, clips=CLIPS, rate: int = 16000) -> Path:
    """root/metadata.list over root/clips/N.wav (the tones of each text's digits); returns root."""
    import soundfile

    (root / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for number, (speaker, text) in enumerate(clips):
        soundfile.write(
            str(root / "clips" / f"{number}.wav"), render_tones("".join(filter(str.isdigit, text)), rate), rate
        )
        rows.append(f"clips/{number}.wav|{speaker}|en|{text}")
    (root / "metadata.list").write_text("\n".join(rows) + "\n")
    return root


def speaker_batch(model, root: Path, mode: str = "separate") -> dict:
    """Every clip of the dataset at `root` as one batch, `model.voices` set as start-up sets it (the run's map)."""
    records, _ = speech_records(DataSpec(path=str(root)))
    model.voices = voices_for(
        model.card, model.model_spec, mode, [r.speaker for r in records], [r.caption for r in records]
    )
    dataset = SpeechDataset(records, model.sample_rate)
    return collate_speech([dataset[i] for i in range(len(records))])


def validate_output(capsys, tmp_path: Path, model: dict, data: dict) -> tuple[int, str]:
    """`dstune validate` of a spec with this model and data sections: (exit code, what it printed)."""
    import yaml

    from dstune.cli import main

    spec = {"model": model, "data": data, "train": {"micro_batch_size": 1, "max_steps": 2}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    code = main(["validate", str(path), "--num-gpus", "1"])
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())  # one line: the table's folding aside
