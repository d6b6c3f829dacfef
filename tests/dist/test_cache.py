"""Real 2-rank cache builds on CPU: 2 ranks build what 1 rank builds, entry for entry; a killed build resumes;
damaged entries are rebuilt; changed preprocessing or encoder misses; per-rank folders train; training from the
cache follows the on-the-fly loss trajectory."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harness import REPO, TRAIN, base_spec, env, explain, free_port, launch, memory_problems, metrics, write_spec

pytestmark = pytest.mark.dist

STEPS = 4


def _spec(root: Path, cache_dir: Path, **data) -> dict:
    return base_spec(root / "run", data={"random_flip": True, "caption_dropout": 0.25,
                                         "cache": {"latents": True, "text_embeddings": True, "dir": str(cache_dir)},
                                         **data},
                     train={"global_batch_size": 4, "micro_batch_size": 2, "max_steps": STEPS})


def _entries(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in folder.rglob("*.safetensors")}


def _cli_cache(spec_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dstune", "cache", str(spec_path), *args], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """A cache built by one process, the same by two ranks, then damaged and trained from; an on-the-fly run."""
    root = tmp_path_factory.mktemp("cache")
    one = write_spec(root / "one.yaml", _spec(root / "one", root / "cache-one"))
    two = write_spec(root / "two.yaml", _spec(root / "two", root / "cache-two"))
    out = {"root": root, "one_spec": one, "two_spec": two, "one": _cli_cache(one),
           "two": launch(two, num_ranks=2, args=("--cache-only",))}
    reference = _entries(root / "cache-two")
    damaged = sorted(reference)[:4]
    data = reference[damaged[0]].read_bytes()
    reference[damaged[0]].write_bytes(data[: len(data) // 2])  # truncated
    reference[damaged[1]].write_bytes(b"")  # empty
    flipped = bytearray(reference[damaged[2]].read_bytes())
    flipped[-5] ^= 0xFF  # corrupt data, intact header
    reference[damaged[2]].write_bytes(bytes(flipped))
    reference[damaged[3]].unlink()  # missing
    out["damaged"] = damaged
    out["trained"] = launch(two, num_ranks=2)
    plain = _spec(root / "plain", root / "unused")
    plain["data"]["cache"] = {"latents": False, "text_embeddings": False}
    out["plain_dir"] = root / "plain" / "run"
    out["plain"] = launch(write_spec(root / "plain.yaml", plain), num_ranks=2)
    return out


def test_two_ranks_build_exactly_what_one_builds(built):
    assert built["one"].returncode == 0, explain(built["one"])
    assert built["two"].returncode == 0, explain(built["two"])
    summary = re.search(r"cache-two \(ranks 0, 1\): (\d+) entries, built now (\d+), already cached 0, failed 0",
                        built["two"].stdout)
    assert summary, explain(built["two"])  # one folder shared by both ranks, one summary line from rank 0
    assert built["two"].stdout.count("entries per folder") == 1
    one = _entries(built["root"] / "cache-one")
    two_fresh = {name: p for name, p in _entries(built["root"] / "cache-two").items() if name not in built["damaged"]}
    assert int(summary.group(1)) == len(one) == 256 * 2 + 19  # both orientations; 18 captions and the empty one
    assert set(two_fresh) <= set(one) and len(_entries(built["root"] / "cache-two")) == len(one)
    for name, path in two_fresh.items():
        _assert_same_entry(load_file(one[name]), load_file(path), name)


def _assert_same_entry(a: dict, b: dict, name: str) -> None:
    """Same tensors, shapes and dtypes; values equal up to float summation order (one process runs the encoder on 2
    threads, each of 2 ranks on 1, and CPU convolutions sum in thread-dependent order)."""
    assert set(a) == set(b), name
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, name
        scale = max(1.0, a[key].abs().max().item())
        assert (a[key] - b[key]).abs().max().item() <= 1e-5 * scale, name


def test_damaged_entries_are_rebuilt_and_cached_training_matches_on_the_fly(built):
    trained, plain = built["trained"], built["plain"]
    assert trained.returncode == 0, explain(trained)
    assert plain.returncode == 0, explain(plain)
    assert re.search(r"built now 4, already cached 527, failed 0", trained.stdout), explain(trained)
    assert "batch check passed" in trained.stdout
    one = _entries(built["root"] / "cache-one")
    for name in built["damaged"]:
        _assert_same_entry(load_file(one[name]), load_file(_entries(built["root"] / "cache-two")[name]), name)
    cached, fly = metrics(built["root"] / "two" / "run"), metrics(built["plain_dir"])
    # the memory plan per phase, with the cache and without (docs/performance.md section 5)
    for run_dir in (built["root"] / "two" / "run", built["plain_dir"]):
        assert not memory_problems(run_dir), (run_dir.name, memory_problems(run_dir))
    assert [m["step"] for m in cached] == list(range(1, STEPS + 1))
    for a, b in zip(cached, fly):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)


def test_verify_reports_and_misses_on_changed_resolution_or_encoder(built, tmp_path):
    ok = _cli_cache(built["one_spec"], "--verify")
    assert ok.returncode == 0 and "checked 531, failed 0" in ok.stdout, explain(ok)
    resized = _cli_cache(built["one_spec"], "--verify", "--set", "data.resolution=16")
    assert resized.returncode == 1 and "checked 19, failed 512" in resized.stderr, explain(resized)
    model = next(Path(base_spec(tmp_path)["output"]["cache_dir"]).glob("builtin/tiny-sd*"))
    changed = tmp_path / "model"
    shutil.copytree(model, changed)
    config = changed / "vae" / "config.json"
    config.write_text(config.read_text().replace("{", '{"_edited": 1,', 1))  # another VAE, same captions
    other = _cli_cache(built["one_spec"], "--verify", "--set", f"model.pretrained={changed}")
    assert other.returncode == 1 and "checked 19, failed 512" in other.stderr, explain(other)
    assert "missing" in other.stderr


def test_ranks_with_separate_folders_both_build_and_train(tmp_path):
    spec = _spec(tmp_path, tmp_path / "node-{rank}")
    proc = launch(write_spec(tmp_path / "spec.yaml", spec), num_ranks=2)
    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        assert f"node-{rank} (ranks {rank}): 531 entries, built now 531" in proc.stdout
        assert len(_entries(tmp_path / f"node-{rank}")) == 531
    assert [m["step"] for m in metrics(tmp_path / "run")] == list(range(1, STEPS + 1))


def test_killed_build_resumes_and_completes(tmp_path):
    spec_path = write_spec(tmp_path / "spec.yaml", _spec(tmp_path, tmp_path / "cache", resolution=96))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(TRAIN), str(spec_path), "--cache-only"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while len(_entries(tmp_path / "cache")) < 40 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # every rank at once, mid-write
    proc.wait()
    partial = len(_entries(tmp_path / "cache"))
    assert 40 <= partial < 531, f"the build was not interrupted mid-way ({partial} entries)"
    again = launch(spec_path, num_ranks=2, args=("--cache-only",))
    assert again.returncode == 0, explain(again)
    counts = re.search(r"built now (\d+), already cached (\d+), failed 0", again.stdout)
    assert counts and int(counts.group(2)) == partial and int(counts.group(1)) + int(counts.group(2)) == 531
    check = _cli_cache(spec_path, "--verify")
    assert check.returncode == 0 and "checked 531, failed 0" in check.stdout, explain(check)
