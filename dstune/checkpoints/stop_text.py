"""What a rank says after a stop signal: where it stopped, the run's last complete checkpoint, and (when `dstune
train` is not there to say it once every rank is gone) the command that continues the run.

Torch-free, and importing only torch-free modules: a stop can come while the rank is still importing torch, and the
rank's last words must not import it again (a half-imported torch fails a second import with its own traceback).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from dstune.checkpoints.layout import checkpoint_root, read_latest
from dstune.interrupts import launched_by_dstune_train, stop_signal_name


def interrupted_text(step: int | None, run_dir: Path | None) -> str:
    """Rank 0's one line after a stop signal (`step`: the optimizer steps done, when the loop stopped)."""
    where = f"interrupted at step {step}" if step is not None else "interrupted"
    try:
        tag = read_latest(checkpoint_root(run_dir)) if run_dir is not None else None
    except OSError:
        tag = None
    if tag is None:
        saved, again = "no checkpoint was written yet", "start again with"
    else:
        saved = f"last complete checkpoint step {int(tag.rpartition('-')[2])} ({checkpoint_root(run_dir) / tag})"
        again = "continue with"
    text = f"{where} ({stop_signal_name()}); {saved}"
    if launched_by_dstune_train():
        return text
    return f"{text}; {again}: {rank_resume_command(resume=tag is not None)}"


def rank_resume_command(resume: bool) -> str:
    """The launch command of this rank's run, rebuilt from its own arguments, with `--resume latest` (when there is
    a checkpoint to continue). The deepspeed launcher's flags are not visible to a rank; the rank counts are."""
    args = sys.argv[1:]
    kept = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith(("--local_rank", "--local-rank", "--resume=")):
            kept.append(arg)
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    target = (
        ["--module", "dstune.train"]
        if main_spec is not None and main_spec.name == "dstune.train"
        else ["dstune/train.py"]
    )
    nodes, per_node = int(os.environ.get("CROSS_SIZE", "1")), os.environ.get("LOCAL_SIZE")
    if per_node is None:  # one process, no launcher
        launcher = ["python", "-m", "dstune.train"] if target[0] == "--module" else ["python", "dstune/train.py"]
        target = []
    elif nodes > 1:
        launcher = ["deepspeed", "--hostfile", "HOSTFILE", "--num_nodes", str(nodes), "--num_gpus", per_node]
    else:
        launcher = ["deepspeed", "--num_gpus", per_node]
    return shlex.join(launcher + target + kept + (["--resume", "latest"] if resume else []))
