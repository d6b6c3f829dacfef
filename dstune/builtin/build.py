"""`python -m dstune.builtin.build NAME FOLDER NEEDS_JSON`: build one built-in model into FOLDER in this process,
writing the build's facts to FOLDER/.build_facts.json. dstune.builtin runs it as a child process with ATen's
kernels pinned (PINNED_ISA_ENV), so that a build's random initialisation is the same on every CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dstune.builtin import BUILD_FACTS, BUILTIN_MODELS


def main(argv: list[str]) -> int:
    name, folder, needs = argv
    facts = BUILTIN_MODELS[name].build(Path(folder), needs={k: Path(v) for k, v in json.loads(needs).items()})
    (Path(folder) / BUILD_FACTS).write_text(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
