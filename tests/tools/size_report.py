"""The size report `make test` prints after the tests: dstune's modules over the aim of ~400 lines and functions
over ~60 (train_loop: 150), largest first. An aim, not a gate: code is split where a concept ends, never moved to
the wrong module or stripped of its docs to pass a count. tests/unit/test_import_layers.py fails only past the
ratchet (RATCHET_*), which catches a module or function growing without anyone noticing.

    python tests/tools/size_report.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AIM_FILE_LINES, AIM_FUNCTION_LINES, AIM_LOOP_LINES = 400, 60, 150
RATCHET_FILE_LINES, RATCHET_FUNCTION_LINES = 600, 100


def sizes(package: Path = REPO / "dstune") -> tuple[list[tuple[int, str]], list[tuple[int, int, str]]]:
    """([(lines, file)], [(lines, aim, file:function)]) of every module and function in the package."""
    files, functions = [], []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        name = str(path.relative_to(REPO))
        files.append((len(source.splitlines()), name))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                aim = AIM_LOOP_LINES if node.name == "train_loop" else AIM_FUNCTION_LINES
                functions.append((node.end_lineno - node.lineno + 1, aim, f"{name}:{node.name}"))
    return files, functions


def main() -> int:
    files, functions = sizes()
    long_files = sorted((item for item in files if item[0] > AIM_FILE_LINES), reverse=True)
    long_functions = sorted((item for item in functions if item[0] > item[1]), reverse=True)
    print(
        f"size report: {len(files)} modules, {sum(n for n, _ in files)} lines; {len(functions)} functions, "
        f"median {sorted(n for n, _, _ in functions)[len(functions) // 2]} lines"
    )
    print(f"  modules over {AIM_FILE_LINES} lines: " + (", ".join(f"{name} ({n})" for n, name in long_files) or "none"))
    print(
        f"  functions over their aim ({AIM_FUNCTION_LINES}; train_loop {AIM_LOOP_LINES}): "
        + (", ".join(f"{name} ({n})" for n, _, name in long_functions) or "none")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
