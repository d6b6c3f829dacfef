"""`dstune validate` wall time, and what it saves: the time DeepSpeed takes to report the same batch error.

1. `dstune validate` on every example spec under launch/, with the flags on the spec's first line
   ("# validate: dstune validate launch/X.yaml FLAGS"), as a fresh process (import time included): median of
   --repeats runs. Target: under 3 s each.
2. A batch error (launch/sd-tiny-demo.yaml with global batch 12 on 2 ranks: micro 4 does not divide it):
   `dstune validate` vs a plain DeepSpeed script under the launcher (bench/ds_batch_error.py: load the pipeline,
   deepspeed.initialize with the same DeepSpeed JSON and train_batch_size 12) until DeepSpeed's assertion; both
   timed as fresh processes, alternating, median of --repeats. Ratio = DeepSpeed / dstune.

  python3 bench/validate_bench.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    BENCH_CACHE,
    REPO,
    env,
    launch,
    machine,
    median,
    print_json,
    print_table,  # noqa: E402
    say,
)

sys.path.insert(0, str(REPO))

BAD_GLOBAL_BATCH = 12  # the demo's micro batch 4 x 2 ranks cannot make 12
DEMO = REPO / "launch" / "sd-tiny-demo.yaml"


def validate_command(spec: Path) -> list[str]:
    first = spec.read_text().splitlines()[0]
    prefix = "# validate: dstune validate "
    if not first.startswith(prefix):
        raise SystemExit(f"{spec}: first line is not '{prefix}SPEC FLAGS'")
    words = shlex.split(first[len(prefix) :])
    return [sys.executable, "-m", "dstune", "validate", str(REPO / words[0]), *words[1:]]


def timed(cmd: list[str], expect_rc: int) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if proc.returncode != expect_rc:
        raise SystemExit(
            f"expected exit {expect_rc}, got {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}"
            f"\n{proc.stderr[-3000:]}"
        )
    return seconds, proc.stdout + proc.stderr


def example_specs(repeats: int) -> list[tuple[str, float]]:
    specs = sorted((REPO / "launch").rglob("*.yaml"))
    times: dict[str, list[float]] = {spec.name: [] for spec in specs}
    for attempt in range(repeats):  # round-robin, so a burst of load does not land on one spec
        for spec in specs:
            say(f"validate {spec.name} ({attempt + 1}/{repeats})")
            times[spec.name].append(timed(validate_command(spec), 0)[0])
    return [(name, median(values)) for name, values in times.items()]


def bad_batch(work: Path, repeats: int) -> tuple[list[float], list[float], str, str]:
    from dstune.builtin import ensure_builtin_model

    pipeline = ensure_builtin_model("builtin:tiny-sd", BENCH_CACHE)
    good = work / "demo.json"
    subprocess.run(
        [sys.executable, "-m", "dstune", "compile", str(DEMO), "--num-gpus", "2", "-o", str(good)],
        cwd=REPO,
        env=env(),
        check=True,
        capture_output=True,
        timeout=600,
    )
    config = json.loads(good.read_text())
    config["train_batch_size"] = BAD_GLOBAL_BATCH
    bad = work / "bad.json"
    bad.write_text(json.dumps(config))
    dstune_cmd = [
        sys.executable,
        "-m",
        "dstune",
        "validate",
        str(DEMO),
        "--num-gpus",
        "2",
        "--set",
        f"train.global_batch_size={BAD_GLOBAL_BATCH}",
    ]
    ds_args = ["--pipeline", str(pipeline), "--ds-config", str(bad)]
    dstune_s, deepspeed_s, dstune_text, ds_text = [], [], "", ""
    for attempt in range(repeats):
        say(f"batch error: dstune validate ({attempt + 1}/{repeats})")
        seconds, dstune_text = timed(dstune_cmd, 1)
        dstune_s.append(seconds)
        say(f"batch error: DeepSpeed engine start ({attempt + 1}/{repeats})")
        started = time.perf_counter()
        proc = launch(Path(__file__).resolve().parent / "ds_batch_error.py", ds_args, num_ranks=2, check=False)
        deepspeed_s.append(time.perf_counter() - started)
        ds_text = proc.stdout
    if "does not divide global_batch_size" not in dstune_text or "DEEPSPEED ERROR" not in ds_text:
        raise SystemExit(f"the two did not report the batch error:\n{dstune_text[-2000:]}\n{ds_text[-2000:]}")
    ds_line = next(line for line in ds_text.splitlines() if "DEEPSPEED ERROR" in line)
    dstune_line = next(line for line in dstune_text.splitlines() if "does not divide" in line)
    return dstune_s, deepspeed_s, dstune_line.strip(), ds_line.split("DEEPSPEED ERROR: ", 1)[1].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    specs = example_specs(args.repeats)
    with tempfile.TemporaryDirectory(prefix="dstune-validate-bench-") as tmp:
        dstune_s, deepspeed_s, dstune_msg, ds_msg = bad_batch(Path(tmp), args.repeats)
    print_table(
        f"dstune validate on the example specs (median of {args.repeats} fresh processes; target < 3 s)",
        ["spec", "validate s"],
        [[name, seconds] for name, seconds in specs],
    )
    ratio = median(deepspeed_s) / median(dstune_s)
    print_table(
        f"The same batch error (global batch {BAD_GLOBAL_BATCH}, micro 4, 2 ranks), reported by ...",
        ["reported by", "s (median)", "message"],
        [
            ["dstune validate", median(dstune_s), dstune_msg.split(": ", 1)[-1][:90] + " ..."],
            ["DeepSpeed at engine start (load + init, 2 ranks)", median(deepspeed_s), ds_msg[:90] + " ..."],
            ["ratio DeepSpeed / dstune", ratio, ""],
        ],
    )
    print_json(
        "validate",
        {
            "validate_s": dict(specs),
            "validate_s_max": max(s for _, s in specs),
            "target_s_max": 3.0,
            "bad_batch_dstune_s": dstune_s,
            "bad_batch_deepspeed_s": deepspeed_s,
            "ratio_deepspeed_over_dstune": ratio,
            **machine(),
        },
    )


if __name__ == "__main__":
    main()
