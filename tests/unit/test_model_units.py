"""A model is a card and a class in its own unit (dstune/models/<unit>/): its names appear only there and in the
registry's lines, its class reads every constant from its card, and what the shared types in dstune/families/ hold
serves several models, never one."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dstune import registry
from dstune.card import ModelCard, load
from dstune.families.base import TrainedModel
from dstune.spec.section import VIDEO_FAMILY_ALIAS

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dstune"
CONSTANT_KEYS = json.loads((PACKAGE / "model_configs" / "activation_constants.json").read_text())["models"]
UNITS = sorted({card.unit for card in registry.cards()})


def _unit_names(unit: str) -> str:
    return "|".join(card.names for card in registry.cards() if card.unit == unit)


def _mentions(unit: str, names: str, package: Path = PACKAGE) -> list[str]:
    pattern = re.compile(rf"(?<![\w])(?:{names})(?![\w])", re.IGNORECASE)
    own = package / "models" / unit
    return sorted(
        str(path.relative_to(package.parent))
        for path in package.rglob("*.py")
        if own not in path.parents and path != package / "registry.py" and pattern.search(_code(path))
    )


def _code(path: Path) -> str:
    """The file without the cards' `names=` patterns (a pattern that says which names are another model's is not a
    mention of that model) and without the keys of the measured activation constants as string literals (a model
    whose block was not measured names the measured block it is estimated with: the table's key, not its model),
    nor the video core's old family name."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("names=r"))
    for key in CONSTANT_KEYS:
        text = text.replace(f'"{key}"', '""')
    return text.replace(f'"{VIDEO_FAMILY_ALIAS}"', '""')  # the video core's old family name, not a model's


def test_each_model_is_named_only_in_its_unit_and_the_registry():
    outside = {unit: _mentions(unit, _unit_names(unit)) for unit in UNITS}
    assert {unit: files for unit, files in outside.items() if files} == {}


def test_the_name_check_sees_a_mention_and_ignores_the_unit_and_the_registry(tmp_path):
    """On a copy-shaped package: a mention in a core module is found; the unit's own files and the registry's are
    not counted (so the empty result above means something)."""
    package = tmp_path / "dstune"
    for relative, text in {
        "families/video_card.py": '"""Trains Wan 2.1 clips."""',
        "models/wan/model.py": "WAN = 1",
        "registry.py": '"dstune.models.wan.card:WAN_CARD"',
        "families/flow_card.py": '"""No video model here; wanted: nothing."""',
    }.items():
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(text + "\n")
    assert _mentions("wan", _unit_names("wan"), package) == ["dstune/families/video_card.py"]


def test_the_registry_and_every_card_import_no_torch():
    code = "from dstune import registry; import sys; registry.cards(); assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_every_unit_folder_has_a_card_and_a_class_and_is_registered():
    """A unit is `card.py` (its cards) and `model.py` (their classes); every card is in the registry once."""
    folders = {path.parent.name for path in (PACKAGE / "models").glob("*/card.py")}
    classes = {path.parent.name for path in (PACKAGE / "models").glob("*/model.py")}
    keys = [card.key for card in registry.cards()]
    assert folders == classes == set(UNITS)
    assert len(set(keys)) == len(keys) and len(set(registry.CARDS)) == len(registry.CARDS)


@pytest.mark.parametrize("card", registry.cards(), ids=lambda card: card.key)
def test_each_model_is_its_card_and_one_class_one_level_below_its_core(card):
    """The card lists the model's class; the class is in the unit's model.py, a TrainedModel whose base is a core's
    class from dstune/families/ (one level below it, never two)."""
    assert isinstance(card, ModelCard) and dataclasses.is_dataclass(card)
    model_class = load(card.model_class)
    assert card.model_class.startswith(f"dstune.models.{card.unit}.model:")
    assert issubclass(model_class, TrainedModel)
    (base,) = model_class.__bases__
    assert base.__module__.startswith("dstune.families."), f"{model_class.__name__}'s base {base.__name__}"


def test_every_builtin_is_its_cards_own():
    """A card's `builtins` names each BuiltinModel by its own name and family (the table the built-in cache reads)."""
    wrong = [
        (card.key, name)
        for card in registry.cards()
        for name, where in card.builtins.items()
        if load(where).name != name or load(where).family != card.family
    ]
    assert wrong == []


# ------------------------------------------------------------------------------- the card's literals, once

# Card fields that are not constants a class could read: names and prose, and what the registry alone reads.
NOT_CONSTANTS = {"key", "name", "family", "unit", "model_class", "docs", "names", "summary", "spec_notes", "builtins"}
NOT_CONSTANTS |= {"activation_cases", "presets", "checkpoint_layouts", "lora_loader"}


def _literals(value) -> set:
    """The distinctive literals of a card's value: strings that are not plain lower-case names (a class name, a
    pipeline, a phrase; a lower-case name such as "encoder_hidden_states" or "text_encoder" is a key of the data or
    of the folder, which the class uses as a name) and numbers that are not small integers (0 to 8 could be
    anything in a training step)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return set().union(*(_literals(getattr(value, f.name)) for f in dataclasses.fields(value)))
    if isinstance(value, dict):
        return set().union(set(), *map(_literals, value.keys()), *map(_literals, value.values()))
    if isinstance(value, (tuple, list, set, frozenset)):
        return set().union(set(), *map(_literals, value))
    if isinstance(value, str):
        return set() if re.fullmatch(r"[a-z0-9_.]*", value) else {value}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return set() if float(value).is_integer() and abs(value) <= 8 else {value}
    return set()


def card_literals(card: ModelCard) -> set:
    """The literals of the card's fields and of its module's constants (the UPPER_CASE names of its card.py)."""
    fields = (getattr(card, f.name) for f in dataclasses.fields(card) if f.name not in NOT_CONSTANTS)
    module = importlib.import_module(f"dstune.models.{card.unit}.card")
    constants = (value for name, value in vars(module).items() if name.isupper() and not isinstance(value, ModelCard))
    return set().union(*map(_literals, fields), *map(_literals, constants))


# The same number with another meaning in a unit's torch side: (unit, value) -> what it is there.
COINCIDENCES = {("ltx2", 1024): "the audio STFT's n_fft, and the token count ltx-trainer's sigma shift starts at"}


def restated(card_values: set, source: str, unit: str = "") -> list[str]:
    """The literals of `source` that restate a card value (`line: value`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Constant) or isinstance(node.value, bool) or (unit, node.value) in COINCIDENCES:
            continue
        if any(node.value == value and type(node.value) is type(value) for value in card_values):
            found.append((node.lineno, f"{node.lineno}: {node.value!r}"))
    return [text for _, text in sorted(found)]


def _class_modules(unit: str) -> list[Path]:
    """The unit's torch side: every module but its card, its spec section and its built-in tiny models."""
    folder = PACKAGE / "models" / unit
    return [
        p
        for p in sorted(folder.glob("*.py"))
        if p.name not in ("card.py", "spec.py", "__init__.py") and not p.name.startswith("builtin")
    ]


@pytest.mark.parametrize("unit", UNITS)
def test_the_class_reads_its_constants_from_its_card(unit):
    """No literal of a card (a class name, a length, a rate, a guidance: every distinctive value of its fields) is
    written again in the unit's torch side: the class reads it from `self.card`. How: the card's field values,
    recursively, against every constant in the AST of the unit's modules other than card.py, spec.py and the
    built-ins."""
    values = set().union(*(card_literals(card) for card in registry.cards() if card.unit == unit))
    found = {path.name: restated(values, path.read_text(), unit) for path in _class_modules(unit)}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_literal_check_finds_a_restated_constant():
    card = registry.card("ltx2")
    source = "class Ltx2:\n    fps = 24.0\n    steps = 4\n    name = 'LTX2VideoTransformer3DModel'\n"
    assert restated(card_literals(card), source) == ["2: 24.0", "4: 'LTX2VideoTransformer3DModel'"]


# ----------------------------------------------------------------- shared types serve several models, never one


def _shared_card_types() -> set[type]:
    """The card types of dstune/families/ and dstune/card.py (the ones several units' cards are made of)."""
    found = set()
    for card in registry.cards():
        for kind in type(card).__mro__:
            if dataclasses.is_dataclass(kind) and kind.__module__.split(".")[:2] in (
                ["dstune", "families"],
                ["dstune", "card"],
            ):
                found.add(kind)
    return found


def _set_values(kind: type, value_of) -> dict[str, set[str]]:
    """field -> the units whose card sets it to other than its default (a field without a default: every unit)."""
    out = {}
    for field in dataclasses.fields(kind):
        if field.name not in kind.__dict__.get("__annotations__", {}):
            continue  # declared by a base type: counted there
        default = (
            field.default
            if field.default is not dataclasses.MISSING
            else (field.default_factory() if field.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        )
        out[field.name] = {
            unit for unit, value in value_of(field.name) if default is dataclasses.MISSING or value != default
        }
    return out


def fields_set_by_one_unit() -> dict[str, set[str]]:
    """'Type.field' -> the one unit that sets it, for every field of a shared card type (and of the shared
    dataclasses held in card fields) set by a single unit."""
    single = {}
    for kind in _shared_card_types():
        cards = [card for card in registry.cards() if isinstance(card, kind)]
        counts = _set_values(kind, lambda name: [(card.unit, getattr(card, name)) for card in cards])
        single.update({f"{kind.__name__}.{name}": units for name, units in counts.items() if len(units) == 1})
    held = {}
    for card in registry.cards():
        for field in dataclasses.fields(card):
            value = getattr(card, field.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                held.setdefault(type(value), []).append((card.unit, value))
    for kind, pairs in held.items():
        if kind.__module__.startswith("dstune.families.") or kind.__module__ == "dstune.card":
            counts = _set_values(kind, lambda name: [(unit, getattr(value, name)) for unit, value in pairs])
            single.update({f"{kind.__name__}.{name}": units for name, units in counts.items() if len(units) == 1})
    return single


def test_no_shared_card_field_is_set_by_only_one_unit():
    """A field of a shared type that one model alone sets is a hook for that model: it belongs in its unit's own
    card type. The count is over units (SD and SDXL are one unit), a card setting a field to other than its
    default."""
    assert fields_set_by_one_unit() == {}


def test_the_count_finds_a_field_only_one_unit_sets():
    @dataclasses.dataclass(frozen=True)
    class Holder:
        rows: str = "as_cached"
        width: int = 0

    values = {"rows": [("wan", "trimmed"), ("flux2", "as_cached")], "width": [("a", 1), ("b", 2)]}
    assert _set_values(Holder, values.get) == {"rows": {"wan"}, "width": {"a", "b"}}


# ------------------------------------------------------------------------------ typed callables, not bare ones


def bare_callable_fields(root: Path) -> list[str]:
    """`file:line field` of every dataclass field in `root` annotated with a bare Callable (no signature)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or not any(
                "dataclass" in ast.unparse(decorator) for decorator in node.decorator_list
            ):
                continue
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and _bare_callable(item.annotation):
                    found.append(f"{path.relative_to(root.parent)}:{item.lineno} {ast.unparse(item.target)}")
    return found


def _bare_callable(annotation: ast.AST) -> bool:
    subscripted = {id(node.value) for node in ast.walk(annotation) if isinstance(node, ast.Subscript)}
    return any(
        (
            isinstance(node, ast.Name)
            and node.id == "Callable"
            or isinstance(node, ast.Attribute)
            and node.attr == "Callable"
        )
        and id(node) not in subscripted
        for node in ast.walk(annotation)
    ) or (
        isinstance(annotation, ast.Constant)
        and isinstance(annotation.value, str)
        and _bare_callable(ast.parse(annotation.value, mode="eval").body)
    )


def test_no_dataclass_field_is_a_bare_callable():
    assert bare_callable_fields(PACKAGE) == []


def test_the_callable_check_finds_one(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "from dataclasses import dataclass\nfrom typing import Callable, Optional\n\n@dataclass\nclass A:\n"
        "    f: Callable\n    g: Optional[Callable] = None\n    h: Callable[[int], int] = abs\n"
    )
    assert bare_callable_fields(package) == ["pkg/a.py:6 f", "pkg/a.py:7 g"]


def test_every_section_a_unit_owns_imports_first_in_a_fresh_process():
    """A unit's spec section is importable before anything else of dstune (no import circle through the spec's
    union, which the registry assembles from these very sections)."""
    modules = sorted({where.partition(":")[0] for where in registry.FAMILY_SECTIONS})
    assert modules
    for module in modules:
        done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 0, f"{module}: {done.stderr[-500:]}"
