"""A test-only launcher whose ranks are forked from one process that has already imported the libraries.

Why: on this project's 2-core CI machine a 2-rank launch of a tiny model costs ~33 CPU-seconds, and ~28 of them are
imports: every rank imports torch, DeepSpeed, diffusers (which pulls in torch._dynamo, bitsandbytes, peft and
transformers) and dstune, and DeepSpeed's per-node launcher imports DeepSpeed only to start them. The training of
four tiny steps is a few seconds. This process imports all of that once per pytest worker and then, per launch,
forks the ranks: each is a real, separate OS process with the environment DeepSpeed's launcher gives a rank (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR, MASTER_PORT, `--local_rank=N`), its own
gloo process group, and the script run as `__main__`. It is forked from a parent that never ran a step, so no state
leaks from one launch into the next.

What it does not test is DeepSpeed's launcher itself: the tests about launching (the `deepspeed` command, signals
to the launcher, two nodes, ranks dying under the launcher) start the real one (`harness.launch(...,
real_launcher=True)` or their own commands). On a failure it does what the launcher does: the first rank that exits
non-zero ends the launch with its code, and the other ranks are stopped (SIGTERM, then SIGKILL after 3 s).

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout (the ranks' output goes to files).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _preload() -> None:
    """What every rank of a tiny run imports; anything a run needs beyond this it imports itself, as usual."""
    import deepspeed  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import dstune.training  # noqa: F401
    from dstune import registry
    from dstune.card import load

    for card in registry.cards():  # each model's class imports its diffusers / transformers classes
        load(card.model_class)
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel  # noqa: F401
    from transformers import CLIPTextModel, CLIPTokenizer  # noqa: F401


def _run_rank(request: dict, rank: int) -> None:
    """In the forked child: become rank `rank` of the launch and run its script; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # the rank and anything it starts can be stopped together, as the launcher's tree is
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_APPEND),
                               (2, request["stderr"], os.O_WRONLY | os.O_APPEND)):
            target = os.open(path, mode)
            os.dup2(target, fd)
            os.close(target)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        world = request["num_ranks"]
        if world == 1:  # `python script spec`: no launcher, no launcher environment
            sys.argv = [request["script"], *request["args"]]
        else:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]), WORLD_SIZE=str(world),
                              CROSS_RANK="0", CROSS_SIZE="1", LOCAL_SIZE=str(world), RANK=str(rank),
                              LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES=",".join(map(str, range(world))))
            sys.argv = [request["script"], f"--local_rank={rank}", *request["args"]]
        import runpy

        try:
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the rank's exit code 1
            import traceback

            traceback.print_exc()
            code = 1
        import atexit
        import threading

        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code & 0xFF)


def _stop(pids: set[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 3
        while pids and time.monotonic() < deadline:
            pids -= _reap(pids, block=False)[0]
            time.sleep(0.05)
        if not pids:
            return


def _reap(pids: set[int], block: bool) -> tuple[set[int], dict[int, int]]:
    """The ranks of `pids` that ended, and their exit codes as a launcher sees them (-N for a signal)."""
    done, codes = set(), {}
    for pid in list(pids):
        got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        if got:
            done.add(pid)
            codes[pid] = os.waitstatus_to_exitcode(status)
    return done, codes


def _launch(request: dict) -> dict:
    pids = []
    for rank in range(request["num_ranks"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank)
        pids.append(pid)
    alive, deadline, code = set(pids), time.monotonic() + request["timeout_s"], 0
    while alive:
        done, codes = _reap(alive, block=False)
        alive -= done
        failed = [c for c in codes.values() if c != 0]
        if failed:
            code = failed[0]
            _stop(alive)
            break
        if time.monotonic() > deadline:
            _stop(alive)
            return {"returncode": -9, "timed_out": True}
        time.sleep(0.05)
    # the launcher exits with sys.exit(rank's code): a rank killed by signal N reads as 256 - N
    return {"returncode": code & 0xFF, "timed_out": False}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the imports print goes to stderr, never into the replies
    _preload()
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        replies.write(json.dumps(_launch(json.loads(line))) + "\n")


if __name__ == "__main__":
    main()
