"""Loading a spec: safe YAML with line numbers, `--set` overrides, and every error reported at once.

Errors are `SpecIssue`s: the dotted key, the file:line it came from (or `--set`), what is wrong and how to fix it.
`load_spec` raises `SpecError` holding all of them; callers print them and exit 1, never a traceback.
YAML that would expand or silently drop part of a spec is refused at its line: aliases of sections and lists,
keys written twice, merge keys (`<<`); so are files over 1 MB, 10,000 values or 32 levels (answered in about 1 s).
"""

from __future__ import annotations

import difflib
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import yaml
from pydantic import BaseModel, ValidationError

from dstune.spec.models import BATCH_FROM_FILE, FAMILIES, Spec
from dstune.spec.yaml_checks import split_prompt_lists
from dstune.spec.paths import rebase_relative_paths
from dstune.spec.section import VIDEO_FAMILY, VIDEO_FAMILY_ALIAS


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
    # Keys the spec leaves unset whose value came from the user's DeepSpeed JSON: key -> "ds.json:12" (its line there)
    filled: dict[str, str] = field(default_factory=dict)
    warnings: list[SpecIssue] = field(default_factory=list)  # what loading noticed but did not refuse

    def where(self, key: str) -> str:
        # The closest written ancestor: an error on train.micro_batch_size points at `train:` if the key is absent.
        probe = key
        while True:
            if probe in self.overridden:
                return "--set"
            if probe in self.filled:
                return self.filled[probe]
            if probe in self.lines:
                return f"{self.path}:{self.lines[probe]}"
            if "." not in probe:
                return self.path
            probe = probe.rsplit(".", 1)[0]

    def from_command_line(self, key: str) -> bool:
        parts = key.split(".")  # --set gave this key, or a section above it
        return any(".".join(parts[:n]) in self.overridden for n in range(1, len(parts) + 1))

    def issue(self, key: str, message: str, severity: str = "error") -> SpecIssue:
        return SpecIssue(key, message, self.where(key), severity)


# ------------------------------------------------------------------------------------------------------ YAML

MAX_SPEC_BYTES = 1 << 20  # a longer file is refused unread: a spec is settings, not data
MAX_YAML_VALUES = 10_000  # keys, values and list items together; a real spec has a few hundred
MAX_YAML_DEPTH = 32  # nested sections and lists; a real spec has four or five
MAX_ISSUES = 100  # errors described in full; past them, one line says how many more there are
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Refused(Exception):
    """A YAML feature or size a spec may not use, met while composing: nothing past it is built."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line, self.message = line, message


class _LimitedComposer(yaml.composer.Composer):
    """PyYAML's composer, counting as it goes and refusing an alias of a section or list when it reads it.

    Such an alias is what lets a few hundred bytes (`&a [*b, *b, ...]`, nine levels deep) stand for a billion
    values: PyYAML shares the node, but everything that walks the spec (key lines, pydantic) expands it.
    """

    def compose_node(self, parent, index):
        event = self.peek_event()
        line = event.start_mark.line + 1
        self.values += 1
        if self.values > MAX_YAML_VALUES:
            raise _Refused(
                line,
                f"more than {MAX_YAML_VALUES} keys and values; a spec is settings, not data "
                "(it names files and folders for anything large)",
            )
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if isinstance(target, yaml.CollectionNode):
                raise _Refused(
                    line,
                    f"alias *{event.anchor} repeats the section or list anchored (&{event.anchor}) at "
                    f"line {target.start_mark.line + 1}; aliases of sections and lists are refused "
                    "(a few of them can stand for billions of values): write the keys out",
                )
            return super().compose_node(parent, index)  # an alias of a single value (or an undefined one: an error)
        if self.depth >= MAX_YAML_DEPTH:
            raise _Refused(line, f"nested more than {MAX_YAML_DEPTH} levels deep; a spec is a few sections of settings")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when installed: 1 MB in well under 1 s


class _SpecLoader(_LimitedComposer, _BASE_LOADER):
    """Safe tags only (Python tags are refused by SafeConstructor), composed by `_LimitedComposer`."""

    def __init__(self, stream: str):
        _BASE_LOADER.__init__(self, stream)
        yaml.composer.Composer.__init__(self)
        self.values, self.depth = 0, 0


def _parse(text: str, path: str) -> tuple[Any, dict[str, int], list[SpecIssue]]:
    """The data of one YAML document, the line of each dotted key and warnings (prompt lists split at commas),
    within the limits above.

    Raises SpecError for what a spec refuses (at path:line, or at "--set"), YAMLError for what is not YAML.
    """
    where = (lambda line: path) if path == "--set" else (lambda line: f"{path}:{line}")
    loader = _SpecLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except _Refused as err:
            raise SpecError([SpecIssue("", err.message, where(err.line))]) from None
        if node is None:
            return None, {}, []
        lines, issues = _key_lines(node, where)  # before constructing, which merges `<<` keys into the node
        if issues:
            raise SpecError(_at_most(issues, len(issues), path))
        warnings = [SpecIssue(key, text, where(line), "warning") for key, line, text in split_prompt_lists(node)]
        return loader.construct_document(node), lines, warnings
    finally:
        loader.dispose()


def _yaml_issue(err: yaml.YAMLError, path: str) -> SpecIssue:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    line = f"{path}:{mark.line + 1}" if mark is not None else path
    problem = getattr(err, "problem", None) or str(err)
    hint = ""
    if "python/" in str(err):
        hint = " (specs are data: Python tags such as !!python/object are refused)"
    return SpecIssue("", f"not valid YAML: {problem}{hint}", line)


def _key_lines(node: yaml.Node, where: Callable[[int], str]) -> tuple[dict[str, int], list[SpecIssue]]:
    """The line of every dotted key, and an issue for each key written twice and each merge key (`<<`).

    PyYAML keeps the last of two equal keys and lets keys written beside `<<` win over the merged ones, silently
    discarding the others; a spec refuses both so that what runs is what the file says.
    """
    lines: dict[str, int] = {}
    issues: list[SpecIssue] = []

    def walk(n: yaml.Node, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for key_node, value_node in n.value:
                dotted = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                line = key_node.start_mark.line + 1
                if key_node.tag == _MERGE_TAG:
                    issues.append(
                        SpecIssue(
                            prefix,
                            "merge keys (<<) are refused: PyYAML silently drops the merged keys "
                            "also written beside them; write the keys out",
                            where(line),
                        )
                    )
                elif isinstance(key_node, yaml.ScalarNode) and (key_node.tag, key_node.value) in seen:
                    first = seen[(key_node.tag, key_node.value)]
                    at = f", at lines {first} and {line}" if first != line else ""
                    issues.append(
                        SpecIssue(
                            dotted,
                            f"written twice{at}; YAML would silently keep only the last: remove one",
                            where(line),
                        )
                    )
                elif isinstance(key_node, yaml.ScalarNode):
                    seen[(key_node.tag, key_node.value)] = line
                lines[dotted] = line
                walk(value_node, dotted)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                lines[f"{prefix}.{i}"] = item.start_mark.line + 1
                walk(item, f"{prefix}.{i}")

    walk(node, "")
    return lines, issues


def _compose(text: str, path: str) -> tuple[Any, dict[str, int], list[SpecIssue]]:
    """Parse YAML safely and record the line of every mapping key; every refusal names its line."""
    try:
        return _parse(text, path)
    except yaml.YAMLError as err:
        raise SpecError([_yaml_issue(err, path)]) from None


def parse_override(text: str) -> tuple[str, Any]:
    """`train.micro_batch_size=4` -> ("train.micro_batch_size", 4); the value is read as a YAML scalar or list."""
    if "=" not in text:
        raise SpecError(
            [SpecIssue("", f"--set {text!r}: expected KEY=VALUE, e.g. --set train.micro_batch_size=4", "--set")]
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise SpecError(
            [SpecIssue("", f"--set {text!r}: the key must be a dotted path such as train.optimizer.lr", "--set")]
        )
    if not raw.strip():
        return key, ""
    try:
        value, _, _ = _parse(raw, "--set")
    except SpecError as err:
        raise SpecError(
            [SpecIssue(key, f"--set {text!r}: {i.key + ': ' if i.key else ''}{i.message}", "--set") for i in err.issues]
        ) from None
    except yaml.YAMLError:
        return key, raw  # not YAML: keep it as the plain string the user typed
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
    members: dict[str, type[BaseModel]] = {}  # tag -> section class, right after a discriminated-union field
    for item in loc:
        if isinstance(item, str) and item in members:
            model, members = members[item], {}  # the discriminator tag: errors inside continue in that class
            continue
        if model is None:
            parts.append(str(item))
            continue
        if isinstance(item, str) and item in model.model_fields:
            parts.append(item)
            annotation = model.model_fields[item].annotation
            model = _model_in(annotation)
            members = _union_members(annotation) if model is None else {}
        elif isinstance(item, str) and parts and _is_union_tag(item):
            continue  # the discriminator tag
        else:
            parts.append(str(item))
            model = None
    return model, parts


def _is_union_tag(item: str) -> bool:
    return item in FAMILIES


def _union_members(annotation) -> dict[str, type[BaseModel]]:
    """{tag: class} of a discriminated union of sections on `family` (the model section); {} for anything else."""
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) is typing.Annotated:
        args = typing.get_args(args[0])
    members = {}
    for arg in args:
        family = getattr(arg, "model_fields", {}).get("family")
        for tag in typing.get_args(family.annotation) if family is not None else ():
            members[tag] = arg
    return members


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
        hint = (
            f"; did you mean {close[0]!r}?" if close else (f"; allowed here: {', '.join(allowed)}" if allowed else "")
        )
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
        return source.issue(
            f"{key}.family" if key else "family", f"{got!r} is not a model family (one of: {', '.join(FAMILIES)}){hint}"
        )
    if "input" in err and kind not in ("value_error", "assertion_error") and not isinstance(err["input"], dict):
        msg = f"{err['input']!r} is invalid: {msg}"
    return source.issue(key, msg)


def validate_data(data: Any, source: SpecSource, deepspeed_file_read: bool = False) -> Spec:
    """`deepspeed_file_read`: the user's DeepSpeed JSON has already filled what it could (dstune.ds_json.fill_spec), so
    keys it may give (the batch numbers) are required now; before that they may be missing."""
    if not isinstance(data, dict):
        raise SpecError(
            [SpecIssue("", "a spec is a YAML mapping with sections model, data, train, deepspeed, output", source.path)]
        )
    deepspeed = data.get("deepspeed")
    with_file = isinstance(deepspeed, dict) and bool(deepspeed.get("config"))
    context = {BATCH_FROM_FILE: "read" if deepspeed_file_read else "pending"} if with_file else None
    try:
        return Spec.model_validate(data, context=context)
    except ValidationError as err:
        errors = err.errors()
        if len(errors) > MAX_ISSUES:  # the first lines' only: describing (and printing) thousands takes seconds
            errors.sort(key=lambda e: line_of(source.where(".".join(str(part) for part in e["loc"]))))
        issues = [_describe(e, source) for e in errors[:MAX_ISSUES]]
        issues.sort(key=lambda i: line_of(i.where))
        raise SpecError(_at_most(issues, len(errors), source.path)) from None


def _at_most(issues: list[SpecIssue], total: int, path: str) -> list[SpecIssue]:
    """The first MAX_ISSUES issues, and one saying how many more were found but not described."""
    if total <= MAX_ISSUES:
        return issues
    more = SpecIssue("", f"{total - MAX_ISSUES} more errors not shown; fix the ones above and run again", path)
    return issues[:MAX_ISSUES] + [more]


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
        with open(path, "rb") as file:
            raw = file.read(MAX_SPEC_BYTES + 1)  # never more: the path may be a device or a pipe
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(
                [
                    SpecIssue(
                        "",
                        f"the spec is over {MAX_SPEC_BYTES // (1 << 20)} MB; a spec is settings, "
                        "not data (it names files and folders for anything large)",
                        path,
                    )
                ]
            )
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise SpecError([SpecIssue("", "spec file not found", path)]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError([SpecIssue("", f"cannot read the spec: {err}", path)]) from None
    data, lines, warnings = _compose(text, path)
    source = SpecSource(path, lines, warnings=warnings)
    if data is None:
        data = {}
    if isinstance(data, dict):
        data = apply_overrides(data, overrides, source)
        rebase_relative_paths(
            data,
            path,
            source.from_command_line,
            lambda key, message: source.warnings.append(source.issue(key, message, "warning")),
        )
        model = data.get("model")
        if isinstance(model, dict) and model.get("family") == VIDEO_FAMILY_ALIAS:
            message = (
                f"{VIDEO_FAMILY_ALIAS} is the video family's first name, read as {VIDEO_FAMILY}: write "
                f"`family: {VIDEO_FAMILY}` (the family trains every video model dstune knows)"
            )
            source.warnings.append(source.issue("model.family", message, "warning"))
    return validate_data(data, source), source
