"""Real 2-rank DeepSpeed training on CPU: every ZeRO stage trains, passes the batch check and exports a pipeline that
diffusers loads; a resumed run continues exactly, on 2 ranks and on 1; 1 rank x 2 accumulation equals 2 ranks x 1,
held-out loss (data.eval) included; rank 0 writes TensorBoard event files and the samples page with the curves."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import (CACHE_DIR, LAUNCHED_PORTS, base_spec, explain, launch, memory_phase_rows, memory_problems,
                     metrics, shm_segments, write_spec)

pytestmark = pytest.mark.dist

STEPS = 4
CASES = {  # name -> (zero stage, gradient checkpointing); zero1 also trains from a folder with a corrupt image
    "zero0": (0, False),  # with data.sets (SETS): the 2-rank side of test_two_sets_*
    "zero1": (1, False),  # with SGD + momentum, data.eval and samples: the 2-rank side of test_world_size_equivalence
    "zero2": (2, False),
    "zero3": (3, True),  # with gradient checkpointing (non-reentrant) under ZeRO-3
}
# SGD with momentum, not Adam, where runs are compared across world sizes: Adam divides each gradient element by its
# own magnitude, so elements whose gradient is at rounding-noise level (different summation orders on 1 vs 2 ranks)
# get full-size updates of random sign, which would hide whether two splits trained on the same samples and noise.
SGD = {"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}
# 4 of the zero1 folder's 18 files held out (img03, img09, img13, img14: by the hash of their ids); 14 x 2 repeats
# train, the two unreadable files among them (each replaced by the next readable sample).
EVAL = {"fraction": 0.2, "every_steps": 2}


# data.sets: set `a` (4 images, repeats 1, loss masks: the left half of each image) and set `b` (4 images, repeats 3,
# class images: role regularization, loss weight 0.5). An epoch: 4 + 12 = 16 samples, 4 steps of global batch 4 at
# micro batch 1 (2 ranks x 2 accumulation; 1 rank x 4), each global batch 1 of `a` and 3 of `b`; the step-2
# checkpoint is mid-epoch.
SETS = [{"path": "a", "mask_dir": "../masks"}, {"path": "b", "repeats": 3, "role": "regularization",
                                                 "loss_weight": 0.5}]


def _two_sets(root: Path) -> list[dict]:
    """SETS' folders under `root` (absolute paths in the sets), and a mask per image of set `a`."""
    from PIL import Image

    from dstune.data.synthetic import render_shape

    for name, first, caption in (("a", 0, "a sks shape"), ("b", 20, "a shape")):
        (root / name).mkdir(parents=True)
        for i in range(4):
            render_shape(first + i, 32)[0].save(root / name / f"{name}{i}.png")
            (root / name / f"{name}{i}.txt").write_text(caption)
    (root / "masks").mkdir()
    for i in range(4):
        mask = Image.new("L", (32, 32), 0)
        mask.paste(255, (0, 0, 16, 32))
        mask.save(root / "masks" / f"a{i}.png")
    return [{**item, "path": str(root / item["path"])} for item in SETS]


def _spec(run_dir: Path, stage: int, checkpointing: bool) -> dict:
    return base_spec(
        run_dir,
        model={"gradient_checkpointing": checkpointing},
        train={"global_batch_size": 4, "micro_batch_size": 2, "gradient_accumulation_steps": None, "max_steps": STEPS},
        deepspeed={"zero_stage": stage},
        output={"save_every_steps": 2, "keep_last": 5, "export": "diffusers"},
    )


def _image_folder(root: Path) -> Path:
    """16 PNG images with captions in a repeat-2 folder and two files that cannot be read: one not an image at all,
    and a JPEG cut short, whose header is whole (PIL's verify() passes it) and whose pixels stop halfway."""
    import numpy as np
    from PIL import Image

    from dstune.data.synthetic import render_shape

    folder = root / "2_shapes"
    folder.mkdir(parents=True)
    for i in range(16):
        image, caption = render_shape(i, 32)
        image.save(folder / f"img{i:02d}.png")
        (folder / f"img{i:02d}.txt").write_text(caption)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    (folder / "broken.txt").write_text("a broken file")
    noise = (np.random.default_rng(0).random((96, 128, 3)) * 255).astype("uint8")
    Image.fromarray(noise).save(folder / "cut.jpg", quality=90)
    whole = (folder / "cut.jpg").read_bytes()
    (folder / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    (folder / "cut.txt").write_text("a photo cut short")
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One real launch per case, shared by the tests below (each launch costs ~20-30 s on 2 cores)."""
    out = {"first_port": len(LAUNCHED_PORTS)}
    for name, (stage, checkpointing) in CASES.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"
        spec = _spec(run_dir, stage, checkpointing)
        if name == "zero1":  # a user's kohya-style folder with a repeat count and a corrupt image
            spec["data"].update(path=str(_image_folder(run_dir.parent / "images")), skip_bad_files=True,
                                eval=EVAL)
            spec["train"]["optimizer"] = dict(SGD)
            spec["sample"] = {"prompts": ["a red circle"], "steps": 2}
        if name == "zero0":  # two datasets, a regularization set and loss masks
            spec["data"] = {**spec["data"], "sets": _two_sets(run_dir.parent / "sets")}
            del spec["data"]["path"]
            spec["train"].update(micro_batch_size=1, optimizer=dict(SGD))
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        # zero0 goes through `deepspeed --module dstune.train`, zero1 through `deepspeed dstune/train.py`, the
        # others through DeepSpeed's per-node launcher directly (tests/dist/harness.py)
        out[name] = (run_dir, spec_path, launch(spec_path, num_ranks=2, as_module=name == "zero0",
                                                via_runner=name == "zero1"))
    out["shm_left"] = shm_segments(LAUNCHED_PORTS[out["first_port"]:])
    return out


def test_runs_leave_no_shared_memory_behind(runs):
    """DeepSpeed's CPU all-reduce never unlinks its 69 MB-per-rank /dev/shm segments; dstune does, or every run on
    the CPU would keep that much RAM until reboot (a day of test runs filled a 24 GB machine)."""
    assert all(runs[name][2].returncode == 0 for name in CASES)
    assert runs["shm_left"] == set()


@pytest.mark.parametrize("name", list(CASES))
def test_trains_checks_and_exports(runs, name):
    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    assert "batch check passed" in proc.stdout
    assert "rank 1" in proc.stdout  # the check table has a column per rank
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in logged)
    assert logged[-1]["samples"] == STEPS * 4
    assert "use_reentrant" not in proc.stdout + proc.stderr
    if name == "zero1":
        # found on the ranks before step 1 and skipped: the JPEG cut short is caught although its header is whole
        assert "2 unreadable image(s) skipped" in proc.stdout
        assert "broken.png" in proc.stdout and "cut.jpg" in proc.stdout
        # 18 files, 4 held out, x 2 repeats: the plan the loader was checked on
        assert re.search(r"samples\s+28 \(.*4 held out for data.eval", proc.stdout)

    from diffusers import DiffusionPipeline

    export = run_dir / "export" / f"step-{STEPS:08d}"
    pipe = DiffusionPipeline.from_pretrained(export)
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
    assert image.shape == (32, 32, 3)


def test_export_holds_the_trained_weights(runs):
    """The exported UNet differs from the starting one (training happened) and equals the consolidated checkpoint."""
    run_dir, _, proc = runs["zero3"]
    assert proc.returncode == 0, explain(proc)
    trained = load_file(run_dir / "export" / f"step-{STEPS:08d}" / "unet" / "diffusion_pytorch_model.safetensors")
    base = next(CACHE_DIR.glob("builtin/tiny-sd*/unet/diffusion_pytorch_model.safetensors"))
    start = load_file(base)
    assert set(trained) == set(start)
    assert max((trained[k] - start[k]).abs().max().item() for k in start) > 0


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_resume_continues_exactly(runs, name, tmp_path):
    """Resume from the step-2 checkpoint: steps 3-4 reproduce the uninterrupted run's losses and final weights."""
    run_dir, spec_path, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed_dir / "checkpoints" / "step-00000002")
    (resumed_dir / "checkpoints" / "latest").write_text("step-00000002")
    again = launch(spec_path, num_ranks=2, args=("--resume", "latest", "--set", f"output.dir={resumed_dir}"))
    assert again.returncode == 0, explain(again)
    assert "resumed from" in again.stdout
    assert "spec changes since the checkpoint (allowed):\n  output.dir:" in again.stdout  # listed, not refused
    first, second = metrics(run_dir), metrics(resumed_dir)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)
        assert after["lr"] == pytest.approx(before["lr"])
        assert after["samples"] == before["samples"]
    unet = Path("unet") / "diffusion_pytorch_model.safetensors"
    a = load_file(run_dir / "export" / f"step-{STEPS:08d}" / unet)
    b = load_file(resumed_dir / "export" / f"step-{STEPS:08d}" / unet)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_world_size_equivalence(runs, tmp_path):
    """Global batch 4 as 1 rank x 2 micro x 2 accumulation equals 2 ranks x 2 micro x 1 (fp32, same seed, SGD with
    momentum: see SGD). The 2-rank side is the zero1 run; the 1-rank run uses its spec unchanged but the folder."""
    run_dir, spec_path, proc = runs["zero1"]
    assert proc.returncode == 0, explain(proc)
    single_dir = tmp_path / "ranks1"
    single = launch(spec_path, num_ranks=1, args=("--set", f"output.dir={single_dir}"))
    assert single.returncode == 0, explain(single)
    weights, logged = {}, {}
    for ranks, folder, out in ((2, run_dir, proc.stdout), (1, single_dir, single.stdout)):
        accumulation = 2 if ranks == 1 else 1
        assert re.search(rf"accumulation\s+{accumulation}\s", out)  # same global batch, another split
        unet = folder / "export" / f"step-{STEPS:08d}" / "unet" / "diffusion_pytorch_model.safetensors"
        weights[ranks], logged[ranks] = load_file(unet), metrics(folder)
    start = load_file(next(CACHE_DIR.glob("builtin/tiny-sd*/unet/diffusion_pytorch_model.safetensors")))
    assert max((weights[2][k] - start[k]).abs().max().item() for k in start) > 1e-4  # it did train
    scale = max(w.abs().max().item() for w in weights[2].values())
    worst = max((weights[2][k] - weights[1][k]).abs().max().item() for k in weights[2])
    assert worst / scale < 1e-5, f"max |difference| / max |weight| = {worst / scale:.3g}"
    for a, b in zip(logged[2], logged[1]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert ("eval_loss" in a) == ("eval_loss" in b) == (a["step"] % EVAL["every_steps"] == 0)
        if "eval_loss" in a:  # the held-out loss of the same weights on any number of ranks
            assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
            assert a["eval_samples"] == b["eval_samples"] == 4


def test_two_sets_one_rank_x_4_accumulation_equals_two_ranks_x_2(runs, tmp_path):
    """data.sets (the zero0 run): the plan printed at the start says each set's share of the global batch; the same
    spec on 1 rank (accumulation 4) trains the same samples and noise at every step: the same losses and weights to
    1e-5 (SGD: see SGD)."""
    run_dir, spec_path, proc = runs["zero0"]
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"\ba\s+4 files x 1 = 4 samples per epoch \(25%; 1 of each global batch of 4\), 32 px, train", proc.stdout)
    assert re.search(r"\bb\s+4 files x 3 = 12 samples per epoch \(75%; 3 of each global batch of 4\), 32 px, regul",
                     proc.stdout)
    single_dir = tmp_path / "ranks1"
    single = launch(spec_path, num_ranks=1, args=("--set", f"output.dir={single_dir}"))
    assert single.returncode == 0, explain(single)
    assert re.search(r"accumulation\s+4\s", single.stdout) and re.search(r"accumulation\s+2\s", proc.stdout)
    unet = Path("export") / f"step-{STEPS:08d}" / "unet" / "diffusion_pytorch_model.safetensors"
    two, one = load_file(run_dir / unet), load_file(single_dir / unet)
    start = load_file(next(CACHE_DIR.glob("builtin/tiny-sd*/unet/diffusion_pytorch_model.safetensors")))
    assert max((two[k] - start[k]).abs().max().item() for k in start) > 1e-4  # it did train
    scale = max(w.abs().max().item() for w in two.values())
    worst = max((two[k] - one[k]).abs().max().item() for k in two)
    assert worst / scale < 1e-5, f"max |difference| / max |weight| = {worst / scale:.3g}"
    for a, b in zip(metrics(run_dir), metrics(single_dir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_two_sets_resume_mid_epoch_continues_the_same_interleaving(runs, tmp_path):
    """The zero0 run's step-2 checkpoint is mid-epoch (4 steps per epoch): the resumed run trains steps 3-4 on the
    same samples in the same order (the sampler's interleaving from its saved position), so the losses and the
    exported weights are the uninterrupted run's, bit for bit."""
    run_dir, spec_path, proc = runs["zero0"]
    assert proc.returncode == 0, explain(proc)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    (resumed / "checkpoints" / "latest").write_text("step-00000002")
    again = launch(spec_path, num_ranks=2, args=("--resume", "latest", "--set", f"output.dir={resumed}"))
    assert again.returncode == 0, explain(again)
    assert "step 2 of that epoch" in again.stdout
    first, second = metrics(run_dir), metrics(resumed)
    assert [m["step"] for m in second] == [3, 4]
    assert [m["loss"] for m in second] == [m["loss"] for m in first[2:]]
    unet = Path("export") / f"step-{STEPS:08d}" / "unet" / "diffusion_pytorch_model.safetensors"
    a, b = load_file(run_dir / unet), load_file(resumed / unet)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rank_0_writes_tensorboard_events_with_the_logged_scalars_and_the_held_out_loss(runs):
    """TensorBoard's own event reader finds every number of metrics.jsonl at its step (one writer: rank 0), the
    held-out loss at the evaluated steps, and the sample grids."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dstune.trackers import scalar_items

    run_dir, _, proc = runs["zero1"]
    assert proc.returncode == 0, explain(proc)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    logged = metrics(run_dir)
    expected: dict = {}
    for record in logged:
        for tag, value in scalar_items(record):
            expected.setdefault(tag, []).append((record["step"], value))
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/samples_per_s", "perf/data_wait_fraction",
            "memory/host_peak_gib", "eval/loss", "eval/samples"} <= set(expected)
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        read = [(event.step, event.value) for event in events.Scalars(tag)]
        assert [step for step, _ in read] == [step for step, _ in points], tag
        assert [value for _, value in read] == pytest.approx([value for _, value in points], rel=1e-6), tag
    assert [step for step, _ in expected["eval/loss"]] == [2, 4]
    assert [image.step for image in events.Images("samples")] == [0, STEPS]


def test_the_samples_page_shows_the_loss_lr_and_held_out_curves(runs):
    run_dir, _, proc = runs["zero1"]
    assert proc.returncode == 0, explain(proc)
    page = (run_dir / "samples" / "index.html").read_text()
    for series in ("loss", "eval_loss", "lr"):
        points = re.search(rf'<polyline data-series="{series}" points="([^"]*)"', page).group(1).split()
        assert len(points) == (2 if series == "eval_loss" else STEPS)


def test_resume_on_one_rank_continues_the_two_rank_run(runs, tmp_path):
    """The ZeRO-2 run's step-2 checkpoint (2 ranks x micro 2) continued on 1 rank (micro 2 x accumulation 2, the same
    global batch): DeepSpeed's universal checkpoint re-partitions the optimizer state, and steps 3-4 reproduce the
    uninterrupted run's losses and weights. The checkpoint read is left untouched; the converted copy is removed."""
    import hashlib

    from dstune.export import consolidated_state_dict

    run_dir, spec_path, proc = runs["zero2"]
    assert proc.returncode == 0, explain(proc)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    (resumed / "checkpoints" / "latest").write_text("step-00000002")
    read = resumed / "checkpoints" / "step-00000002"
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(read.iterdir())}
    single = launch(spec_path, num_ranks=1, args=("--resume", "latest", "--set", f"output.dir={resumed}",
                                                   "--set", "output.export=none"))
    assert single.returncode == 0, explain(single)
    assert "written by 2 ranks, continued on 1" in single.stdout
    assert re.search(r"accumulation\s+2\s", single.stdout)
    first, second = metrics(run_dir), metrics(resumed)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)
        assert after["lr"] == pytest.approx(before["lr"]) and after["samples"] == before["samples"]
    tag = f"step-{STEPS:08d}"
    a = consolidated_state_dict(run_dir / "checkpoints", tag, 2)
    b = consolidated_state_dict(resumed / "checkpoints", tag, 2)
    scale = max(v.abs().max().item() for v in a.values())
    assert max((a[k] - b[k]).abs().max().item() for k in a) / scale < 1e-5
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(read.iterdir())} == digest
    assert not (resumed / ".resume-universal").exists()


def test_a_resume_with_a_new_lr_trains_at_the_new_lr(runs, tmp_path):
    """--allow-spec-changes with a new train.optimizer.lr (and weight decay): DeepSpeed's load puts the checkpoint's
    param groups and LR schedule back, and dstune then replaces them with the spec's, so steps 3-4 log and take steps
    of the new LR (Adam's step is about lr per weight: ten times the LR moves the weights about ten times as far)."""
    from dstune.export import consolidated_state_dict

    run_dir, spec_path, proc = runs["zero2"]
    assert proc.returncode == 0, explain(proc)
    resumed = tmp_path / "new-lr"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    (resumed / "checkpoints" / "latest").write_text("step-00000002")
    changed = launch(spec_path, num_ranks=2, args=(
        "--resume", "latest", "--allow-spec-changes", "--set", f"output.dir={resumed}",
        "--set", "train.optimizer.lr=0.01", "--set", "train.optimizer.weight_decay=0.5"))
    assert changed.returncode == 0, explain(changed)
    assert "--allow-spec-changes: continuing with" in changed.stdout
    assert "train.optimizer.lr: 0.001 -> 0.01" in changed.stdout
    first, second = metrics(run_dir), metrics(resumed)
    assert [m["step"] for m in second] == [3, 4]
    assert [m["lr"] for m in first] == pytest.approx([1e-3] * STEPS)
    assert [m["lr"] for m in second] == pytest.approx([1e-2] * 2)
    saved = torch.load(resumed / "checkpoints" / f"step-{STEPS:08d}" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)
    assert saved["lr_scheduler"]["base_lrs"] == pytest.approx([1e-2])
    optim = torch.load(next((resumed / "checkpoints" / f"step-{STEPS:08d}").glob("*optim_states.pt")),
                       map_location="cpu", weights_only=False)
    groups = optim["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == pytest.approx([(1e-2, 0.5)] * len(groups))
    start = consolidated_state_dict(run_dir / "checkpoints", "step-00000002", 2)
    old_lr = consolidated_state_dict(run_dir / "checkpoints", f"step-{STEPS:08d}", 2)
    new_lr = consolidated_state_dict(resumed / "checkpoints", f"step-{STEPS:08d}", 2)
    moved_old = sum((old_lr[k] - start[k]).abs().sum().item() for k in start)
    moved_new = sum((new_lr[k] - start[k]).abs().sum().item() for k in start)
    assert 5 < moved_new / moved_old < 15


def test_a_resume_that_changes_the_seed_is_refused_with_the_fix(runs, tmp_path):
    """A spec change that breaks exact continuation stops the resume before any weight is loaded; one rank is
    enough (the check comes before the checkpoint is read)."""
    run_dir, spec_path, proc = runs["zero2"]
    assert proc.returncode == 0, explain(proc)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir / "checkpoints", copy / "checkpoints")
    changed = launch(spec_path, num_ranks=1, args=("--resume", "latest", "--set", f"output.dir={copy}",
                                                   "--set", "train.seed=8"))
    out = changed.stderr + changed.stdout
    assert changed.returncode == 1, explain(changed)
    assert "break exact continuation" in out and "train.seed: 7 -> 8" in out and "--allow-spec-changes" in out
    assert "Traceback" not in out and "step 1/" not in out


def test_dstune_export_consolidates_any_checkpoint_offline(runs, tmp_path):
    """`dstune export RUN --step 2` (one CPU process, no launcher) turns ZeRO-3 shards into a loadable pipeline."""
    import subprocess
    import sys

    from harness import REPO, env

    run_dir, _, proc = runs["zero3"]
    assert proc.returncode == 0, explain(proc)
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "dstune", "export", str(run_dir), "--step", "2", "--out", str(out)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, explain(done)
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(out)
    image = pipe("a blue square", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
    assert image.shape == (32, 32, 3)
    step2 = load_file(out / "unet" / "diffusion_pytorch_model.safetensors")
    final = load_file(run_dir / "export" / f"step-{STEPS:08d}" / "unet" / "diffusion_pytorch_model.safetensors")
    assert max((step2[k] - final[k]).abs().max().item() for k in final) > 0  # step 2's weights, not the last ones
    again = subprocess.run([sys.executable, "-m", "dstune", "export", str(run_dir), "--step", "3"], cwd=REPO,
                           env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "steps available: 2, 4" in again.stderr


def test_a_run_folder_with_checkpoints_is_never_overwritten(runs):
    run_dir, spec_path, proc = runs["zero2"]
    assert proc.returncode == 0, explain(proc)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    again = launch(spec_path, num_ranks=1)
    assert again.returncode == 1, explain(again)
    assert "already holds checkpoints" in again.stderr and "--resume latest" in again.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


# Measured against predicted (docs/memory.md, docs/performance.md section 5): every rank records its peak RSS per
# phase; on the CPU accelerator the model lives in host memory, so the RSS growth over the rank's own baseline (taken
# just before the model is built, after torch, DeepSpeed and the process group) is compared with the memory plan's
# per-rank prediction, which on the CPU includes the runtime reserve the accelerator's rank holds beyond the tensors.
# The baseline follows the folders' resolution: making builtin:tiny-sd on a fresh machine (CI's first run) is not
# training memory (it added 220 MB on rank 0 before the folders were resolved first).
# Tolerance (harness.memory_problems): in every phase predicted >= 0.9 x measured, and predicted <= measured + the
# phase's reserve (+ the module's fp32 weights in the load and cache phases). The same check runs on the LoRA + EMA
# runs (test_lora_ema_runs.py) and on the cached and uncached runs of test_cache.py.
@pytest.mark.parametrize("name", list(CASES))
def test_memory_records_predicted_next_to_measured(runs, name):
    import json

    run_dir, _, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    report = json.loads((run_dir / "memory.json").read_text())
    predicted = report["predicted_per_rank_bytes"]
    assert predicted and report["predicted"]["per_gpu"]["parameters_bytes"] > 0
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1]
    for record in report["ranks"]:
        phases = [p["phase"] for p in record["phases"]]
        sample = ["sample"] if name == "zero1" else []  # step 0's samples and the last step's
        assert phases == ["load", "cache", "engine", "step", *sample, "first_step", "step", *sample], phases
        assert record["rss_peak_reset"] and record["phases"][0]["peak_rss_bytes"] > record["baseline_rss_bytes"] > 0
        assert record["phases"][-1]["rss_shmem_bytes"] is not None  # the resident set by kind, which explains it
    for phase, planned, measured, ceiling in memory_phase_rows(run_dir):
        print(f"{name} {phase}: predicted {planned / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB")
    assert not memory_problems(run_dir), memory_problems(run_dir)
    assert predicted == max(row["predicted_bytes"] or 0 for row in report["phases"].values())  # no cache: None
    assert "memory: predicted" in proc.stdout and "per phase predicted / measured" in proc.stdout
    logged = metrics(run_dir)
    assert all(m["predicted_memory_bytes"] == predicted and m["peak_memory_bytes"] > 0 for m in logged)
