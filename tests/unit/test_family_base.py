"""The family registry and the shared helpers (per-sample RNG, folders, grids); no model is built here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from dstune.families import FAMILY_FACTS, FAMILY_MODULES, get_facts, get_family
from dstune.families.base import Family, FamilyError
from dstune.families.randomness import per_sample_randint, per_sample_randn, sample_generator
from dstune.families.diffusion import copy_component
from dstune.families.samples import save_grid
from dstune.fsutil import publish_folder
from dstune.pretrained import resolve_pretrained
from dstune.spec.models import FlowModelSpec, VideoModelSpec
from dstune.spec.speech_models import CodebooksModelSpec
from dstune.models.sd.spec import SdModelSpec, SdxlModelSpec
from dstune.models.speecht5.spec import SpeechT5ModelSpec
from dstune.models.tts_lm.spec import TtsLmModelSpec
from dstune.spec.models import AUDIO_FAMILIES, FAMILIES, SECTIONS_BY_FAMILY, VIDEO_FAMILIES

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_SPECS = {
    "sd": SdModelSpec,
    "sdxl": SdxlModelSpec,
    "flow": FlowModelSpec,
    "wan": VideoModelSpec,
    "tts_lm": TtsLmModelSpec,
    "tts_codebooks": CodebooksModelSpec,
    "speecht5": SpeechT5ModelSpec,
}

API = ("build", "encode_batch", "loss", "sample", "save_samples", "export")


def test_registry_matches_the_spec_and_every_family_declares_the_contract():
    assert sorted(FAMILY_MODULES) == sorted(FAMILIES)
    for name in FAMILY_MODULES:
        family = get_family(name)
        assert isinstance(family, Family) and family.name == name
        missing = [f for f in API if not callable(getattr(family, f))]
        assert not missing, f"family {name} lacks {missing}"
        assert (family.modality == "audio") == (name in AUDIO_FAMILIES)  # validate decides data rules by the spec
        assert (family.modality == "video") == (name in VIDEO_FAMILIES)
        assert family.pretrained_fields[0] == "pretrained"
        assert all(field in MODEL_SPECS[name].model_fields for field in family.pretrained_fields)
        assert family.text_cache is None or family.modality in ("image", "video")
        assert family.supports_lora == (name != "speecht5")  # LoRA: the diffusion families and tts_lm
        section = SECTIONS_BY_FAMILY[name]  # validate checks output.lora_format and single files by the spec
        assert family.supports_lora == bool(getattr(section, "LORA_FORMATS", {}))
        assert (family.single_file is not None) == bool(getattr(section, "SINGLE_FILE", False))
        facts = get_facts(name)  # the torch-free half declares the same family and modality
        assert facts.family == name and facts.modality == family.modality
        assert (facts.token_factors is not None) == (family.modality == "video")
    assert sorted(FAMILY_FACTS) == sorted(FAMILY_MODULES)


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ValueError, match="known families: .*sd"):
        get_family("sdxl-typo")
    with pytest.raises(ValueError, match="known families: .*sd"):
        get_facts("sdxl-typo")


def test_the_registry_and_every_family_facts_module_import_without_torch():
    """validate reads the facts of every family; importing them (and so the registry) must not load torch."""
    import subprocess
    import sys

    code = (
        "import sys, dstune.families\n"
        "from dstune.families import FAMILY_FACTS\n"
        "assert FAMILY_FACTS and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr


def test_sample_generator_is_a_pure_function_of_its_arguments():
    def draw(*args):
        return torch.randn(5, generator=sample_generator(*args))

    torch.manual_seed(1)
    first = draw(0, 3, 7, "noise")
    torch.manual_seed(2)  # the global RNG must not matter
    assert torch.equal(first, draw(0, 3, 7, "noise"))
    for other in [(1, 3, 7, "noise"), (0, 4, 7, "noise"), (0, 3, 8, "noise"), (0, 3, 7, "timestep")]:
        assert not torch.equal(first, draw(*other)), other


def test_per_sample_draws_do_not_depend_on_the_batch_they_are_in():
    together = per_sample_randn((2, 3), 5, 9, [4, 1, 7], "noise")
    assert together.shape == (3, 2, 3)
    apart = torch.cat([per_sample_randn((2, 3), 5, 9, [i], "noise") for i in (4, 1, 7)])
    assert torch.equal(together, apart)
    steps = per_sample_randint(1000, 5, 9, [4, 1, 7], "timestep")
    assert steps.dtype == torch.long and steps.shape == (3,) and steps.min() >= 0 and steps.max() < 1000
    assert torch.equal(steps[1:2], per_sample_randint(1000, 5, 9, [1], "timestep"))


def test_save_grid_writes_one_png_with_room_for_captions(tmp_path):
    images = [Image.new("RGB", (32, 32), colour) for colour in ("red", "green", "blue", "white", "black")]
    path = save_grid(images, ["a red one", "green", "", "white", "a black square " * 5], tmp_path / "g" / "grid.png")
    with Image.open(path) as grid:
        assert grid.format == "PNG"
        assert grid.width == 4 * 200 and grid.height > 2 * 192  # 4 columns, 2 rows, text under each image
        assert grid.getpixel((4 + 96, 4 + 96)) == (255, 0, 0)  # first image, scaled up
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        save_grid(images[:2], ["x"], tmp_path / "bad.png")


def test_publish_folder_replaces_an_old_folder_only_when_the_new_one_is_complete(tmp_path):
    final = tmp_path / "export"
    final.mkdir()
    (final / "old.txt").write_text("old")
    new = tmp_path / ".export.partial"
    new.mkdir()
    (new / "new.txt").write_text("new")
    publish_folder(new, final)
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing left beside it


def test_copy_component_keeps_default_weights_and_follows_symlinks(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    blob = tmp_path / "blob"
    blob.write_bytes(b"weights")
    os.symlink(blob, source / "diffusion_pytorch_model.safetensors")  # hub cache snapshots are symlinks
    for name in ("config.json", "diffusion_pytorch_model.bin", "diffusion_pytorch_model.fp16.safetensors"):
        (source / name).write_text(name)
    copy_component(source, tmp_path / "dst")
    copied = sorted(p.name for p in (tmp_path / "dst").iterdir())
    assert copied == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert not (tmp_path / "dst" / "diffusion_pytorch_model.safetensors").is_symlink()
    assert (tmp_path / "dst" / "diffusion_pytorch_model.safetensors").read_bytes() == b"weights"
    only_variant = tmp_path / "variant"
    only_variant.mkdir()
    (only_variant / "model.fp16.safetensors").write_text("w")
    copy_component(only_variant, tmp_path / "dst2")
    assert [p.name for p in (tmp_path / "dst2").iterdir()] == ["model.fp16.safetensors"]


def test_resolve_pretrained_explains_what_is_wrong(tmp_path):
    with pytest.raises(FamilyError, match="does not exist"):
        resolve_pretrained(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "model.safetensors").write_text("x")
    with pytest.raises(FamilyError, match="is a file"):
        resolve_pretrained(str(tmp_path / "model.safetensors"), tmp_path)
    with pytest.raises(FamilyError, match="hf download dstune-tests/not-downloaded-anywhere"):
        resolve_pretrained("dstune-tests/not-downloaded-anywhere", tmp_path)
    with pytest.raises(FamilyError, match="Known built-in models: .*builtin:tiny-sd"):
        resolve_pretrained("builtin:tiny-sdxxl", tmp_path)
