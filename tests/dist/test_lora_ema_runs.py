"""Real 2-rank LoRA + EMA training on CPU: adapters alone train under ZeRO 2 and 3, checkpoints hold only them, the
export is a LoRA file (kohya's scheme, sd's default, from the zero2 run; diffusers' from the zero3 run) that
StableDiffusionPipeline.load_lora_weights loads (and that changes the images),
the EMA is exported and resumes exactly, and the samples contact sheet lists every sample step.

The same LoRA run with the frozen base stored int8 (model.base_precision) trains under ZeRO 2 with losses near the
fp32-base run's, and its export is a normal LoRA for the full-precision pipeline.

Every run trains with a preservation set (differential output preservation: the base's output, adapters off, as
the target): its term is 0 at step 1 (B = 0: the adapted UNet is the base), the runs' resumes continue it exactly.

Five launches in all (zero2, zero3, int8, the zero2 resume, the zero3 resume on 1 rank), shared by every test through
the module fixture."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import REPO, base_spec, env, explain, launch, memory_problems, metrics, write_spec

pytestmark = pytest.mark.dist

STEPS = 4
LORA = {"train": "lora", "lora": {"rank": 4, "alpha": 8}}
CASES = {  # name -> (zero stage, EMA device, sample prompts, output.lora_format, model.base_precision)
    "zero2": (2, "cpu", ["a red circle", "a blue square"], None, None),  # sd's default format: kohya
    "zero3": (3, "same", ["a green triangle"], "diffusers", None),
    "int8": (2, "cpu", ["a red circle"], None, "int8"),  # zero2 with the frozen base stored int8 (bitsandbytes)
}
# Every run trains data.sets: the shapes, and the shapes again as a preservation set (differential output
# preservation: their target is the base UNet's output, the adapters switched off), so every micro batch of 2 holds
# one of each and runs the base's forward without gradients (under ZeRO 2, 3, and on the int8 base) before the
# trained one.
PRESERVATION = [{"path": "builtin:shapes", "name": "subject"},
                {"path": "builtin:shapes", "name": "keep", "role": "preservation", "loss_weight": 0.5}]
INT8_LOSS_RTOL = 0.005  # per-step loss of the int8-base run vs the fp32-base zero2 run (same seed, data, adapters)
ADAPTER_TENSORS = 64  # 32 attention projections of the tiny UNet x (A, B)
FILE_KEYS = {None: ("lora_unet_", 96), "diffusers": ("unet.", 64)}  # kohya adds one alpha per layer


def _spec(run_dir: Path, stage: int, ema_device: str, prompts: list[str], lora_format, base_precision) -> dict:
    return base_spec(
        run_dir, model={**LORA, **({"base_precision": base_precision} if base_precision else {})},
        train={"global_batch_size": 4, "micro_batch_size": 2, "gradient_accumulation_steps": None, "max_steps": STEPS,
               "optimizer": {"type": "adamw", "lr": 0.01}, "ema": {"decay": 0.8, "device": ema_device}},
        deepspeed={"zero_stage": stage},
        output={"save_every_steps": 2, "keep_last": 5, "export": "diffusers",
                **({"lora_format": lora_format} if lora_format else {})},
        sample={"prompts": prompts, "every_steps": 2 if stage == 2 else None, "steps": 2},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = {}
    for name, case in CASES.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"
        spec = _spec(run_dir, *case)
        spec["data"] = {key: value for key, value in spec["data"].items() if key != "path"}
        spec["data"]["sets"] = PRESERVATION
        spec_path = write_spec(run_dir.parent / "spec.yaml", spec)
        out[name] = (run_dir, launch(spec_path))
    run_dir, proc = out["zero2"]
    resumed = run_dir.parent / "resumed"
    if proc.returncode == 0:  # resume from the step-2 checkpoint into a fresh folder: steps 3-4 again
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(run_dir / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
        (resumed / "checkpoints" / "latest").write_text("step-00000002")
        out["resumed"] = (resumed, launch(run_dir.parent / "spec.yaml", args=(
            "--resume", "latest", "--set", f"output.dir={resumed}")))
    run_dir, proc = out["zero3"]
    on_one = run_dir.parent / "on-one-rank"
    if proc.returncode == 0:  # the ZeRO-3 step-2 checkpoint continued on 1 rank (micro 2 x accumulation 2)
        (on_one / "checkpoints").mkdir(parents=True)
        shutil.copytree(run_dir / "checkpoints" / "step-00000002", on_one / "checkpoints" / "step-00000002")
        (on_one / "checkpoints" / "latest").write_text("step-00000002")
        out["zero3-on-1"] = (on_one, launch(run_dir.parent / "spec.yaml", num_ranks=1, args=(
            "--resume", "latest", "--set", f"output.dir={on_one}", "--set", "output.export=none",
            "--set", "sample.prompts=[]")))
    return out


def _ok(runs, name):
    run_dir, proc = runs[name]
    assert proc.returncode == 0, explain(proc)
    return run_dir


def _lora_file(folder: Path) -> dict:
    return load_file(folder / "pytorch_lora_weights.safetensors")


def _render(pipe) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                 generator=generator).images[0]
    return torch.as_tensor(image)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_memory_plan_holds_with_lora_ema_and_samples(runs, name):
    """Per phase, the plan within the tolerance of docs/performance.md section 5 (harness.memory_problems): ZeRO 2
    with the EMA on the host, ZeRO 3 with the EMA beside the model and DOP's extra forward, both rendering
    samples."""
    run_dir = _ok(runs, name)
    assert not memory_problems(run_dir), memory_problems(run_dir)
    assert "preservation, loss weight 0.5; target: the base model's output" in runs[name][1].stdout


@pytest.mark.parametrize("name", list(CASES))
def test_lora_trains_only_the_adapters(runs, name):
    run_dir = _ok(runs, name)
    stdout = runs[name][1].stdout
    assert "training: LoRA rank 4, alpha 8 on 32 layers" in stdout
    # ZeRO-3: the UNet was built partitioned (no rank loaded it whole), then got its adapters
    assert ("UNet2DConditionModel built partitioned (ZeRO-3" in stdout) == (CASES[name][0] == 3)
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in logged)
    # The consolidated checkpoint (what DeepSpeed's optimizer owned) is the adapters alone: the base UNet was
    # neither optimized nor saved, so it is the pretrained folder's, bit for bit.
    from dstune.export import consolidated_state_dict

    state = consolidated_state_dict(run_dir / "checkpoints", f"step-{STEPS:08d}", CASES[name][0])
    assert len(state) == ADAPTER_TENSORS
    assert all(".lora_A.default." in k or ".lora_B.default." in k for k in state)
    assert all(torch.any(v != 0) for k, v in state.items() if ".lora_B." in k)  # B starts at 0: it trained


@pytest.mark.parametrize("name", list(CASES))
def test_export_loads_into_stable_diffusion_and_changes_the_images(runs, name):
    from diffusers import StableDiffusionPipeline

    export = _ok(runs, name) / "export" / f"step-{STEPS:08d}"
    info = json.loads((export / "dstune_lora.json").read_text())
    assert info["weights"] == "ema" and info["rank"] == 4
    assert info["format"] == (CASES[name][3] or "kohya")
    layers = _lora_file(export)
    prefix, count = FILE_KEYS[CASES[name][3]]
    assert len(layers) == count and all(k.startswith(prefix) for k in layers)
    pipe = StableDiffusionPipeline.from_pretrained(info["base_folder"], safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    before = _render(pipe)
    pipe.load_lora_weights(export)
    assert (before - _render(pipe)).abs().max().item() > 1e-4


def test_export_holds_the_ema_not_the_raw_adapters(runs):
    from dstune.ema import consolidated_ema, overlay_ema
    from dstune.export import consolidated_state_dict
    from dstune.families.lora import kohya_lora_tensors

    run_dir = _ok(runs, "zero2")  # exported in sd's default format, kohya
    folder = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    raw = consolidated_state_dict(folder.parent, folder.name, 2)
    ema = consolidated_ema(folder)
    assert set(ema) == set(raw)
    exported = _lora_file(run_dir / "export" / folder.name)
    expected = kohya_lora_tensors(overlay_ema(raw, ema), alpha=8)
    assert set(exported) == set(expected)
    assert max((exported[k] - expected[k]).abs().max().item() for k in expected) == 0
    assert max((ema[k] - raw[k]).abs().max().item() for k in raw) > 0  # EMA lags the trained adapters


def test_ema_run_resumes_exactly(runs):
    """Steps 3-4 after resuming from step 2 reproduce the losses, the EMA and the exported (EMA) LoRA."""
    run_dir = _ok(runs, "zero2")
    resumed = _ok(runs, "resumed")
    assert "resumed from" in runs["resumed"][1].stdout
    first, second = metrics(run_dir), metrics(resumed)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)
    tag = f"step-{STEPS:08d}"
    for rank in (0, 1):
        a = torch.load(run_dir / "checkpoints" / tag / f"ema_rank{rank}.pt", weights_only=True)
        b = torch.load(resumed / "checkpoints" / tag / f"ema_rank{rank}.pt", weights_only=True)
        assert (a["optimizer_steps"], a["updates"]) == (b["optimizer_steps"], b["updates"]) == (STEPS, STEPS)
        assert max((a["shards"][k] - b["shards"][k]).abs().max().item() for k in a["shards"]) <= 1e-6
    x, y = _lora_file(run_dir / "export" / tag), _lora_file(resumed / "export" / tag)
    assert max((x[k] - y[k]).abs().max().item() for k in x) <= 1e-6


def test_int8_base_trains_like_the_full_precision_base(runs):
    """Same seed, data and adapter init as the zero2 run; only the frozen base is int8. The loss follows the
    fp32-base run within INT8_LOSS_RTOL at every step (measured: within 1e-4; the int8 UNet's output differs by
    ~0.2 %) without being the same numbers (the base really is int8), and the adapters end close to that run's."""
    from dstune.export import consolidated_state_dict

    full, int8 = _ok(runs, "zero2"), _ok(runs, "int8")
    assert "frozen base int8: " in runs["int8"][1].stdout
    pairs = list(zip(metrics(full), metrics(int8)))
    assert len(pairs) == STEPS
    for a, b in pairs:
        assert b["loss"] == pytest.approx(a["loss"], rel=INT8_LOSS_RTOL)
    assert any(a["loss"] != b["loss"] for a, b in pairs)
    tag = f"step-{STEPS:08d}"
    a, b = (consolidated_state_dict(d / "checkpoints", tag, 2) for d in (full, int8))
    assert set(a) == set(b)
    diff = sum((a[k] - b[k]).norm() ** 2 for k in a) ** 0.5 / sum(a[k].norm() ** 2 for k in a) ** 0.5
    assert diff.item() < 0.1


def test_zero3_partitioned_build_starts_from_the_pretrained_weights(runs):
    """The ZeRO-3 run's UNet was built partitioned (deepspeed.zero.Init, filled from the safetensors one parameter
    at a time); the ZeRO-2 run's was loaded whole. Same seed and data, and B = 0 at the first step, so the first
    loss is the base UNet's on the same batch: equal only if the partitioned build read every weight right."""
    first = [metrics(_ok(runs, name))[0]["loss"] for name in ("zero2", "zero3")]
    assert first[1] == pytest.approx(first[0], rel=1e-6)


def test_contact_sheet_lists_every_sample_step(runs):
    for name, steps in (("zero2", (0, 2, 4)), ("zero3", (0, 4))):
        samples = _ok(runs, name) / "samples"
        page = (samples / "index.html").read_text()
        for step in steps:
            assert f"<h2>step {step}</h2>" in page and f'src="step-{step:06d}.png"' in page
            assert (samples / f"step-{step:06d}.png").is_file()
        assert page.count('<section id="step-') == len(steps)
        assert "EMA weights" in page
        for prompt in CASES[name][2]:
            assert prompt in page


def test_dstune_export_of_a_zero3_checkpoint_yields_the_lora_file(runs, tmp_path):
    """Offline, one process: ZeRO-3 adapter shards and EMA shares are gathered into a loadable LoRA file."""
    run_dir = _ok(runs, "zero3")
    out = tmp_path / "step2"
    done = subprocess.run([sys.executable, "-m", "dstune", "export", str(run_dir), "--step", "2", "--out", str(out)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, explain(done)
    step2, final = _lora_file(out), _lora_file(run_dir / "export" / f"step-{STEPS:08d}")
    assert set(step2) == set(final)
    assert max((step2[k] - final[k]).abs().max().item() for k in final) > 0  # step 2's adapters, not the last


def test_dstune_export_rewrites_a_diffusers_run_as_a_comfyui_file(runs, tmp_path):
    """--lora-format replaces the run's output.lora_format: the zero3 run (diffusers) exported again for ComfyUI
    (sd: kohya's scheme) holds the same adapters under kohya names with alpha 8."""
    run_dir = _ok(runs, "zero3")
    done = subprocess.run([sys.executable, "-m", "dstune", "export", str(run_dir), "--lora-format", "comfyui",
                           "--out", str(tmp_path / "comfy")], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, explain(done)
    info = json.loads((tmp_path / "comfy" / "dstune_lora.json").read_text())
    assert (info["format"], info["key_scheme"]) == ("comfyui", "kohya")
    comfy, diffusers = _lora_file(tmp_path / "comfy"), _lora_file(run_dir / "export" / f"step-{STEPS:08d}")
    assert len(comfy) == 96 and all(comfy[k].item() == 8 for k in comfy if k.endswith(".alpha"))
    for key, tensor in diffusers.items():  # unet.<layer>.lora_A.weight <-> lora_unet_<layer>.lora_down.weight
        layer, part = key.removeprefix("unet.").rsplit(".lora_", 1)
        kohya = f"lora_unet_{layer.replace('.', '_')}.{'lora_down' if part == 'A.weight' else 'lora_up'}.weight"
        assert torch.equal(comfy[kohya], tensor)


def test_zero3_lora_ema_run_continues_on_one_rank_exactly(runs):
    """The 2-rank ZeRO-3 LoRA run's step-2 checkpoint (only the adapters, no frozen base) continued on 1 rank: the
    adapters' optimizer state is re-partitioned (DeepSpeed's universal checkpoint) and the two EMA shares are joined
    into one; steps 3-4 reproduce the losses, the adapters and the EMA of the uninterrupted run."""
    from dstune.ema import consolidated_ema
    from dstune.export import consolidated_state_dict

    run_dir, on_one = _ok(runs, "zero3"), _ok(runs, "zero3-on-1")
    assert "written by 2 ranks, continued on 1" in runs["zero3-on-1"][1].stdout
    first, second = metrics(run_dir), metrics(on_one)
    assert [m["step"] for m in second] == [3, 4]
    for before, after in zip(first[2:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)
    tag = f"step-{STEPS:08d}"
    for load in (lambda d: consolidated_state_dict(d / "checkpoints", tag, 3),
                 lambda d: consolidated_ema(d / "checkpoints" / tag)):
        a, b = load(run_dir), load(on_one)
        assert set(a) == set(b) and len(a) == ADAPTER_TENSORS
        scale = max(v.abs().max().item() for v in a.values())
        assert max((a[k] - b[k]).abs().max().item() for k in a) / scale < 1e-5
    share = torch.load(on_one / "checkpoints" / tag / "ema_rank0.pt", weights_only=True)
    assert (share["world_size"], share["optimizer_steps"], share["updates"]) == (1, STEPS, STEPS)
    assert not (on_one / ".resume-universal").exists()
