"""Documentation generated from the spec's own field descriptions: the spec reference and the `dstune init` example.

Both walk the pydantic models in dstune/spec/models.py, so a field added there shows up in `docs/spec-reference.md`
and in `dstune init` without anyone writing it twice. `python -m dstune.reference > docs/spec-reference.md`.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Iterator, Literal

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from dstune.spec.models import AUDIO_FAMILIES, VIDEO_FAMILIES, Spec
from dstune.spec.section import CODEC_TOKEN_FAMILIES
from dstune import registry

# Values the `init` example uses where the default is not what a first run wants. The example must validate as
# printed on any world size (micro + accumulation given, global derived) and name the built-in model and data.
EXAMPLE_VALUES: dict[str, Any] = {
    "train.micro_batch_size": 4,
    "train.gradient_accumulation_steps": 1,
    "train.max_steps": 200,
    "train.scheduler.type": "cosine",
    "train.scheduler.warmup_steps": 20,
    "sample.prompts": ["a red circle", "a blue square", "a yellow triangle"],
    "sample.every_steps": 100,
}
# Shown commented out (the field is omitted by default): what a user would typically write there.
COMMENTED_VALUES: dict[str, Any] = {
    "model.prediction": "epsilon",
    "model.min_snr_gamma": 5.0,
    "train.global_batch_size": 64,
    "train.epochs": 10,
    "train.reference_batch_size": 64,
    "train.gradient_clipping": 1.0,
    "deepspeed.offload_optimizer.nvme_path": "/local_nvme",
    "deepspeed.offload_param.nvme_path": "/local_nvme",
    "deepspeed.activation_checkpointing.number_checkpoints": 4,
    "deepspeed.config": "my_ds_config.json",
    "output.save_every_steps": 500,
}


# What `dstune init --model` leaves out: the keys a family's data or samples never read, by what it trains on.
SPEECH_ONLY_KEYS = (
    "data.min_clip_seconds",
    "data.max_clip_seconds",
    "data.duration_bucket_seconds",
    "data.speaker_balance",
    "data.speakers",
    "data.cache.codec_tokens",
)
PICTURE_ONLY_KEYS = (
    "data.resolution",
    "data.center_crop",
    "data.random_flip",
    "data.caption_dropout",
    "data.caption_extension",
    "data.cache.latents",
    "data.cache.text_embeddings",
    "data.buckets",
    "data.eval",
    "data.control_dir",
    "data.video",
    "sample.steps",
    "sample.guidance",
    "sample.control_images",
)
# The shared values of a model's spec; its ModelPreset's values go over them.
MODEL_EXAMPLE_VALUES: dict[str, Any] = {
    "train.micro_batch_size": 1,
    "train.gradient_accumulation_steps": 1,
    "train.max_steps": 2000,
    "train.precision": "bf16",
    "train.scheduler.type": "constant_with_warmup",
    "train.scheduler.warmup_steps": 100,
    "sample.every_steps": 500,
    "output.save_every_steps": 500,
}


def left_out_keys(family: str) -> set[str]:
    """The dotted keys `dstune init --model` omits for a family (its data and samples never read them)."""
    if family in AUDIO_FAMILIES:
        voice = {"sample.voice_prompts"} if family != "tts_codebooks" else set()
        return (
            set(PICTURE_ONLY_KEYS)
            | voice
            | ({"data.cache.codec_tokens"} if family not in CODEC_TOKEN_FAMILIES else set())
        )
    left_out = set(SPEECH_ONLY_KEYS) | {"sample.voice_prompts"}
    if family in VIDEO_FAMILIES:
        return left_out | {"data.random_flip", "data.eval", "data.control_dir"}
    if family != "flow":  # edit training (source images) is the flow edit models' only
        left_out |= {"data.control_dir", "sample.control_images"}
    return left_out | {"data.video"}


# ------------------------------------------------------------------------------------------------- introspection


def family_models() -> dict[str, type[BaseModel]]:
    """{family name: model section class}, read from the discriminated union on Spec.model."""
    annotation = Spec.model_fields["model"].annotation
    members = typing.get_args(annotation) or (annotation,)
    out = {}
    for member in members:
        family = typing.get_args(member.model_fields["family"].annotation)[0]  # the name; later ones: old names
        out[family] = member
    return out


def _section_class(annotation) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _optional_section_class(annotation) -> type[BaseModel] | None:
    """X for `Optional[X]` with X a section (train.ema, model.lora): documented in full in the reference, though
    `dstune init` leaves such sections out (absent means off)."""
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    return _section_class(members[0]) if len(members) == 1 else None


def _item_section_class(annotation) -> type[BaseModel] | None:
    """X for `Optional[list[X]]` with X a section (data.sets): its keys documented as `key.N.name`."""
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(members) != 1 or typing.get_origin(members[0]) is not list:
        return None
    return _section_class(typing.get_args(members[0])[0])


def _section_classes(family: str) -> dict[str, type[BaseModel]]:
    return {
        name: family_models()[family] if name == "model" else _section_class(info.annotation)
        for name, info in Spec.model_fields.items()
    }


def _walk(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, FieldInfo, type[BaseModel] | None]]:
    """(dotted key, field, its section class or None) for every field, depth first in declaration order."""
    for name, info in model.model_fields.items():
        yield f"{prefix}.{name}", info, _section_class(info.annotation)


def _default(info: FieldInfo) -> Any:
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.default_factory()
    return PydanticUndefined


def _type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " or ".join(f"`{a}`" for a in args)
    if origin is typing.Union:
        named = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (", or omitted" if type(None) in args else "")
    if origin in (tuple, list):
        if origin is tuple:
            return "[" + ", ".join(_type_name(a) for a in args) + "]"
        return f"list of {_type_name(args[0])}"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(info: FieldInfo) -> str:
    parts = []
    for item in info.metadata:
        for kind, symbol, attr in ((Gt, ">", "gt"), (Ge, ">=", "ge"), (Lt, "<", "lt"), (Le, "<=", "le")):
            if isinstance(item, kind):
                parts.append(f"{symbol} {getattr(item, attr)}")
    return ", ".join(parts)


def yaml_value(value: Any) -> str:
    """One value as YAML flow text that reads back as the same value (1e-05 is written 1.0e-05, which YAML 1.1
    reads as a float, not a string)."""
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


# ----------------------------------------------------------------------------------------------- spec reference


def reference_markdown() -> str:
    lines = [
        "# Spec reference",
        "",
        "<!-- Generated from the field descriptions in dstune/spec/models.py by `python -m dstune.reference`"
        " (`make docs`). Do not edit by hand: a test regenerates it. -->",
        "",
        'A spec is one YAML file with the sections below. Unknown keys are errors (with a "did you mean"), every '
        "error is reported at once with its file:line, and any key can be overridden from the command line with "
        "`--set section.key=value`. `dstune init` prints a commented example; `dstune schema` prints the JSON "
        "schema for editor completion. How the batch numbers, epochs and steps fit together: "
        "[batches and epochs](batches-and-epochs.md).",
        "",
        *model_table(),
    ]
    for family, model in family_models().items():
        lines += _section_markdown(
            "model", model, Spec.model_fields["model"].description or "", title=f"`model` (family `{family}`)"
        )
    for name, info in Spec.model_fields.items():
        section = _section_class(info.annotation)
        if name != "model" and section is not None:
            lines += _section_markdown(name, section, info.description or "")
    return "\n".join(lines).rstrip() + "\n"


def model_table() -> list[str]:
    """The models dstune trains, one row per card (dstune.registry): the family, how a folder is recognised, the
    default sampling guidance of each folder class, the model's own defaults and its built-in tiny models."""
    lines = [
        "## Models",
        "",
        "`model.family` names the core that trains a model; the folder `model.pretrained` points at tells which of "
        "its models it is. `sample.guidance` left out takes the default of the folder's pipeline (or class).",
        "",
        "| family | model | folder | sampling guidance | own defaults | built-in tiny models |",
        "|---|---|---|---|---|---|",
    ]
    for card in registry.cards():
        guidance = ", ".join(
            f"{name} {value:g}" if value is not None else f"{name}: none" for name, value in card.folder_classes.items()
        )
        notes = "; ".join(f"`{key}` {note}" for key, note in card.spec_notes.items())
        builtins = ", ".join(f"`builtin:{name}`" for name in card.builtins)
        lines.append(
            f"| `{card.family}` | {card.name} ([docs]({Path(card.docs).name})) | {_cell(card.summary)} | "
            f"{guidance} | {_cell(notes)} | {builtins} |"
        )
    return lines + [""]


def _section_markdown(key: str, model: type[BaseModel], description: str, title: str = "") -> list[str]:
    lines = [
        f"## {title or f'`{key}`'}",
        "",
        description,
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
    ]
    subsections = []
    for dotted, info, section in _walk(model, key):
        optional = section is None and _optional_section_class(info.annotation) is not None
        section = section or _optional_section_class(info.annotation)
        items = _item_section_class(info.annotation) if section is None else None
        if items is not None:  # a list of sections: one subsection for what each item takes
            subsections.append((f"{dotted}.N", items, items.__doc__ or ""))
            link = f"[`{dotted}.N`](#{_anchor(dotted + '.N')})"
            lines.append(f"| `{dotted}` | list of sections | omitted | {_cell(info.description)} Each: {link}. |")
            continue
        if section is not None:
            subsections.append((dotted, section, info.description or ""))
            link = f"[`{dotted}`](#{_anchor(dotted)})"
            shown = "omitted" if optional else ""
            lines.append(f"| `{dotted}` | section | {shown} | {_cell(info.description)} See {link}. |")
            continue
        default = _default(info)
        if default is PydanticUndefined:
            shown = "required"
        else:
            shown = "omitted" if default is None else f"`{yaml_value(default)}`"
        kind = _type_name(info.annotation)
        limits = _constraints(info)
        lines.append(
            f"| `{dotted}` | {_cell(kind)}{f' ({limits})' if limits else ''} | {_cell(shown)} | "
            f"{_cell(info.description)} |"
        )
    lines.append("")
    for dotted, section, text in subsections:
        lines += _section_markdown(dotted, section, text)
    return lines


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def _anchor(dotted: str) -> str:
    return dotted.replace(".", "").lower()


# ---------------------------------------------------------------------------------------------- init example


def example_spec(family: str = "sd") -> str:
    """A commented spec with every section and key, `key: value  # description`; it validates as printed."""
    if family not in family_models():
        raise ValueError(f"unknown family {family!r}; known: {', '.join(family_models())}")
    lines = [
        f"# A dstune spec (written by `dstune init --family {family}` from the field descriptions).",
        "# It trains the built-in tiny model on the built-in shapes data and runs as printed.",
        "# Check what it does on your GPUs:  dstune validate spec.yaml --num-gpus 8",
        "# Every key is optional unless noted; keys left out take the values shown. Commented lines are",
        "# settings that are off by default, with a typical value. Reference: docs/spec-reference.md",
    ]
    for name, section in _section_classes(family).items():
        lines += ["", f"# {Spec.model_fields[name].description}", f"{name}:"]
        lines += _section_yaml(section, name, indent=1, family=family)
    return "\n".join(lines) + "\n"


def model_spec(name: str) -> str:
    """`dstune init --model NAME`: the spec of one model with its real defaults and only its family's keys."""
    preset = registry.preset(name)
    values = {
        **MODEL_EXAMPLE_VALUES,
        "output.dir": f"runs/{preset.name}",
        "model.pretrained": preset.pretrained,
        **preset.values,
    }
    lines = [
        f"# {preset.title}: written by `dstune init --model {preset.name}`.",
        f"# model.pretrained is the published checkpoint, {preset.pretrained} (download it first: `hf download "
        f"{preset.pretrained}`);",
        f"# builtin:{preset.builtin} is a tiny model of the same layout that is built offline, for a first try.",
        "# data.path is a placeholder: point it at your data. Plan a run:  dstune validate spec.yaml --num-gpus 8",
        "# Keys left out take their defaults; commented lines are off by default. Reference: docs/spec-reference.md",
    ]
    left_out = left_out_keys(preset.family)
    for section, model in _section_classes(preset.family).items():
        lines += ["", f"# {Spec.model_fields[section].description}", f"{section}:"]
        lines += _section_yaml(model, section, indent=1, family=preset.family, values=values, left_out=left_out)
    return "\n".join(lines) + "\n"


def _section_yaml(
    model: type[BaseModel], key: str, indent: int, family: str, values=None, left_out: set[str] = frozenset()
) -> list[str]:
    rows = _rows(model, key, indent, family, EXAMPLE_VALUES if values is None else values, left_out)
    width = max(len(text) for text, _ in rows)  # one comment column per top-level section
    return [f"{text.ljust(width)}  # {comment}" if comment else text for text, comment in rows]


def _rows(
    model: type[BaseModel], key: str, indent: int, family: str, values: dict[str, Any], left_out: set[str]
) -> list[tuple[str, str]]:
    """(YAML text, description) for each field; a nested section adds its own rows, indented."""
    pad = "  " * indent
    rows: list[tuple[str, str]] = []
    for dotted, info, section in _walk(model, key):
        name = dotted.rsplit(".", 1)[1]
        if dotted in left_out:
            continue
        if section is not None:
            rows.append((f"{pad}{name}:", info.description or ""))
            rows += _rows(section, dotted, indent + 1, family, values, left_out)
        else:
            rows.append(_field_row(dotted, name, info, pad, family, values))
    return rows


def _field_row(
    dotted: str, name: str, info: FieldInfo, pad: str, family: str, values: dict[str, Any]
) -> tuple[str, str]:
    comment = info.description or ""
    if dotted == "model.family":
        return f"{pad}family: {family}", comment
    if dotted in values and values is not EXAMPLE_VALUES:  # a model's own value comes first
        return f"{pad}{name}: {yaml_value(values[dotted])}", comment
    if dotted == "data.path" and family in AUDIO_FAMILIES:  # speech families need speech data
        return f"{pad}{name}: builtin:tones", comment
    if dotted == "data.path" and family in VIDEO_FAMILIES:  # video families: clips that move
        return f"{pad}{name}: builtin:moving-shapes", comment
    if dotted in values:
        return f"{pad}{name}: {yaml_value(values[dotted])}", comment
    default = _default(info)
    if default is None or default is PydanticUndefined:
        example = COMMENTED_VALUES.get(dotted)
        return f"{pad}# {name}: {'' if example is None else yaml_value(example)}".rstrip(), comment
    return f"{pad}{name}: {yaml_value(default)}", comment


if __name__ == "__main__":
    print(reference_markdown(), end="")
