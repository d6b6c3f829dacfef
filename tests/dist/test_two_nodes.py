"""Two "nodes" on one machine, each started by DeepSpeed's per-node launcher as pdsh / slurm / openmpi would start it:

    python -m deepspeed.launcher.launch --world_info B64 --node_rank K --master_addr 127.0.0.1 --master_port P \
        dstune/train.py spec.yaml

Both nodes have the same hostname here, so dstune must tell them apart by the node rank the launcher passes on.
The run trains, passes the batch check with 2 nodes, checkpoints and resumes exactly; a node given its own output
folder is refused at start. With two ranks a node and the text cache, a video model's text encoders are loaded by the
first rank of each node only (dstune.text_once), which split the text entries of the shared cache folder.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness import LAUNCH_TIMEOUT_S, REPO, TRAIN, base_spec, env, free_port, metrics, write_spec

pytestmark = pytest.mark.dist

STEPS = 4
NODES = {"node-a": [0], "node-b": [0]}  # one slot each, as `deepspeed --hostfile` would encode a 2-line hostfile


def _world_info(nodes: dict = NODES) -> str:
    from deepspeed.launcher.runner import encode_world_info  # the encoding the real multi-node runner uses

    return encode_world_info(nodes)


def _launch_two_nodes(
    spec_path: Path, args: tuple = (), node_b_args: tuple = (), nodes: dict = NODES
) -> list[subprocess.CompletedProcess]:
    port, world_info = free_port(), _world_info(nodes)
    procs = []
    for node_rank in range(len(nodes)):
        extra = node_b_args if node_rank == 1 else ()
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
               f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}",
               str(TRAIN), str(spec_path), *args, *extra]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def _explain(done: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(f"=== node {k}: exit {p.returncode}\n--- stdout\n{p.stdout[-5000:]}\n"
                     f"--- stderr\n{p.stderr[-5000:]}" for k, p in enumerate(done))


def _spec(run_dir: Path) -> dict:
    return base_spec(run_dir, train={"global_batch_size": 4, "micro_batch_size": 2, "max_steps": STEPS},
                     deepspeed={"zero_stage": 2, "timeout_minutes": 1},
                     output={"save_every_steps": 2, "keep_last": 5})


def test_world_info_is_what_the_runner_sends():
    """The runner encodes {host: [slots]} for the hostfile's hosts; launch.py decodes it: same dict both ways."""
    decoded = json.loads(base64.urlsafe_b64decode(_world_info()))
    assert decoded == NODES


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two-nodes") / "run"
    spec_path = write_spec(run_dir.parent / "spec.yaml", _spec(run_dir))
    return run_dir, spec_path, _launch_two_nodes(spec_path)


def test_two_nodes_train_and_pass_the_batch_check(trained):
    run_dir, _, done = trained
    assert [p.returncode for p in done] == [0, 0], _explain(done)
    main_out = done[0].stdout
    assert "batch check passed" in main_out
    assert "nodes                 2" in main_out or "nodes 2" in " ".join(main_out.split()), main_out
    assert "#node0: 1" in main_out and "#node1: 1" in main_out  # same hostname, told apart by the node rank
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:08d}"
    state = json.loads((run_dir / "checkpoints" / f"step-{STEPS:08d}" / "dstune_state.json").read_text())
    assert state["world_size"] == 2


def test_two_nodes_resume_exactly(trained, tmp_path):
    run_dir, spec_path, done = trained
    assert [p.returncode for p in done] == [0, 0], _explain(done)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    (resumed / "checkpoints" / "latest").write_text("step-00000002")
    again = _launch_two_nodes(spec_path, args=("--resume", "latest", "--set", f"output.dir={resumed}"))
    assert [p.returncode for p in again] == [0, 0], _explain(again)
    assert "resumed from" in again[0].stdout
    first, second = metrics(run_dir), metrics(resumed)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)


def test_text_encoders_load_on_the_first_rank_of_each_node(tmp_path):
    """builtin:tiny-wan from both caches (one folder both nodes see), rendering a sample: ranks 0 and 2 (local rank 0
    of each node) load UMT5 and encode the captions and the prompt between them; ranks 1 and 3 never load it; every
    rank drops it after the cache, and the sample renders from the prompt's cached text."""
    run_dir = tmp_path / "run"
    spec = base_spec(
        run_dir,
        model={"family": "video", "pretrained": "builtin:tiny-wan"},
        data={"path": "builtin:moving-shapes",
              "cache": {"latents": True, "text_embeddings": True, "dir": str(tmp_path / "cache")}},
        train={"global_batch_size": 4, "micro_batch_size": 1, "max_steps": 2},
        output={"save_every_steps": None},
        sample={"prompts": ["a red circle moving left"], "steps": 2, "guidance": 1.0},
    )
    done = _launch_two_nodes(write_spec(tmp_path / "spec.yaml", spec), nodes={"node-a": [0, 1], "node-b": [0, 1]})
    assert [p.returncode for p in done] == [0, 0], _explain(done)
    main_out = done[0].stdout
    assert "text encoders: loaded on ranks 0, 2 only (the first of each node; 2 of 4 ranks)" in main_out, main_out
    assert "(ranks 0, 1, 2, 3)" in main_out and "failed 0" in main_out  # one shared folder, complete
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert list((run_dir / "samples").glob("step-000002.*"))


def test_node_local_output_folder_is_refused_at_start(tmp_path):
    """node-b is given its own output.dir (as if it were on its local disk): refused before any training."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "node-b-local" / "run"
    spec_path = write_spec(tmp_path / "spec.yaml", _spec(run_dir))
    done = _launch_two_nodes(spec_path, node_b_args=("--set", f"output.dir={elsewhere}"))
    assert all(p.returncode == 1 for p in done), _explain(done)
    out = done[0].stdout + done[0].stderr
    assert "output.dir is not shared by all ranks" in out
    assert f"rank 1 on " in out and str(elsewhere) in out
    assert "Traceback" not in out
    assert not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text() == ""
    assert not (elsewhere / "checkpoints").exists()


def test_a_rank_killed_on_one_node_stops_the_other_node(tmp_path):
    """SIGKILL node-b's rank mid-training: node-a's launcher (which cannot see node-b's processes) must still end,
    because its rank's next collective fails on the closed connection (or, for a silent network loss, at
    deepspeed.timeout_minutes)."""
    run_dir = tmp_path / "run"
    spec = _spec(run_dir)
    spec["train"]["max_steps"] = 500
    spec_path = write_spec(tmp_path / "spec.yaml", spec)
    port, world_info = free_port(), _world_info()
    launchers = [subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.launch",
                                   f"--world_info={world_info}", f"--node_rank={k}", "--master_addr=127.0.0.1",
                                   f"--master_port={port}", str(TRAIN), str(spec_path)],
                                  cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for k in range(2)]
    try:
        deadline = time.time() + LAUNCH_TIMEOUT_S
        while not ((run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= 2):
            assert time.time() < deadline and all(p.poll() is None for p in launchers), "training did not start"
            time.sleep(0.5)
        victim = psutil.Process(launchers[1].pid).children()[0]  # node-b's only rank
        victim.send_signal(signal.SIGKILL)
        killed_at = time.time()
        codes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in launchers]
        stopped_after_s = time.time() - killed_at
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
    assert all(code != 0 for code in codes), codes
    print(f"node-a stopped {stopped_after_s:.1f} s after node-b's rank was killed")
    assert stopped_after_s < 90, f"node-a took {stopped_after_s:.0f} s to stop"
    assert len(metrics(run_dir)) < 500
