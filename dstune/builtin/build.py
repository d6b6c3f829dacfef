"""The child process that builds built-in models with ATen's kernels pinned (dstune.builtin.PINNED_ISA_ENV), so
that a build's random initialisation is the same on every CPU.

    python -m dstune.builtin.build NAME FOLDER NEEDS_JSON   # build one model into FOLDER, then exit
    python -m dstune.builtin.build --serve                  # build one model per request line

A build writes its facts to FOLDER/.build_facts.json. `--serve` is how dstune.builtin runs it: one child per process
that needs built-ins, kept for the next build, since importing torch, diffusers and transformers costs a child
several seconds, more than most tiny builds. A request is one JSON line {"name", "folder", "needs"}; the answer one
JSON line, {"built": NAME} or {"failed": NAME, "error": the traceback's end}; it exits when stdin closes or after
IDLE_S seconds without a request. What a build prints goes to stderr,
never into the answers. Each build seeds torch and fixes the thread count itself (builtin.common.deterministic_cpu),
so builds in one child give the same bytes as builds in their own.
"""

from __future__ import annotations

import json
import os
import select
import sys
import traceback
from pathlib import Path

from dstune.builtin import BUILD_FACTS, BUILTIN_MODELS

# A builder with nothing asked of it for this long exits (0): it holds torch, diffusers and transformers in memory
# (about half a GB), which a rank that built its model at start-up should not carry through its training. The
# process that asks starts a new one for its next build.
IDLE_S = 30.0


def build(name: str, folder: str, needs: dict[str, str]) -> None:
    facts = BUILTIN_MODELS[name].build(Path(folder), needs={k: Path(v) for k, v in needs.items()})
    (Path(folder) / BUILD_FACTS).write_text(json.dumps(facts))


def serve(idle_s: float = IDLE_S) -> int:
    answers = os.fdopen(os.dup(1), "w")  # the answers' own channel; fd 1 now goes where stderr goes
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer.raw  # unbuffered, so that select sees every line not yet read
    while select.select([requests], [], [], idle_s)[0]:
        line = requests.readline()
        if not line:  # stdin closed: the process that asked is done
            break
        request = json.loads(line)
        try:
            build(request["name"], request["folder"], request["needs"])
            answer = {"built": request["name"]}
        except Exception:  # noqa: BLE001 - the build's failure, raised in the process that asked for it
            answer = {"failed": request["name"], "error": traceback.format_exc()[-3000:]}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return serve()
    name, folder, needs = argv
    build(name, folder, json.loads(needs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
