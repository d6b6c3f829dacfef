"""The import graph of dstune/ matches docs/architecture.md: no cycles, nothing imports a layer above its own, and no
module reaches for another module's private names. Function-level imports count like module-level ones: a
dstune import inside a function is allowed only in the entry points (which keep `dstune validate` free of torch);
everywhere else an import inside a function names a heavy third-party module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dstune"

# Lowest first. A module may import modules of its own layer (without a cycle) or of lower layers. A name is a
# module or a package (then it covers everything under it). Keep in step with docs/architecture.md.
LAYERS = [
    [
        "dstune.spec",
        "dstune.models",
        "dstune.card",
        "dstune.registry",
        "dstune.fsutil",
        "dstune.hf",
        "dstune.progress",
        "dstune.trackers",
        "dstune.curves",
        "dstune.resampling",
        "dstune.library_logs",
        "dstune.interrupts",
        "dstune.runlock",
    ],
    [
        "dstune.world",
        "dstune.plan",
        "dstune.checkpoints",
        "dstune.checkpoints.layout",
        "dstune.checkpoints.resume_plan",
        "dstune.models.tts_lm.token_layouts",
        "dstune.models.wan.layouts",
        "dstune.memory",
        "dstune.memory.plan",
        "dstune.memory.phases",
        "dstune.memory.activations",
        "dstune.memory.activation_cases",
        "dstune.memory.working",
    ],
    [
        "dstune.distributed",
        "dstune.ds_json",
        "dstune.data",
        "dstune.families",
        "dstune.ema",
        "dstune.memory.counts",
        "dstune.model_folders",
        "dstune.model_defaults",
        "dstune.memory.record",
    ],
    [
        "dstune.builtin",
        "dstune.video_plan",
        "dstune.sets_plan",
        "dstune.sequence_parallel",
        "dstune.validate",
        "dstune.memory_advice",
        "dstune.memory_report",
        "dstune.report",
    ],
    [
        "dstune.pretrained",
        "dstune.cache",
        "dstune.engine",
        "dstune.optimizers",
        "dstune.checkpoints.store",
        "dstune.batch_check",
        "dstune.checkpoints.reshard",
        "dstune.evaluation",
    ],
    ["dstune.loop", "dstune.export", "dstune.checkpoints.resume", "dstune.text_once"],
    ["dstune.startup"],
    [
        "dstune.training",
        "dstune.cli",
        "dstune.cli_args",
        "dstune.train",
        "dstune.launcher",
        "dstune.__main__",
        "dstune",
    ],
]
# Packages that must stay apart from some layers below their own ceiling (docs/architecture.md, "rules").
FORBIDDEN = {
    "dstune.data": ("dstune.cache", "dstune.distributed", "dstune.families", "dstune.builtin"),
    "dstune.families": ("dstune.builtin", "dstune.cache", "dstune.data", "dstune.distributed", "dstune.pretrained"),
    "dstune.spec": ("dstune.data",),
}
ENTRY_POINTS = {
    "dstune.cli",
    "dstune.cli_args",
    "dstune.train",
    "dstune.launcher",
    "dstune.__main__",
}  # may import dstune modules inside functions
HEAVY_THIRD_PARTY = {
    "torch",
    "deepspeed",
    "diffusers",
    "transformers",
    "peft",
    "accelerate",  # imports torch (its meta-device model builder: dstune.families.quantized_base)
    "PIL",
    "soundfile",
    "safetensors",
    "huggingface_hub",
    "sentencepiece",
    "tokenizers",
    "snac",
    "rich",
    "numpy",
    "bitsandbytes",
    "fcntl",
    "html",
    "io",
    "importlib",
    "wandb",
    "av",
}  # av: PyAV, video decoding (wan)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


# A model unit (dstune/models/<name>/) holds modules of several layers; a module's role, from its name, says which:
# its spec section with the spec's, its layouts with the plan's, its card (torch-free, on the cores' card types) and
# its class (the torch side: model.py and its helpers) with the families', its built-ins with dstune.builtin. The
# registry names the cards as text, so nothing below imports a unit.
UNIT_ROLES = {"spec": 0, "layouts": 1, "token_layouts": 1, "card": 2, "builtin": 3}
UNIT_TORCH_SIDE = 2


def _unit_layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) != 4 or parts[:2] != ["dstune", "models"]:
        return None
    role = parts[3]
    return UNIT_ROLES.get(role, UNIT_ROLES["builtin"] if role.startswith("builtin") else UNIT_TORCH_SIDE)


def _layer(module: str) -> int:
    unit_layer = _unit_layer(module)
    if unit_layer is not None:
        return unit_layer
    best, where = -1, None
    for number, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, where = len(name), number
    assert where is not None, f"{module} is in no layer of LAYERS: add it (and to docs/architecture.md)"
    return where


def _imports(module: str, path: Path):
    """(imported dstune module, imported name, line, inside a function?) for every import in the file."""
    tree = ast.parse(path.read_text())
    in_function = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dstune") and not node.level:
            for alias in node.names:
                target = _target(f"{node.module}.{alias.name}") or _target(node.module)
                yield target, alias.name, node.lineno, id(node) in in_function
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dstune"):
                    yield _target(alias.name), "", node.lineno, id(node) in in_function


def _third_party_in_functions(path: Path):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    yield from ((alias.name, node.lineno) for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    yield node.module or "", node.lineno


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for target, _, _, _ in _imports(module, path):
            if target and target != module:
                edges.setdefault(module, set()).add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative enough for this size)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(MODULES):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_the_package():
    assert len(MODULES) > 40 and "dstune.training" in MODULES and "dstune.cache.latents" in MODULES
    assert any(inner for module, path in MODULES.items() for *_, inner in _imports(module, path)), (
        "no function-level dstune import found at all: the walk is not looking inside functions"
    )


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_no_import_points_up_a_layer():
    wrong = []
    for module, path in MODULES.items():
        for target, _, line, _ in _imports(module, path):
            if target and target != module and _layer(target) > _layer(module):
                wrong.append(
                    f"{path.relative_to(REPO)}:{line}: {module} (layer {_layer(module)}) imports "
                    f"{target} (layer {_layer(target)})"
                )
    assert wrong == []


def _rules_of(module: str):
    """The FORBIDDEN entries that hold for `module`: its package's, and for a unit's torch side the families'."""
    for package, banned in FORBIDDEN.items():
        if module == package or module.startswith(package + "."):
            yield banned
    if _unit_layer(module) == UNIT_TORCH_SIDE:  # its card and its class
        yield FORBIDDEN["dstune.families"]


def test_package_rules():
    wrong = []
    for module, path in MODULES.items():
        for banned in _rules_of(module):
            if True:
                wrong += [
                    f"{path.relative_to(REPO)}:{line}: {module} imports {target}"
                    for target, _, line, _ in _imports(module, path)
                    if target and any(target == b or target.startswith(b + ".") for b in banned)
                ]
    assert wrong == []


def test_no_private_names_across_modules():
    wrong = [
        f"{path.relative_to(REPO)}:{line}: {module} imports {target}.{name}"
        for module, path in MODULES.items()
        for target, name, line, _ in _imports(module, path)
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert wrong == []


def test_function_level_imports_only_where_start_up_needs_them():
    wrong = [
        f"{path.relative_to(REPO)}:{line}: {module} imports {target} inside a function"
        for module, path in MODULES.items()
        for target, _, line, inner in _imports(module, path)
        if inner and module not in ENTRY_POINTS
    ]
    wrong += [
        f"{path.relative_to(REPO)}:{line}: {name} imported inside a function (only heavy third-party modules "
        f"are: {sorted(HEAVY_THIRD_PARTY)})"
        for module, path in MODULES.items()
        if module not in ENTRY_POINTS
        for name, line in _third_party_in_functions(path)
        if not name.startswith("dstune") and name.split(".")[0] not in HEAVY_THIRD_PARTY
    ]
    assert wrong == []


def test_no_module_or_function_past_the_ratchet():
    """The aims (~400 lines a module, ~60 a function) are reported by `make test` (tests/tools/size_report.py), not
    enforced: code is split where a concept ends. This fails only past the ratchet, where something grew unnoticed."""
    sys.path.insert(0, str(REPO / "tests" / "tools"))
    from size_report import RATCHET_FILE_LINES, RATCHET_FUNCTION_LINES, sizes

    files, functions = sizes(PACKAGE)
    assert [f"{name} ({n})" for n, name in files if n > RATCHET_FILE_LINES] == []
    assert [f"{name} ({n})" for n, _, name in functions if n > RATCHET_FUNCTION_LINES] == []
