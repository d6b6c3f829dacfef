"""dstune.data.index: kohya folders, metadata.jsonl, built-ins, and the errors users see. Real files in tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from dstune.data.index import DataError, count_samples, index_dataset, list_samples
from dstune.data.synthetic import SHAPES_NUM_SAMPLES
from dstune.spec.models import DataSpec


def write_image(path, size=(8, 8), colour=(200, 10, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def write_text(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


@pytest.fixture
def kohya(tmp_path):
    root = tmp_path / "kohya"
    write_image(root / "a.png")
    write_text(root / "a.txt", "  root image \n")
    write_image(root / "5_dog" / "d1.jpg")
    write_text(root / "5_dog" / "d1.txt", "a dog\nsitting")
    write_image(root / "5_dog" / "d2.png")  # no caption file
    write_image(root / "5_dog" / "2_close" / "c.webp")  # nearest N_ folder wins
    write_text(root / "5_dog" / "2_close" / "c.txt", "close up")
    write_image(root / "plain" / "sub" / "x.bmp")
    write_text(root / "plain" / "sub" / "x.txt", "x")
    write_image(root / "3_cat" / "inner" / "y.jpeg")
    write_text(root / "3_cat" / "inner" / "y.txt", "a cat")
    write_image(root / ".hidden" / "z.png")
    write_image(root / ".ipynb_checkpoints.png")
    write_text(root / "notes.txt", "not a caption of anything")
    (root / "readme.md").write_text("no image")
    return root


def test_kohya_folder_lists_repeats_captions_in_sorted_order(kohya):
    result = index_dataset(DataSpec(path=str(kohya)))
    got = [(r.sample_id, r.caption, r.repeats) for r in result.records]
    assert got == [
        ("3_cat/inner/y.jpeg", "a cat", 3),
        ("5_dog/2_close/c.webp", "close up", 2),
        ("5_dog/d1.jpg", "a dog sitting", 5),
        ("5_dog/d2.png", "", 5),
        ("a.png", "root image", 1),
        ("plain/sub/x.bmp", "x", 1),
    ]
    assert all(r.image_path.startswith(str(kohya)) for r in result.records)
    assert result.num_samples == 3 + 2 + 5 + 5 + 1 + 1
    assert count_samples(DataSpec(path=str(kohya))) == result.num_samples
    assert len(result.warnings) == 1 and "1 of 6 images have no .txt caption" in result.warnings[0]
    assert "5_dog/d2.png" in result.warnings[0]
    assert list_samples(DataSpec(path=str(kohya))) == result.records


def test_counting_reads_no_caption(kohya):
    (kohya / "a.txt").write_bytes(b"\xff\xfe bad utf-8 \xff")
    assert count_samples(DataSpec(path=str(kohya))) == 17
    with pytest.raises(DataError) as err:
        list_samples(DataSpec(path=str(kohya)))
    assert err.value.key == "data.path" and "a.txt" in err.value.message and "UTF-8" in err.value.message


@pytest.mark.parametrize("extension", [".caption", "caption"])
def test_caption_extension_with_or_without_dot(tmp_path, extension):
    write_image(tmp_path / "img.png")
    write_text(tmp_path / "img.caption", "from .caption")
    write_text(tmp_path / "img.txt", "from .txt")
    [record] = list_samples(DataSpec(path=str(tmp_path), caption_extension=extension))
    assert record.caption == "from .caption"


def test_captions_under_another_extension_are_pointed_at(tmp_path):
    """Images without .txt captions but with .caption files beside them: the warning says which key to set."""
    for i in range(3):
        write_image(tmp_path / f"img{i}.png")
        write_text(tmp_path / f"img{i}.caption", f"caption {i}")
    result = index_dataset(DataSpec(path=str(tmp_path)))
    assert len(result.warnings) == 1
    assert result.warnings[0].endswith(
        "3 of them have a .caption file beside them: if those are the captions, set data.caption_extension: .caption"
    )
    assert index_dataset(DataSpec(path=str(tmp_path), caption_extension=".caption")).warnings == []


def test_an_image_model_on_a_folder_of_clips_says_what_it_found_and_what_trains_clips(tmp_path):
    for i in range(3):
        (tmp_path / f"clip{i}.mp4").write_bytes(b"")
        write_text(tmp_path / f"clip{i}.txt", "a clip")
    with pytest.raises(DataError) as err:
        count_samples(DataSpec(path=str(tmp_path)))
    assert "found 6 files: 3 .mp4, 3 .txt" in err.value.message
    assert "This model trains on images; the video models (model.family video" in err.value.message


def test_zero_repeat_folder_is_an_error(tmp_path):
    write_image(tmp_path / "0_dog" / "d.png")
    with pytest.raises(DataError) as err:
        list_samples(DataSpec(path=str(tmp_path)))
    assert err.value.key == "data.path" and "0_dog" in err.value.message and "1_dog" in err.value.message


def test_missing_path_file_path_and_empty_folder(tmp_path):
    with pytest.raises(DataError) as err:
        count_samples(DataSpec(path=str(tmp_path / "nope")))
    assert err.value.key == "data.path" and "does not exist" in err.value.message
    write_text(tmp_path / "file.txt", "x")
    with pytest.raises(DataError) as err:
        count_samples(DataSpec(path=str(tmp_path / "file.txt")))
    assert "is a file, not a folder" in err.value.message
    (tmp_path / "empty").mkdir()
    write_text(tmp_path / "empty" / "caption.txt", "no image")
    with pytest.raises(DataError) as err:
        count_samples(DataSpec(path=str(tmp_path / "empty")))
    assert err.value.key == "data.path" and "no usable samples" in err.value.message and ".png" in err.value.message
    assert str(err.value).startswith("data.path: ")


def test_builtin_shapes_and_unknown_builtin():
    records = list_samples(DataSpec(path="builtin:shapes"))
    assert len(records) == SHAPES_NUM_SAMPLES == count_samples(DataSpec())
    assert records[0].sample_id == "shapes/000000" and records[0].image_path is None
    assert records[0].caption == "a red circle" and records[13].caption == "a green triangle"
    with pytest.raises(DataError) as err:
        count_samples(DataSpec(path="builtin:faces"))
    assert (
        err.value.key == "data.path" and "builtin:faces" in err.value.message and "builtin:shapes" in err.value.message
    )


# ------------------------------------------------------------------------------------------------ jsonl


def write_metadata(root, lines):
    write_text(root / "metadata.jsonl", "\n".join(lines) + "\n")


@pytest.fixture
def hf_folder(tmp_path):
    root = tmp_path / "hf"
    write_image(root / "train" / "b.png")
    write_image(root / "a.jpg")
    write_text(root / "a.txt", "ignored: jsonl wins")
    write_metadata(
        root,
        [
            json.dumps({"file_name": "train/b.png", "text": "second listed first", "extra": 1}),
            "",
            json.dumps({"file_name": "a.jpg", "text": " a caption "}),
        ],
    )
    return root


def test_jsonl_auto_detected_keeps_file_order(hf_folder):
    result = index_dataset(DataSpec(path=str(hf_folder)))
    assert [(r.sample_id, r.caption, r.repeats) for r in result.records] == [
        ("train/b.png", "second listed first", 1),
        ("a.jpg", "a caption", 1),
    ]
    assert result.warnings == [] and result.skipped == []
    # format: folder ignores metadata.jsonl and uses the caption files
    folder = list_samples(DataSpec(path=str(hf_folder), format="folder"))
    assert [(r.sample_id, r.caption) for r in folder] == [("a.jpg", "ignored: jsonl wins"), ("train/b.png", "")]


def test_jsonl_format_without_metadata(tmp_path):
    write_image(tmp_path / "a.png")
    with pytest.raises(DataError) as err:
        count_samples(DataSpec(path=str(tmp_path), format="jsonl"))
    assert err.value.key == "data.format" and "metadata.jsonl" in err.value.message


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ('{"file_name": "a.png", "text": "x"', "not valid JSON"),
        ('["a.png", "x"]', "expected a JSON object"),
        ('{"file_name": "a.png"}', "missing `text`"),
        ('{"text": "x"}', "missing `file_name`"),
        ('{"file_name": "a.png", "text": 3}', "`text` must be a string"),
        ('{"file_name": "", "text": "x"}', "`file_name` must be a non-empty string"),
        ('{"file_name": "../a.png", "text": "x"}', "inside the dataset folder"),
        ('{"file_name": "/etc/a.png", "text": "x"}', "inside the dataset folder"),
        ('{"file_name": "ok.png", "text": "again"}', "already listed on line 1"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, expected):
    write_image(tmp_path / "ok.png")
    write_image(tmp_path / "a.png")
    write_metadata(tmp_path, [json.dumps({"file_name": "ok.png", "text": "fine"}), "", bad_line])
    with pytest.raises(DataError) as err:
        count_samples(DataSpec(path=str(tmp_path)))
    assert err.value.key == "data.path"
    assert f"{tmp_path / 'metadata.jsonl'}:3" in err.value.message and expected in err.value.message


def test_jsonl_missing_image_is_an_error_or_skipped(tmp_path):
    write_image(tmp_path / "ok.png")
    write_metadata(
        tmp_path, [json.dumps({"file_name": "gone.png", "text": "x"}), json.dumps({"file_name": "ok.png", "text": "y"})]
    )
    with pytest.raises(DataError) as err:
        count_samples(DataSpec(path=str(tmp_path)))
    assert "gone.png" in err.value.message and ":1" in err.value.message and "skip_bad_files" in err.value.message
    result = index_dataset(DataSpec(path=str(tmp_path), skip_bad_files=True))
    assert [r.sample_id for r in result.records] == ["ok.png"]
    assert len(result.skipped) == 1 and "gone.png" in result.skipped[0]
    assert "1 lines" in result.warnings[0]
    assert count_samples(DataSpec(path=str(tmp_path), skip_bad_files=True)) == 1


def test_index_imports_neither_torch_nor_pil():
    code = (
        "import sys; from dstune.data import count_samples; from dstune.spec.models import DataSpec; "
        "assert count_samples(DataSpec()) > 0; "
        "bad = [m for m in ('torch', 'PIL', 'deepspeed') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
