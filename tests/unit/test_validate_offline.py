"""What `dstune validate` catches offline, before any launch: a model folder of another family, a built-in name
that does not exist, a local folder that does not exist, a hub id not downloaded (a warning), unreadable images
(truncated JPEGs included), advice that can be followed, and a prompt list YAML split at its commas.

The folders are the real built-in models (built once into the shared test cache by dstune.builtin); every spec goes
through `dstune validate` (dstune.cli.main), whose exit code and output are what a user sees."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from dstune.builtin import BUILTIN_MODELS, ensure_builtin_model
from dstune.cli import main
from dstune.spec.models import FAMILIES

CACHE = Path(os.environ.get("DSTUNE_TEST_CACHE", Path(__file__).resolve().parents[2] / ".dstune-cache" / "tests"))
DATA_OF = {
    "sd": "builtin:shapes",
    "sdxl": "builtin:shapes",
    "flow": "builtin:shapes",
    "video": "builtin:moving-shapes",
    "tts_lm": "builtin:tones",
    "tts_codebooks": "builtin:tones",
    "speecht5": "builtin:tones",
}


def validate(capsys, tmp_path: Path, model: dict, data: dict | None = None, *flags: str, **sections):
    """(exit code, everything printed) of `dstune validate` on a spec of these sections, for one GPU."""
    family = model["family"]
    spec = {
        "model": model,
        "data": data or {"path": DATA_OF[family]},
        "train": {"micro_batch_size": 1, "max_steps": 2},
        **sections,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    code = main(["validate", str(path), "--num-gpus", "1", *flags])
    out, err = capsys.readouterr()
    return code, out + err


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# ------------------------------------------------------------------------------------- folder vs model.family


WRONG_PAIRS = [
    (name, family) for name in sorted(BUILTIN_MODELS) for family in FAMILIES if family != BUILTIN_MODELS[name].family
]


@pytest.mark.parametrize("name, family", WRONG_PAIRS, ids=[f"{n}-as-{f}" for n, f in WRONG_PAIRS])
def test_every_built_in_folder_under_every_other_family_is_refused_naming_its_family(capsys, tmp_path, name, family):
    folder = ensure_builtin_model(name, CACHE)
    capsys.readouterr()  # what building the folder printed (libraries' notices) is not validate's output
    code, text = validate(capsys, tmp_path, {"family": family, "pretrained": str(folder)})
    assert code == 1, text
    assert "Traceback" not in text and "internal error" not in text, text
    right = BUILTIN_MODELS[name].family
    errors = error_lines(text)
    assert any(
        "model.family:" in line
        and f"model.family {right} trains, not {family}" in line
        and f"Set model.family: {right}" in line
        and str(folder) in line
        for line in errors
    ), text


def test_a_built_in_name_under_another_family_is_refused_from_its_stored_configs(capsys, tmp_path):
    code, text = validate(capsys, tmp_path, {"family": "flow", "pretrained": "builtin:tiny-wan"})
    assert code == 1 and "Traceback" not in text
    assert "builtin:tiny-wan is a WanPipeline (model_index.json), which model.family video trains, not flow" in text


def test_a_folder_no_family_trains_is_refused_with_what_dstune_trains(capsys, tmp_path):
    other = tmp_path / "pixart"
    other.mkdir()
    (other / "model_index.json").write_text('{"_class_name": "PixArtSigmaPipeline"}')
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder, what in (
        (other, "is a PixArtSigmaPipeline (model_index.json), which no dstune family trains"),
        (empty, "holds neither model_index.json (a diffusers pipeline) nor config.json"),
    ):
        code, text = validate(capsys, tmp_path, {"family": "sd", "pretrained": str(folder)})
        assert code == 1, text
        [line] = error_lines(text)
        assert "model.pretrained:" in line and what in line, text
        assert "sd: StableDiffusionPipeline" in line and "video: WanPipeline, WanImageToVideoPipeline" in line
        assert "tts_lm: *ForCausalLM" in line and "speecht5: SpeechT5ForTextToSpeech" in line


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_every_built_in_folder_passes_under_its_own_family(name):
    from dstune.model_folders import model_folder_issues
    from dstune.spec.load import SpecSource, validate_data

    folder = ensure_builtin_model(name, CACHE)
    family = BUILTIN_MODELS[name].family
    spec = validate_data(
        {
            "model": {"family": family, "pretrained": str(folder)},
            "data": {"path": DATA_OF[family]},
            "train": {"micro_batch_size": 1, "max_steps": 2},
        },
        SpecSource("spec.yaml"),
    )
    assert model_folder_issues(spec, SpecSource("spec.yaml")) == []


# ------------------------------------------------------------------------------------- names and paths


def test_an_unknown_built_in_name_is_refused_with_the_list_and_the_nearest_names(capsys, tmp_path):
    code, text = validate(capsys, tmp_path, {"family": "flow", "pretrained": "builtin:tiny-qwen"})
    assert code == 1, text
    [line] = error_lines(text)
    assert "spec.yaml:3: model.pretrained: builtin:tiny-qwen is not a built-in model" in line
    assert "did you mean builtin:tiny-qwen-image or builtin:tiny-qwen-image-" in line  # -21 or -edit, the nearest
    assert all(f"builtin:{name}" in line for name in BUILTIN_MODELS)


def test_a_local_folder_that_does_not_exist_is_refused_with_the_path_as_resolved(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, text = validate(capsys, tmp_path, {"family": "sd", "pretrained": "./models/sd15"})
    assert code == 1, text
    [line] = error_lines(text)
    assert f"model.pretrained: folder {tmp_path / 'models' / 'sd15'} does not exist (relative to {tmp_path})" in line
    code, text = validate(capsys, tmp_path, {"family": "sd", "pretrained": str(tmp_path / "gone")})
    assert code == 1 and f"folder {tmp_path / 'gone'} does not exist." in text, text


def test_a_missing_local_folder_is_a_warning_when_planning_for_another_machine(capsys, tmp_path):
    """--num-samples with a data.path that is not here: the spec is checked for the machine that has both."""
    code, text = validate(
        capsys,
        tmp_path,
        {"family": "sd", "pretrained": "/models/sd15"},
        {"path": "/data/not-here"},
        "--num-samples",
        "100",
    )
    assert code == 0, text
    assert "warning: " in text and "model.pretrained: folder /models/sd15 is not on this machine" in text


def test_a_hub_id_not_downloaded_is_a_warning_with_the_download_command(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache: nothing is downloaded here
    code, text = validate(capsys, tmp_path, {"family": "sd", "pretrained": "dstune-tests/not-downloaded"})
    assert code == 0, text
    assert "model.pretrained: dstune-tests/not-downloaded is not in the local Hugging Face cache" in text
    assert "`hf download dstune-tests/not-downloaded`" in text and "huggingface-cli download" in text
    assert "stop at start-up" in text


def test_a_hub_id_not_downloaded_is_still_checked_against_its_stored_configs(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, text = validate(capsys, tmp_path, {"family": "sd", "pretrained": "stabilityai/stable-diffusion-xl-base-1.0"})
    assert code == 1, text
    assert "`hf download stabilityai/stable-diffusion-xl-base-1.0`" in text
    assert "is a StableDiffusionXLPipeline (model_index.json), which model.family sdxl trains, not sd" in text


def test_companion_folders_and_files_that_do_not_exist_are_refused(capsys, tmp_path):
    code, text = validate(capsys, tmp_path, {"family": "tts_lm", "codec_pretrained": str(tmp_path / "no-codec")})
    assert code == 1 and f"model.codec_pretrained: folder {tmp_path / 'no-codec'} does not exist" in text, text
    code, text = validate(capsys, tmp_path, {"family": "speecht5", "speaker_embeddings": str(tmp_path / "x.st")})
    assert code == 1 and f"model.speaker_embeddings: file {tmp_path / 'x.st'} does not exist" in text, text
    lm = tmp_path / "lm"  # the built-in LM's folder without its codec/ subfolder
    lm.mkdir()
    (lm / "config.json").write_bytes((ensure_builtin_model("tiny-tts-lm", CACHE) / "config.json").read_bytes())
    code, text = validate(capsys, tmp_path, {"family": "tts_lm", "pretrained": str(lm)})
    assert (
        code == 1 and f"model.codec_pretrained: unset, so it is read from {lm / 'codec'}, which does not exist" in text
    ), text


def test_the_video_token_factors_of_an_image_models_folder_are_assumed_and_say_so_not_a_crash():
    from dstune.families import family_cards
    from dstune.families.video_card import ASSUMED_PATCH, ASSUMED_SPATIAL, token_factors

    cards = family_cards("video")
    spatial, patch, temporal, origin = token_factors(cards, "builtin:tiny-flux")  # its transformer's patch_size: 1
    assert (spatial, patch) == (ASSUMED_SPATIAL, ASSUMED_PATCH) and "is none of the video models" in origin
    assert token_factors(cards, "builtin:tiny-wan")[3].startswith("the VAE and transformer configs of builtin:tiny-wan")


# ------------------------------------------------------------------------------------------------- images


def write_images(folder: Path, count: int = 4) -> bytes:
    """`count` readable JPEGs (img0.jpg ...) in `folder`; returns the bytes of a larger real JPEG to cut."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        Image.new("RGB", (40, 40), (60 * index, 20, 200)).save(folder / f"img{index}.jpg")
    noise = (np.random.default_rng(0).random((96, 128, 3)) * 255).astype("uint8")
    Image.fromarray(noise).save(folder / "big.jpg", quality=90)
    whole = (folder / "big.jpg").read_bytes()
    (folder / "big.jpg").unlink()
    return whole


def test_image_problem_catches_a_jpeg_cut_short_that_verify_passes(tmp_path):
    from PIL import Image

    from dstune.data.image_check import image_problem

    whole = write_images(tmp_path, count=1)
    (tmp_path / "whole.jpg").write_bytes(whole)
    (tmp_path / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "trailer.jpg").write_bytes(whole + b"\x00\x00camera trailer after the end marker")
    with Image.open(tmp_path / "cut.jpg") as image:
        image.verify()  # what the old check relied on: it passes
    assert "truncated" in image_problem(str(tmp_path / "cut.jpg"))
    assert image_problem(str(tmp_path / "whole.jpg")) is None
    assert image_problem(str(tmp_path / "trailer.jpg")) is None  # data after FF D9 is not a truncation
    Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "whole.png")
    png = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(png[: len(png) - 20])
    assert image_problem(str(tmp_path / "whole.png")) is None and image_problem(str(tmp_path / "cut.png"))
    assert image_problem(str(tmp_path / "missing.jpg"))


def test_validate_names_an_unreadable_image_or_counts_it_with_skip_bad_files(capsys, tmp_path):
    data = tmp_path / "images"
    whole = write_images(data)
    (data / "img9.jpg").write_bytes(whole[: len(whole) // 2])
    code, text = validate(capsys, tmp_path, {"family": "sd"}, {"path": str(data), "resolution": 32})
    assert code == 1, text
    [line] = error_lines(text)
    assert "data.path: 1 of 5 image(s) cannot be read" in line and "before step 1" in line
    assert f"{data / 'img9.jpg'}: image file is truncated" in text and "data.skip_bad_files: true" in text
    code, text = validate(
        capsys, tmp_path, {"family": "sd"}, {"path": str(data), "resolution": 32, "skip_bad_files": True}
    )
    assert code == 0, text
    assert "data.skip_bad_files: 1 of 5 image(s) cannot be read and are skipped" in text


# ------------------------------------------------------------------------------------------------- advice


@pytest.mark.parametrize(
    "ranks, micro, global_batch, expected, fits",
    [
        (2, 1, 16, "e.g. global_batch_size: 4", (2, 1, 4)),  # 5 samples: multiples of 2 x 1
        (2, 4, 8, "use micro_batch_size 2 with global_batch_size 4", (2, 2, 4)),
        (
            8,
            1,
            8,
            "fewer than the 8 ranks, and every rank needs at least one sample per step: it is too small for this "
            "world. Train on at most 5 GPU(s)",
            None,
        ),
    ],
)
def test_a_global_batch_larger_than_the_dataset_gets_a_batch_this_world_can_run(
    ranks, micro, global_batch, expected, fits
):
    from dstune.plan import make_plan
    from dstune.spec.load import SpecError, SpecSource
    from dstune.spec.models import TrainSpec
    from dstune.world import world_from_flags

    train = TrainSpec(micro_batch_size=micro, global_batch_size=global_batch, max_steps=1)
    with pytest.raises(SpecError) as err:
        make_plan(train, world_from_flags(num_gpus=ranks), 5, SpecSource("spec.yaml"))
    assert expected in str(err.value), str(err.value)
    if fits:  # the advice itself plans
        world_size, advised_micro, advised_global = fits
        advised = TrainSpec(micro_batch_size=advised_micro, global_batch_size=advised_global, max_steps=1)
        assert make_plan(advised, world_from_flags(num_gpus=world_size), 5, SpecSource("spec.yaml")).steps_per_epoch


# ------------------------------------------------------------------------------------------------- prompts


def test_a_flow_style_prompt_list_split_at_a_comma_is_a_warning_at_its_line(capsys, tmp_path):
    spec = tmp_path / "spec.yaml"
    base = "model:\n  family: sd\ndata:\n  path: builtin:shapes\ntrain:\n  micro_batch_size: 1\n  max_steps: 2\n"
    spec.write_text(base + "sample:\n  prompts: [a cat, sitting, a dog]\n")
    code = main(["validate", str(spec), "--num-gpus", "1"])
    text = capsys.readouterr().out
    assert code == 0
    assert (
        f"warning: {spec}:9: sample.prompts: a flow-style list ([...]) of unquoted text is split at every "
        "comma: YAML reads 3 prompts here (a cat | sitting | a dog)" in text
    )
    assert "`- a cat, sitting`" in text and '"a cat, sitting"' in text
    for fine in (
        '["a cat, sitting", a dog]',
        "\n    - a cat, sitting\n    - a dog",
        "[a red circle, a blue square, a yellow triangle]",
    ):
        spec.write_text(base + "sample:\n  prompts: " + fine + "\n")
        assert main(["validate", str(spec), "--num-gpus", "1"]) == 0
        assert "sample.prompts" not in capsys.readouterr().out, fine


def test_a_hub_id_not_downloaded_when_planning_for_another_machine_says_where_to_download(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, text = validate(
        capsys,
        tmp_path,
        {"family": "sd", "pretrained": "dstune-tests/not-downloaded"},
        {"path": "/data/not-here"},
        "--num-samples",
        "100",
    )
    assert code == 0, text
    assert "dstune-tests/not-downloaded is not in this machine's Hugging Face cache" in text
    assert "on the machines that train, run `hf download dstune-tests/not-downloaded`" in text


def test_a_truncated_still_in_a_video_dataset_is_refused(capsys, tmp_path):
    """Video datasets are checked whole at start-up (data.skip_bad_files does not apply), so validate refuses it."""
    data = tmp_path / "clips"
    whole = write_images(data, count=2)
    (data / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    code, text = validate(capsys, tmp_path, {"family": "video"}, {"path": str(data), "resolution": 32})
    assert code == 1, text
    [line] = error_lines(text)
    assert "data.path: 1 still image(s) cannot be read" in line and "data.skip_bad_files does not apply" in line
    assert f"{data / 'cut.jpg'}: image file is truncated" in text


def test_a_global_batch_larger_than_every_bucket_gets_a_batch_the_largest_bucket_holds():
    from dstune.plan import make_plan
    from dstune.spec.load import SpecError, SpecSource
    from dstune.spec.models import TrainSpec
    from dstune.world import world_from_flags

    groups, world = {"32x32": 3, "48x32": 2}, world_from_flags(num_gpus=2)
    with pytest.raises(SpecError) as err:
        make_plan(TrainSpec(micro_batch_size=2, global_batch_size=4, max_steps=1), world, 5, SpecSource("s"), groups)
    assert "the largest bucket (32x32) holds: use micro_batch_size 1 with global_batch_size 2" in str(err.value)
    advised = TrainSpec(micro_batch_size=1, global_batch_size=2, max_steps=1)
    assert make_plan(advised, world, 5, SpecSource("s"), groups).steps_per_epoch == 2


def test_the_video_familys_old_name_still_validates_and_is_noted_once(capsys, tmp_path):
    """`model.family: wan` (the video core's first name) works as before, read as `video`: validate says so once, at
    the key, and the plan is the one `family: video` gives (every spec that worked keeps working)."""
    data = {"path": "builtin:moving-shapes"}
    code, old = validate(capsys, tmp_path, {"family": "wan", "pretrained": "builtin:tiny-wan"}, data, "--json")
    assert code == 0, old
    code, new = validate(capsys, tmp_path, {"family": "video", "pretrained": "builtin:tiny-wan"}, data, "--json")
    assert code == 0, new
    old, new = json.loads(old), json.loads(new)
    noted = [w for w in old["warnings"] if "model.family" in w and "wan is the video family's first name" in w]
    assert len(noted) == 1 and "spec.yaml:2" in noted[0] and "family: video" in noted[0]
    assert [w for w in old["warnings"] if w not in noted] == new["warnings"]
    assert {k: v for k, v in old.items() if k != "warnings"} == {k: v for k, v in new.items() if k != "warnings"}
