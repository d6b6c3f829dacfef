"""Loading a spec: safe YAML with line numbers, `--set` overrides, and every error reported at once.

Errors are `SpecIssue`s: the dotted key, the file:line it came from (or `--set`), what is wrong and how to fix it.
`load_spec` raises `SpecError` holding all of them; callers print them and exit 1, never a traceback.
"""

from __future__ import annotations

import difflib
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from pydantic import BaseModel, ValidationError

from dstune.spec.models import FAMILIES, Spec


@dataclass(frozen=True)
class SpecIssue:
    key: str  # dotted path, "" for the whole file
    message: str
    where: str = ""  # "spec.yaml:12", "--set", or ""
    severity: str = "error"  # "error" or "warning"

    def __str__(self) -> str:
        head = f"{self.where}: " if self.where else ""
        key = f"{self.key}: " if self.key else ""
        return f"{head}{key}{self.message}"


class SpecError(Exception):
    def __init__(self, issues: list[SpecIssue]):
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


@dataclass
class SpecSource:
    """Where each dotted key of a spec was written, so later stages (plan, compile) can point at the line too."""

    path: str
    lines: dict[str, int] = field(default_factory=dict)  # dotted key -> 1-based line
    overridden: set[str] = field(default_factory=set)  # keys set by --set

    def where(self, key: str) -> str:
        # The closest written ancestor: an error on train.micro_batch_size points at `train:` if the key is absent.
        probe = key
        while True:
            if probe in self.overridden:
                return "--set"
            if probe in self.lines:
                return f"{self.path}:{self.lines[probe]}"
            if "." not in probe:
                return self.path
            probe = probe.rsplit(".", 1)[0]

    def issue(self, key: str, message: str, severity: str = "error") -> SpecIssue:
        return SpecIssue(key, message, self.where(key), severity)


# ------------------------------------------------------------------------------------------------------ YAML


def _compose(text: str, path: str) -> tuple[Any, dict[str, int]]:
    """Parse YAML safely and record the line of every mapping key. Python tags are rejected by SafeLoader."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.load(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        line = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(err, "problem", None) or str(err)
        hint = ""
        if "python/" in str(err):
            hint = " (specs are data: Python tags such as !!python/object are refused)"
        raise SpecError([SpecIssue("", f"not valid YAML: {problem}{hint}", line)]) from None
    lines: dict[str, int] = {}

    def walk(n: yaml.Node, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                dotted = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines[dotted] = key_node.start_mark.line + 1
                walk(value_node, dotted)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                lines[f"{prefix}.{i}"] = item.start_mark.line + 1
                walk(item, f"{prefix}.{i}")

    if node is not None:
        walk(node, "")
    return data, lines


def parse_override(text: str) -> tuple[str, Any]:
    """`train.micro_batch_size=4` -> ("train.micro_batch_size", 4); the value is read as a YAML scalar or list."""
    if "=" not in text:
        raise SpecError([SpecIssue("", f"--set {text!r}: expected KEY=VALUE, e.g. --set train.micro_batch_size=4", "--set")])
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise SpecError([SpecIssue("", f"--set {text!r}: the key must be a dotted path such as train.optimizer.lr", "--set")])
    try:
        value = yaml.load(raw, Loader=yaml.SafeLoader) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: keep it as the plain string the user typed
    return key, value


def apply_overrides(data: dict, overrides: Iterable[str], source: SpecSource) -> dict:
    for text in overrides:
        key, value = parse_override(text)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError([SpecIssue(key, f"--set cannot go inside {part!r}, which is not a section", "--set")])
            node = child
        node[parts[-1]] = value
        source.overridden.add(key)
    return data


# ------------------------------------------------------------------------------------------- pydantic errors


def _model_at(loc: tuple) -> tuple[Optional[type[BaseModel]], list[str]]:
    """Walk the Spec classes along a pydantic error location; return the model there and the dotted key parts.

    Discriminated unions add the tag (e.g. 'sd') to the location; it is not a key the user wrote, so it is dropped.
    """
    model: Optional[type[BaseModel]] = Spec
    parts: list[str] = []
    for item in loc:
        if model is None:
            parts.append(str(item))
            continue
        if isinstance(item, str) and item in model.model_fields:
            parts.append(item)
            model = _model_in(model.model_fields[item].annotation)
        elif isinstance(item, str) and parts and _is_union_tag(item):
            continue  # the discriminator tag
        else:
            parts.append(str(item))
            model = None
    return model, parts


def _is_union_tag(item: str) -> bool:
    return item in FAMILIES


def _model_in(annotation) -> Optional[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) is typing.Annotated:
        return _model_in(args[0])
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def _describe(err: dict, source: SpecSource) -> SpecIssue:
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent, parts = _model_at(loc[:-1])
        name = str(loc[-1])
        key = ".".join(parts + [name])
        allowed = sorted(parent.model_fields) if parent else []
        close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else (f"; allowed here: {', '.join(allowed)}" if allowed else "")
        return source.issue(key, f"unknown key {name!r}{hint}")
    _, parts = _model_at(loc)
    key = ".".join(parts)
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "missing":
        return source.issue(key, "required key is missing")
    if kind == "union_tag_invalid" or kind == "union_tag_not_found":
        got = err.get("input", {}).get("family") if isinstance(err.get("input"), dict) else None
        close = difflib.get_close_matches(str(got), FAMILIES, n=1, cutoff=0.5) if got else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return source.issue(f"{key}.family" if key else "family", f"{got!r} is not a model family (one of: {', '.join(FAMILIES)}){hint}")
    if "input" in err and kind not in ("value_error", "assertion_error") and not isinstance(err["input"], dict):
        msg = f"{err['input']!r} is invalid: {msg}"
    return source.issue(key, msg)


def validate_data(data: Any, source: SpecSource) -> Spec:
    if not isinstance(data, dict):
        raise SpecError([SpecIssue("", "a spec is a YAML mapping with sections model, data, train, deepspeed, output", source.path)])
    try:
        return Spec.model_validate(data)
    except ValidationError as err:
        issues = [_describe(e, source) for e in err.errors()]
        issues.sort(key=lambda i: line_of(i.where))
        raise SpecError(issues) from None


def line_of(where: str) -> int:
    """The line number at the end of an issue's `where` ("file:12"), 0 when it has none (sorts first)."""
    tail = where.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def json_key_line(text: str, dotted: str) -> int | None:
    """Line of a dotted key in JSON text: each part is searched after its parent. Approximate, good for messages."""
    pos = 0
    for part in dotted.split("."):
        match = re.compile(rf'"{re.escape(part)}"\s*:').search(text, pos)
        if match is None:
            return None
        pos = match.end()
    return text.count("\n", 0, pos) + 1


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> tuple[Spec, SpecSource]:
    """Read, override and validate a spec file; raise SpecError with every problem found."""
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([SpecIssue("", "spec file not found", path)]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError([SpecIssue("", f"cannot read the spec: {err}", path)]) from None
    data, lines = _compose(text, path)
    source = SpecSource(path, lines)
    if data is None:
        data = {}
    if isinstance(data, dict):
        data = apply_overrides(data, overrides, source)
    return validate_data(data, source), source
