"""The trained parts of built-in models, stored with dstune instead of trained when a built-in is built.

A few built-ins train a part so that they are useful in a demo and in tests: tiny-sd's and the flow models' VAEs
(so that renders are images, not noise), the tiny codecs' codebooks and EnCodec's decoder (so that codes follow
the sound), a speech LM (so that it has seen its token layout). What such training computes depends in its last
bits on the CPU's matrix kernels (MKL and oneDNN choose their blocking, and so their summation order, per
processor), and a few hundred optimizer steps carry those bits to the third digit: tiny-flow's VAE scaling factor
came out 1.21625 on one machine and 1.18615 on another, and a built-in trained at build time was a different model on
each CI machine.

So the trained tensors are stored here (`dstune/builtin/trained/NAME.safetensors`, the training's facts, such as a
VAE scaling factor, in the file's metadata), and a build gives the module it has just initialised those tensors
(`give_trained_weights`). A built-in's bytes are then the same on every x86 CPU by construction: everything else in
a build is ATen's random initialisation, which dstune.builtin pins to one code path (`ATEN_CPU_CAPABILITY`), and
saving. The training code stays beside each build and runs only to regenerate the files:

    python -m dstune.builtin.trained            # retrain every stored part, rewrite dstune/builtin/trained/

(every built-in that declares a part is built once in a scratch folder with the training on). Bump the
`folder_name` version of every built-in that uses a part you changed, or caches keep the old one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from dstune import builtin
from dstune.builtin.common import BuiltinError

STORE = Path(__file__).resolve().parent / "trained"
# Set (to a scratch folder) in the build processes of `regenerate`: a build then trains its parts and writes them
# there, instead of loading them from STORE.
RETRAIN_ENV = "DSTUNE_RETRAIN_BUILTIN_PARTS_INTO"
FACTS_KEY = "dstune_facts"

Tensors = dict[str, torch.Tensor]


def whole_state(module: torch.nn.Module) -> Tensors:
    return module.state_dict()


@dataclass(frozen=True)
class TrainedPart:
    """A part of a built-in that is trained: `train` trains the freshly initialised module in place and returns
    facts (JSON values) about it; `stored` picks the tensors of the trained module that are stored (all of them by
    default; a part whose training changes a few tensors stores those)."""

    name: str  # the file's stem in STORE
    train: Callable[[torch.nn.Module], dict]
    stored: Callable[[torch.nn.Module], Tensors] = whole_state


def give_trained_weights(part: TrainedPart, module: torch.nn.Module) -> dict:
    """Give `module`, just initialised by a build, the trained tensors of `part`, and return the training's facts:
    the stored ones, or, inside `regenerate`, those of training it now (then written to the scratch folder). The
    global RNG is left as loading leaves it either way, so that what a build initialises after this does not depend
    on whether the part was trained or loaded."""
    scratch = os.environ.get(RETRAIN_ENV)
    if scratch and not (Path(scratch) / f"{part.name}.safetensors").is_file():
        with torch.random.fork_rng(devices=[]):
            facts = part.train(module)
        _write(Path(scratch) / f"{part.name}.safetensors", part.stored(module), facts)
        return facts
    tensors, facts = read_part(part.name, Path(scratch) if scratch else STORE)
    expected = set(part.stored(module))
    if set(tensors) != expected:
        raise BuiltinError(
            f"the stored trained part {part.name} does not fit the module its built-in makes: "
            f"{len(expected - set(tensors))} tensors missing, {len(set(tensors) - expected)} unexpected. Regenerate "
            "it with `python -m dstune.builtin.trained` (a build's module changed without its stored part)."
        )
    with torch.no_grad():
        module.load_state_dict(tensors, strict=False)
    return facts


def read_part(name: str, store: Path = STORE) -> tuple[Tensors, dict]:
    """(tensors, facts) of a stored trained part."""
    from safetensors import safe_open

    path = store / f"{name}.safetensors"
    if not path.is_file():
        raise BuiltinError(
            f"{path} is missing: it is part of dstune (regenerate it with `python -m dstune.builtin.trained`)"
        )
    with safe_open(str(path), framework="pt") as handle:
        facts = json.loads((handle.metadata() or {}).get(FACTS_KEY, "{}"))
        return {key: handle.get_tensor(key) for key in handle.keys()}, facts


def _write(path: Path, tensors: Tensors, facts: dict) -> None:
    from safetensors.torch import save_file

    # clones: tied weights share storage, which safetensors refuses
    save_file(
        {key: value.detach().clone().contiguous() for key, value in tensors.items()},
        str(path),
        metadata={FACTS_KEY: json.dumps(facts, sort_keys=True)},
    )


def regenerate() -> list[str]:
    """Build, with the training on, every built-in that declares trained parts (each part is trained once, by the
    first built-in that uses it), and replace STORE's files with what came out. Returns the part names written."""
    users = [model for model in builtin.BUILTIN_MODELS.values() if model.trained_parts]
    with tempfile.TemporaryDirectory(prefix="dstune-trained-") as scratch:
        parts, cache = Path(scratch) / "parts", Path(scratch) / "cache"
        parts.mkdir()
        previous = os.environ.get(RETRAIN_ENV)
        os.environ[RETRAIN_ENV] = str(parts)  # the pinned build processes inherit it
        try:
            for model in users:
                print(f"building {model.name} (trains {', '.join(model.trained_parts)})", file=sys.stderr)
                builtin.ensure_builtin_model(model.name, cache)
        finally:
            if previous is None:
                os.environ.pop(RETRAIN_ENV)
            else:
                os.environ[RETRAIN_ENV] = previous
        declared = {name for model in users for name in model.trained_parts}
        written = sorted(path.stem for path in parts.glob("*.safetensors"))
        if set(written) != declared:
            raise BuiltinError(f"the builds trained {written}, but the built-ins declare {sorted(declared)}")
        STORE.mkdir(exist_ok=True)
        for name in written:
            shutil.copyfile(parts / f"{name}.safetensors", STORE / f"{name}.safetensors")
    return written


if __name__ == "__main__":
    names = regenerate()
    print(f"wrote {len(names)} trained parts to {STORE}: {', '.join(names)}")
