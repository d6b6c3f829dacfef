"""The families and the model contract (every card's class fulfils TrainedModel's), and the shared helpers
(per-sample RNG, folders, grids); no model is loaded here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from dstune import registry
from dstune.card import load
from dstune.families import FAMILY_FACTS, card_of, get_facts
from dstune.families.base import FamilyError, TrainedModel
from dstune.families.diffusion import copy_component
from dstune.families.pipeline_card import PipelineCard
from dstune.families.randomness import per_sample_randint, per_sample_randn, sample_generator
from dstune.families.samples import save_grid
from dstune.fsutil import publish_folder
from dstune.pretrained import folder_keys, resolve_pretrained
from dstune.spec.models import AUDIO_FAMILIES, FAMILIES, SECTIONS_BY_FAMILY, VIDEO_FAMILIES

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ("load", "encode_batch", "loss", "sample", "save_samples", "export")


def test_every_family_has_its_models_cards_and_the_sections_agree_with_them():
    assert sorted({card.family for card in registry.cards()}) == sorted(FAMILIES) == sorted(FAMILY_FACTS)
    for card in registry.cards():
        section, facts = SECTIONS_BY_FAMILY[card.family], get_facts(card.family)
        assert facts.family == card.family and facts.modality == section.modality
        assert (facts.modality == "audio") == (card.family in AUDIO_FAMILIES)  # validate's data rules by the spec
        assert (facts.modality == "video") == (card.family in VIDEO_FAMILIES)
        assert (card.single_file_layout() is not None) == bool(section.SINGLE_FILE), card.key
        # a model whose text the caches hold is a pipeline's (the spec allows the text cache for images and clips)
        assert isinstance(card, PipelineCard) == (facts.modality != "audio"), card.key


@pytest.mark.parametrize("card", registry.cards(), ids=lambda card: card.key)
def test_every_class_fulfils_the_contract_and_its_capabilities_match_the_spec(card):
    model_class = load(card.model_class)
    missing = [name for name in CONTRACT if getattr(model_class, name) is getattr(TrainedModel, name)]
    assert missing == [], f"{model_class.__name__} does not implement {missing}"
    section = SECTIONS_BY_FAMILY[card.family]
    assert model_class.supports_lora == bool(section.LORA_FORMATS)  # validate checks output.lora_format by the spec
    assert folder_keys(section(family=card.family))[0] == "pretrained"


def test_unknown_family_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="known families: .*sd"):
        get_facts("sdxl-typo")
    with pytest.raises(ValueError, match="known families: .*sd"):
        card_of("sdxl-typo", tmp_path)


def test_the_registry_the_cards_and_every_familys_facts_import_without_torch():
    """validate reads the cards of every model; importing them (and the registry, the facts) must not load torch."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from dstune import registry\n"
        "from dstune.families import FAMILY_FACTS\n"
        "assert registry.cards() and FAMILY_FACTS\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
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
