"""The registry of the models dstune trains: one line per unit (dstune/models/<name>/unit.py), and everything the
rest of dstune derives from it: the families the units own (dstune.families), their torch-free facts, the recipes
they add to the shared flow-matching cores (image: dstune.families.flow, video: dstune.families.video), the built-in
tiny models (dstune.builtin), the `dstune init --model` presets (dstune.spec.presets) and the docs' model lists.

Adding a model adds one unit folder and one line here (docs/architecture.md, "How to add a model"). Torch-free and
cheap: the units name their torch sides as "module:ATTRIBUTE" text, loaded on first use (dstune.models.unit.load).
"""

from __future__ import annotations

from dstune.models.csm.unit import UNIT as CSM
from dstune.models.dia.unit import UNIT as DIA
from dstune.models.ernie_image.unit import UNIT as ERNIE_IMAGE
from dstune.models.flux2.unit import UNIT as FLUX2
from dstune.models.hunyuan_video15.unit import UNIT as HUNYUAN_VIDEO15
from dstune.models.ideogram4.unit import UNIT as IDEOGRAM4
from dstune.models.krea2.unit import UNIT as KREA2
from dstune.models.ltx2.unit import UNIT as LTX2
from dstune.models.qwen_image.unit import UNIT as QWEN_IMAGE
from dstune.models.qwen_image_21.unit import UNIT as QWEN_IMAGE_21
from dstune.models.sd.unit import UNIT as SD
from dstune.models.sd3_flux.unit import UNIT as SD3_FLUX
from dstune.models.speecht5.unit import UNIT as SPEECHT5
from dstune.models.tts_lm.unit import UNIT as TTS_LM
from dstune.models.unit import ModelPreset, ModelUnit
from dstune.models.vibevoice.unit import UNIT as VIBEVOICE
from dstune.models.wan.unit import UNIT as WAN
from dstune.models.zimage.unit import UNIT as ZIMAGE

# The order is the docs' and `dstune init`'s: images (UNet, then the flow-matching transformers), video, speech.
UNITS: tuple[ModelUnit, ...] = (
    SD,
    SD3_FLUX,
    QWEN_IMAGE,
    ZIMAGE,
    FLUX2,
    IDEOGRAM4,
    KREA2,
    QWEN_IMAGE_21,
    ERNIE_IMAGE,
    WAN,
    HUNYUAN_VIDEO15,
    LTX2,
    TTS_LM,
    CSM,
    DIA,
    VIBEVOICE,
    SPEECHT5,
)


def family_modules() -> dict[str, str]:
    """model.family -> the module of its Family, for the families a unit owns (the cores are dstune.families')."""
    return {family: module for unit in UNITS for family, module in unit.families.items()}


def spec_sections() -> tuple[str, ...]:
    """The `model` sections of the families the units own, as "module:ATTRIBUTE" (dstune.spec.models' union)."""
    return tuple(where for unit in UNITS for where in unit.spec_sections)


def on_core(core: str) -> tuple[ModelUnit, ...]:
    """The units whose models are recipes on the shared core family `core` ("flow", or the video family)."""
    return tuple(unit for unit in UNITS if core in unit.recipes)


def pipelines(core: str) -> dict[str, float]:
    """{pipeline class: its default sampling guidance} of every model on the core family `core`."""
    return {name: guidance for unit in on_core(core) for name, guidance in unit.pipelines.items()}


def spec_notes(core: str, key: str) -> str:
    """What the units on the core family `core` say of their own default for `key`, one model after another."""
    return " / ".join(unit.spec_notes[key] for unit in on_core(core) if key in unit.spec_notes)


def facts() -> tuple[str, ...]:
    """Every unit's own families' ModelFacts, as "module:ATTRIBUTE"."""
    return tuple(where for unit in UNITS for where in unit.facts)


def recipes(core: str) -> tuple[str, ...]:
    """The recipes the units add to the shared core family `core` ("flow", "wan"), as "module:ATTRIBUTE"."""
    return tuple(where for unit in UNITS for where in unit.recipes.get(core, ()))


def flow_models() -> tuple[str, ...]:
    """The units' rows of the flow core's torch-free table, as "module:ATTRIBUTE"."""
    return tuple(where for unit in UNITS for where in unit.flow_models)


def video_facts() -> tuple[str, ...]:
    """The units' VideoFacts for the video core's torch-free facts, as "module:ATTRIBUTE"."""
    return tuple(where for unit in UNITS for where in unit.video_facts)


def activation_cases() -> tuple[str, ...]:
    """The units' activation measurement cases (tuples of dstune.memory.activation_cases.Case), as "module:ATTRIBUTE"."""
    return tuple(where for unit in UNITS for where in unit.activation_cases)


def builtins() -> tuple[str, ...]:
    """Every built-in tiny model, as "module:ATTRIBUTE" of its BuiltinModel."""
    return tuple(where for unit in UNITS for where in unit.builtins.values())


def builtin_names() -> tuple[str, ...]:
    """Every built-in tiny model's name (`builtin:` + it), without loading any."""
    return tuple(name for unit in UNITS for name in unit.builtins)


def checkpoint_layouts() -> dict[str, tuple[str, str]]:
    """Key prefixes of the units' original single-file checkpoints -> (family, what the file is)."""
    return {prefix: layout for unit in UNITS for prefix, layout in unit.checkpoint_layouts.items()}


def presets() -> tuple[ModelPreset, ...]:
    """Every `dstune init --model` preset, in the units' order."""
    return tuple(preset for unit in UNITS for preset in unit.presets)
