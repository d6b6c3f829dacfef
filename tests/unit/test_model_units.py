"""A model is one unit: each model's names appear only in its own folder (dstune/models/<name>/) and the registry,
and the registry's derived tables are what the rest of dstune uses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from dstune.models import registry

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dstune"
REGISTRY_FILES = {PACKAGE / "models" / "registry.py"}


def _mentions(unit) -> list[str]:
    pattern = re.compile(rf"(?<![\w])(?:{unit.names})(?![\w])", re.IGNORECASE)
    own = PACKAGE / "models" / unit.name
    return sorted(str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")
                  if own not in path.parents and path not in REGISTRY_FILES and pattern.search(path.read_text()))


# Modules outside a unit that still name its model (2026-11-26, right after the move into units): mostly comments,
# the spec's field descriptions and the video family's key "wan". The list may only shrink: the test fails when a
# module starts naming a model, and when a listed module no longer does (then delete it here). The goal is {}.
STILL_NAMED_ELSEWHERE = {
    'sd': ('builtin/common.py', 'data/images.py', 'families/base.py', 'families/denoiser_facts.py', 'families/diffusion.py', 'families/lora.py', 'models/sd3_flux/unit.py', 'pretrained.py', 'spec/data_sections.py', 'spec/model_sections.py', 'spec/models.py'),
    'sd3_flux': ('families/flow.py', 'families/flow_core.py', 'families/flow_facts.py', 'families/flow_matching.py', 'families/flow_recipe.py', 'models/flux2/unit.py', 'models/hunyuan_video15/facts.py', 'models/sd/sd_family.py', 'models/zimage/builtin.py', 'pretrained.py', 'spec/data_sections.py', 'spec/model_sections.py', 'spec/models.py'),
    'qwen_image': ('families/diffusion.py', 'families/flow_facts.py', 'families/flow_recipe.py', 'families/ulysses.py', 'memory/counts.py', 'models/flux2/builtin.py', 'models/hunyuan_video15/builtin.py', 'models/ideogram4/builtin.py', 'models/krea2/builtin.py', 'models/krea2/recipe.py', 'models/qwen_image_21/builtin.py', 'models/qwen_image_21/unit.py', 'models/zimage/builtin.py', 'sequence_parallel.py', 'spec/data_sections.py', 'spec/model_sections.py', 'spec/models.py', 'spec/reference.py'),
    'zimage': ('families/flow_distilled.py', 'families/flow_facts.py', 'models/flux2/builtin.py', 'models/hunyuan_video15/builtin.py', 'spec/model_sections.py', 'spec/models.py'),
    'flux2': ('families/flow_facts.py', 'families/flow_recipe.py', 'models/ideogram4/builtin.py', 'sequence_parallel.py', 'spec/model_sections.py', 'spec/models.py'),
    'ideogram4': ('families/flow_facts.py', 'families/flow_recipe.py', 'spec/model_sections.py'),
    'krea2': ('families/flow_distilled.py', 'families/flow_facts.py', 'spec/model_sections.py', 'spec/models.py'),
    'qwen_image_21': ('families/diffusion.py', 'families/flow.py', 'families/flow_facts.py', 'families/flow_recipe.py', 'models/ideogram4/builtin.py', 'spec/model_sections.py'),
    'wan': ('cache/latents.py', 'data/clips.py', 'data/video.py', 'families/__init__.py', 'families/base.py', 'families/denoiser_facts.py', 'families/diffusion.py', 'families/flow_core.py', 'families/flow_recipe.py', 'families/video.py', 'memory/counts.py', 'memory/phases.py', 'memory/plan.py', 'models/hunyuan_video15/builtin.py', 'models/hunyuan_video15/facts.py', 'models/hunyuan_video15/recipe.py', 'models/hunyuan_video15/unit.py', 'report.py', 'sequence_parallel.py', 'spec/data_sections.py', 'spec/model_sections.py', 'spec/models.py', 'spec/video_models.py'),
    'hunyuan_video15': ('models/wan/facts.py', 'spec/video_models.py'),
    'tts_lm': ('cli_args.py', 'families/speech_codecs.py', 'spec/speech_models.py'),
    'csm': ('cli_args.py', 'spec/speech_models.py'),
    'speecht5': ('cli_args.py', 'spec/data_sections.py', 'spec/speech_models.py'),
}


def test_each_model_is_named_only_in_its_unit_and_the_registry():
    outside = {unit.name: tuple(name.removeprefix("dstune/") for name in _mentions(unit)) for unit in registry.UNITS}
    assert {name: files for name, files in outside.items() if files} == STILL_NAMED_ELSEWHERE


def test_the_registry_imports_no_torch():
    code = "import dstune.models.registry, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_every_unit_folder_is_registered_once():
    folders = {path.parent.name for path in (PACKAGE / "models").glob("*/unit.py")}
    names = [unit.name for unit in registry.UNITS]
    assert sorted(names) == sorted(folders) and len(set(names)) == len(names)


if __name__ == "__main__":  # prints today's STILL_NAMED_ELSEWHERE, to paste above once a module stops naming a model
    for unit in registry.UNITS:
        files = tuple(name.removeprefix("dstune/") for name in _mentions(unit))
        if files:
            print(f"    {unit.name!r}: {files!r},")
