"""Edit / control training pairs (dstune.data.pairs, data.control_dir, metadata.jsonl `control_file_name`): the index
pairs each target with its source, names unpaired files, `validate` counts the pairs, and the dataset crops a source
exactly as its target (same size, bucket, crop and flip)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from PIL import Image

from dstune.cli import main
from dstune.data.images import ImageCaptionDataset, collate
from dstune.data.index import DataError, control_records, index_dataset
from dstune.spec.models import DataSpec


def _image(path, size, colour) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    array = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    array[..., 0] = colour
    array[:, : size[0] // 3, 1] = 255  # a left band, so a flip is visible
    Image.fromarray(array).save(path)


def _pairs(tmp_path, names=("a", "b", "2_more/c"), sources=None, size=(48, 32)):
    """target/<name>.png with captions; control/<name>.jpg|png for `sources` (default: all)."""
    for number, name in enumerate(names):
        _image(tmp_path / "target" / f"{name}.png", size, 40 * number)
        (tmp_path / "target" / f"{name}.txt").write_text(f"make {name} red")
    for number, name in enumerate(names if sources is None else sources):
        _image(tmp_path / "control" / f"{name}{'.jpg' if number % 2 else '.png'}", (size[0] * 2, size[1] * 2), 200)
    return DataSpec(path=str(tmp_path / "target"), control_dir="../control", resolution=32)


def test_sibling_folder_pairs_every_target_by_relative_stem(tmp_path):
    index = index_dataset(_pairs(tmp_path))
    assert index.num_pairs == 3 and index.num_samples == 4  # 2_more/ repeats its pair twice
    by_id = {r.sample_id: r.control_path for r in index.records}
    assert by_id == {
        "a.png": str(tmp_path / "control" / "a.png"),
        "b.png": str(tmp_path / "control" / "b.jpg"),
        "2_more/c.png": str(tmp_path / "control" / "2_more" / "c.png"),
    }
    assert [r.sample_id for r in control_records(index.records)] == [f"{i}#control" for i in by_id]


def test_unpaired_targets_are_named_with_the_count_and_orphan_sources_warned(tmp_path):
    data = _pairs(tmp_path, names=("a", "b", "c", "d"), sources=("a", "x"))
    with pytest.raises(
        DataError,
        match=r"3 of 4 target images have no source \(control\) image: b.png, c.png, "
        r"d.png",
    ) as caught:
        index_dataset(data)
    assert caught.value.key == "data.control_dir" and "any of .png" in caught.value.message
    index = index_dataset(data.model_copy(update={"skip_bad_files": True}))
    assert [r.sample_id for r in index.records] == ["a.png"]
    assert any(w.startswith("left out (data.skip_bad_files): 3 of 4") for w in index.warnings)
    assert any("1 source images in" in w and "x.jpg" in w for w in index.warnings)


def test_metadata_field_names_the_source_and_a_missing_one_is_named(tmp_path):
    for name in ("a", "b"):
        _image(tmp_path / "data" / f"{name}.png", (32, 32), 10)
        _image(tmp_path / "data" / "src" / f"{name}-before.png", (32, 32), 90)
    lines = [
        {"file_name": "a.png", "text": "a", "control_file_name": "src/a-before.png"},
        {"file_name": "b.png", "text": "b", "control_file_name": "src/b-gone.png"},
    ]
    (tmp_path / "data" / "metadata.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    with pytest.raises(DataError, match=r"1 of 2 target images .*b.png \(.*b-gone.png does not exist\)"):
        index_dataset(DataSpec(path=str(tmp_path / "data")))
    lines[1]["control_file_name"] = "src/b-before.png"
    (tmp_path / "data" / "metadata.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert index_dataset(DataSpec(path=str(tmp_path / "data"))).num_pairs == 2


def test_sources_inside_the_targets_folder_and_missing_folders_are_refused(tmp_path):
    data = _pairs(tmp_path)
    with pytest.raises(DataError, match="inside data.path"):
        index_dataset(data.model_copy(update={"control_dir": "sub"}))
    with pytest.raises(DataError, match="is not a folder"):
        index_dataset(data.model_copy(update={"control_dir": "../nowhere"}))
    with pytest.raises(ValueError, match="is generated and has no files to pair"):
        DataSpec(path="builtin:shapes", control_dir="/tmp")


@pytest.mark.parametrize("buckets", [False, True])
def test_the_source_is_cropped_and_flipped_with_its_target(tmp_path, buckets):
    paired = _pairs(tmp_path, names=("a", "b"), size=(64, 32))
    data = DataSpec(
        path=paired.path,
        control_dir="../control",
        resolution=32,
        random_flip=True,
        buckets={"enabled": buckets, "step": 8},
    )
    dataset = ImageCaptionDataset(data, index_dataset(data).records, seed=0)
    items = [dataset[i] for i in range(len(dataset))]
    batch = collate(items)
    assert batch["control_values"].shape == batch["pixel_values"].shape
    assert batch["pixel_values"].shape[-2:] == ((24, 40) if buckets else (32, 32))  # 64x32 in the ~32x32 area
    for item in items:  # the left band (green) sits on the same side in target and source: flipped together
        target_side = item["pixel_values"][1, :, :4].mean() > item["pixel_values"][1, :, -4:].mean()
        source_side = item["control_values"][1, :, :4].mean() > item["control_values"][1, :, -4:].mean()
        assert target_side == source_side
        assert item["control_values"][0].mean() > 0.4 > item["pixel_values"][0].mean()  # the source's colour


def test_validate_counts_pairs_and_names_unpaired_files(tmp_path, capsys):
    data = _pairs(tmp_path)
    spec = {
        "model": {"family": "flow", "pretrained": "builtin:tiny-qwen-image-edit", "train": "lora"},
        "data": {"path": data.path, "control_dir": "../control", "resolution": 64},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "epochs": 1},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "2"]) == 0
    assert "3 source/target pairs" in capsys.readouterr().out
    (tmp_path / "control" / "b.jpg").unlink()
    assert main(["validate", str(path), "--num-gpus", "2"]) != 0
    captured = capsys.readouterr()
    assert "1 of 3 target images have no source (control) image: b.png" in captured.out + captured.err


def test_validate_refuses_what_an_edit_model_cannot_do(tmp_path, capsys):
    """Unpaired data, a text cache and prompts without source images are errors for an edit model before any launch."""
    data = _pairs(tmp_path)
    spec = {
        "model": {"family": "flow", "pretrained": "builtin:tiny-qwen-image-edit"},
        "data": {"path": data.path, "resolution": 64, "cache": {"latents": True, "text_embeddings": True}},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "epochs": 1},
        "sample": {"prompts": ["make it blue"]},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "1"]) != 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "data.control_dir" in text and "trains on (source, target) pairs" in text
    assert "data.cache.text_embeddings" in text and "sample.prompts" in text and "sample.control_images" in text
    spec["model"]["pretrained"] = "builtin:tiny-qwen-image"  # the same data trains Qwen-Image as it is
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "1"]) == 0
    spec["sample"]["control_images"] = [str(tmp_path / "control" / "a.png")]  # but sources are for edit models
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "1"]) != 0
    assert "source images are for edit models" in capsys.readouterr().out
    spec["model"]["pretrained"] = "builtin:tiny-qwen-image-edit"  # an edit model with pairs and its sources
    spec["data"].update(control_dir="../control", cache={"latents": True})
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "1"]) == 0


def test_a_text_to_image_model_refuses_sources_and_flux2_trains_image_to_image_from_them(tmp_path, capsys):
    """data.control_dir on a model that trains from the caption alone would be left out of its training without a
    word: validate refuses it. FLUX.2 (the same folder) trains image-to-image from it, and validate plans two
    pictures per sample."""
    import json

    data = _pairs(tmp_path)
    spec = {
        "model": {"family": "flow", "pretrained": "builtin:tiny-flux", "train": "lora"},
        "data": {"path": data.path, "control_dir": "../control", "resolution": 32, "cache": {"latents": True}},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "epochs": 1},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "1"]) == 1
    assert "FluxPipeline trains from the caption alone" in capsys.readouterr().out
    spec["model"]["pretrained"] = "builtin:tiny-flux2"
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "1", "--json"]) == 0
    with_references = json.loads(capsys.readouterr().out)
    del spec["data"]["control_dir"]
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "1", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    cache = [plan["memory"]["cache_disk_bytes"] for plan in (with_references, alone)]
    assert cache[0] == 2 * cache[1]  # the references' latents beside the targets' (no text cache here)


def _two_references(tmp_path, missing=()):
    """target/<name>.png, person/<name>.png and scene/<name>.png (the second reference), less `missing` scenes."""
    data = _pairs(tmp_path, names=("a", "b", "c"))
    for number, name in enumerate(("a", "b", "c")):
        if name not in missing:
            _image(tmp_path / "scene" / f"{name}.png", (40, 40), 100 + number)
    return data.model_copy(update={"control_dir": ["../control", "../scene"]})


def test_several_references_per_target_from_a_list_of_folders_crop_and_cache_in_order(tmp_path):
    data = _two_references(tmp_path)
    index = index_dataset(data)
    by_id = {r.sample_id: r.control_paths for r in index.records}
    assert by_id["b.png"] == (str(tmp_path / "control" / "b.jpg"), str(tmp_path / "scene" / "b.png"))
    assert [r.sample_id for r in control_records(index.records)][:2] == ["a.png#control", "a.png#control2"]
    batch = collate([ImageCaptionDataset(data, index.records, seed=0)[i] for i in range(2)])
    assert batch["control_values_2"].shape == batch["control_values"].shape == batch["pixel_values"].shape
    assert batch["control_values_2"][0, 0].mean() < batch["control_values"][0, 0].mean()  # scene's red is darker


def test_a_target_missing_one_of_its_references_is_named_with_the_file_looked_for(tmp_path, capsys):
    data = _two_references(tmp_path, missing=("b",))
    with pytest.raises(DataError) as caught:
        index_dataset(data)
    assert caught.value.key == "data.control_dir"
    assert f"b.png (reference 2: no b.* in {tmp_path / 'scene'})" in caught.value.message
    spec = {
        "model": {"family": "flow", "pretrained": "builtin:tiny-qwen-image-edit-plus", "train": "lora"},
        "data": {"path": data.path, "control_dir": ["../control", "../scene"], "resolution": 64},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "epochs": 1},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "2"]) == 1
    assert "b.png (reference 2: no b.* in" in capsys.readouterr().out
    _image(tmp_path / "scene" / "b.png", (40, 40), 0)
    assert main(["validate", str(path), "--num-gpus", "2"]) == 0
    assert "3 source/target pairs, 2 references each" in capsys.readouterr().out
    spec["model"]["pretrained"] = "builtin:tiny-qwen-image-edit"  # one reference per sample: the list is refused
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path), "--num-gpus", "2"]) == 1
    assert "takes 1 reference image(s) per sample; data.control_dir lists 2 folders" in capsys.readouterr().out


def test_metadata_names_several_references_and_every_target_needs_as_many(tmp_path):
    data = _two_references(tmp_path)
    for name in ("a1", "a2", "b1"):  # jsonl names its files inside data.path; only those listed are targets
        _image(tmp_path / "target" / "refs" / f"{name}.png", (40, 40), 9)
    lines = [
        {"file_name": "a.png", "text": "x", "control_file_name": ["refs/a1.png", "refs/a2.png"]},
        {"file_name": "b.png", "text": "y", "control_file_name": "refs/b1.png"},
    ]
    (tmp_path / "target" / "metadata.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    with pytest.raises(DataError, match="a.png has 2 reference.*b.png another number"):
        index_dataset(data.model_copy(update={"control_dir": None, "format": "jsonl"}))
