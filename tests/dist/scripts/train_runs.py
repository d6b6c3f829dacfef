"""Several real training runs in one launch (the settings matrix's 2-rank cases, tests/dist/test_settings_matrix_two_ranks.py):
`dstune/train.py`'s main for each spec listed in RUNS (one path a line), one after another, on the same ranks.

    train_runs.py RUNS

A line of RUNS may add `dstune train` flags after the spec (`spec.yaml --resume /path/to/step-00000002`): a run
listed after the one that wrote that checkpoint resumes it in the same launch.

Each run is the whole path `dstune train` takes (validate for the launched world, build, caches built by both ranks,
DeepSpeed's engine, the batch check, the loop, the checkpoint). What they share is the process and its process
group: DeepSpeed keeps its groups in module globals made once per process, so a second process group in one
process is not possible; dstune.training's shutdown (the end of a run) is left to after the last run.

Two checks are added to each run, written to `<output.dir>/matrix.json` by rank 0 (and, for a run with an int8
base under ZeRO-3, each rank's stored bytes of its int8 partitions and of all its frozen partitions,
`int8_partition_bytes`, `frozen_partition_bytes`):
- at each optimizer step, before DeepSpeed applies it, the gradient of every trainable parameter, assembled by
  deepspeed.utils.safe_get_full_grad (every ZeRO stage; a collective under ZeRO-3): the names without one, with a
  non-finite one, or with one that is zero everywhere;
- the Python warnings raised from dstune's own files during the run.
A run that fails stops the launch (as it would stop `dstune train`), its output naming it.
"""

import json
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import yaml  # noqa: E402

import dstune.training as training  # noqa: E402
from dstune.distributed import exit_rank, launcher_rank, shutdown  # noqa: E402
from dstune.train import main  # noqa: E402

DSTUNE = str(REPO / "dstune")
_current: dict = {}  # the running run's findings: {"grads": {...}, "warnings": [...]}


def _grad_problems(engine) -> dict[str, list[str]]:
    from deepspeed.utils import safe_get_full_grad

    problems: dict[str, list[str]] = {"no gradient": [], "non-finite gradient": [], "zero gradient": []}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        grad = safe_get_full_grad(param)  # every rank, in the same order: ZeRO-3 gathers the partitions
        if grad is None:
            problems["no gradient"].append(name)
        elif not grad.isfinite().all():
            problems["non-finite gradient"].append(name)
        elif not grad.any():
            problems["zero gradient"].append(name)
    return problems


def _every_rank(value: int) -> list[int]:
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _checked_wrap_model(original):
    def wrap_model(*args, **kwargs):
        engine = original(*args, **kwargs)
        step = engine.step
        frozen = [p.ds_tensor for p in engine.module.parameters() if not p.requires_grad and hasattr(p, "ds_tensor")]
        int8 = [t for t in frozen if t.dtype == torch.int8]
        if int8:  # an int8 base under ZeRO-3: each rank's stored partitions (a collective: every rank has them)
            _current["int8_partition_bytes"] = _every_rank(sum(t.numel() * t.element_size() for t in int8))
            _current["frozen_partition_bytes"] = _every_rank(sum(t.numel() * t.element_size() for t in frozen))

        def step_after_checking_gradients(*step_args, **step_kwargs):
            if engine.is_gradient_accumulation_boundary():
                found = _grad_problems(engine)
                for problem, names in found.items():  # over the steps: a parameter counts once per problem
                    seen = _current["grads"].setdefault(problem, [])
                    seen += [name for name in names if name not in seen]
            return step(*step_args, **step_kwargs)

        engine.step = step_after_checking_gradients
        return engine

    return wrap_model


_show_warning = warnings.showwarning


def _record_warning(message, category, filename, lineno, file=None, line=None):
    if str(filename).startswith(DSTUNE):
        _current["warnings"].append(f"{filename}:{lineno}: {category.__name__}: {message}")
    _show_warning(message, category, filename, lineno, file, line)


def run_all(runs: list[list[str]]) -> int:
    training.wrap_model = _checked_wrap_model(training.wrap_model)
    training.shutdown = lambda: None  # the process group outlives each run; shut down once, after the last
    warnings.showwarning = _record_warning
    warnings.simplefilter("always")
    for spec, *flags in runs:
        _current.clear()
        _current.update(grads={}, warnings=[])
        started = time.perf_counter()
        if launcher_rank() == 0:
            print(f"=== settings matrix run: {spec}", flush=True)
        code = main([spec, *flags])
        if launcher_rank() == 0:
            print(f"=== settings matrix run took {time.perf_counter() - started:.1f} s", flush=True)
        if launcher_rank() == 0:
            run_dir = Path(yaml.safe_load(Path(spec).read_text())["output"]["dir"])
            (run_dir / "matrix.json").write_text(json.dumps(_current) + "\n")
        if code:
            return code
    return 0


if __name__ == "__main__":
    listed = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]
    code = run_all([line.split() for line in Path(listed[0]).read_text().splitlines() if line.strip()])
    shutdown()
    exit_rank(code)
