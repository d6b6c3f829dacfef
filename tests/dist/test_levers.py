"""The memory and speed levers on 2 ranks, in real `dstune train` runs of tiny-flux's LoRA under ZeRO 2 with gradient
checkpointing (fp32, the same seed and data): model.activation_offload cpu gives the plain run's per-step losses
bitwise, train.compile blocks (inductor, on the CPU) within 1e-5, and each resumes from its step-2 checkpoint
exactly; deepspeed.bf16_optimizer_states (bf16, optimizer offload) trains; model.text_encoder_offload builds the text cache
entry for entry as the run without it (and trains the same, bitwise); model.transformer_file (a scaled fp8 file written
from tiny-flux's weights) trains with losses within FP8_TOLERANCE of the plain run's and resumes exactly (its frozen
base read from the file again). Each lever's memory plan holds what its
run measured (predicted >= 0.9 x measured in every phase, as the phase tests hold it). Six 2-rank launches of
tests/dist/scripts/train_runs.py (LAUNCHES), the resumes after the runs whose checkpoints they continue. An int8
base under ZeRO-3 (bf16) trains within INT8_TOLERANCE of the bf16 base's losses, and each rank stores the int8 bytes
the plan says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flow_runs import flow_spec
from harness import CACHE_DIR, MEMORY_FLOOR, explain, launch, memory_phase_rows, metrics, write_spec

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_runs.py"
MODEL = "tiny-flux"
# name -> spec changes on top of flow_spec's LoRA run (section -> values)
LEVERS = {
    "activation-offload": {"model": {"activation_offload": "cpu"}},
    "plain": {},
    "compiled": {"train": {"compile": "blocks"}},
    "bf16-states": {
        "train": {"precision": "bf16"},
        "deepspeed": {"offload_optimizer": "cpu", "bf16_optimizer_states": True},
    },
    # the text cache (each run its own folder), built with the text encoders in host memory, and without
    "text-offload": {"model": {"text_encoder_offload": "cpu"}, "data": {"cache": {"text_embeddings": True}}},
    "text-cached": {"data": {"cache": {"text_embeddings": True}}},
    "fp8-file": {"model": {"transformer_file": "written by the fixture"}},
    # model.base_precision int8 under ZeRO-3 (dstune's Int8Linear, partitioned) and the same run on the bf16 base
    "int8-zero3": {"model": {"base_precision": "int8"}, "train": {"precision": "bf16"}, "deepspeed": {"zero_stage": 3}},
    "bf16-zero3": {"train": {"precision": "bf16"}, "deepspeed": {"zero_stage": 3}},
    # the fp8 file under ZeRO-3: its 1-byte layers partitioned from host memory as the int8 base's are
    "fp8-file-zero3": {"model": {"transformer_file": "written by the fixture"}, "train": {"precision": "bf16"},
                       "deepspeed": {"zero_stage": 3}},
}
RESUMED = ["activation-offload", "compiled", "fp8-file"]
# Six launches, each lever's run first in its own: a launch's first run is measured from a fresh process (a later
# run reuses the heap the earlier ones freed, and measures less); the plain run, the bf16 base's and the resumes follow.
LAUNCHES = [["activation-offload", "plain", "activation-offload-resumed"], ["compiled", "compiled-resumed"],
            ["bf16-states"], ["fp8-file", "fp8-file-resumed"], ["text-offload", "text-cached"],
            ["int8-zero3", "bf16-zero3", "fp8-file-zero3"]]
MEASURED_FRESH = ["activation-offload", "compiled", "bf16-states", "fp8-file", "text-offload", "int8-zero3"]
COMPILED_TOLERANCE = 1e-5  # inductor's fused kernels round fp32 differently from eager's, step by step
FP8_TOLERANCE = 0.01  # relative, per step: the fp8 base's LoRA loss against the fp32 base's (unit test: 0.19 %)
# the int8 base's per-step losses against the bf16 base's (measured: 1.1e-4 at most over the 4 steps): each weight
# within half a scale step (absmax / 254) of the bf16 one
INT8_TOLERANCE = 2e-3


def _spec(run_dir: Path, changes: dict) -> dict:
    spec = flow_spec(run_dir, MODEL, 2, "lora")
    spec["output"]["export"] = "none"
    for section, values in changes.items():
        if section == "data":  # the cache's other keys (its folder) stay
            values = {**values, "cache": {**spec["data"]["cache"], **values.get("cache", {})}}
        spec[section] = {**spec[section], **values}
    return spec


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """name -> run dir, resumed name -> its resume's run dir, and the one launch."""
    from dstune.builtin import ensure_builtin_model

    ensure_builtin_model(MODEL, CACHE_DIR)
    root = tmp_path_factory.mktemp("levers")
    runs, resumes, line = {}, {}, {}
    fp8_file = root / "tiny-flux-fp8-scaled.safetensors"
    _write_fp8_file(fp8_file)
    LEVERS["fp8-file"]["model"]["transformer_file"] = str(fp8_file)
    LEVERS["fp8-file-zero3"]["model"]["transformer_file"] = str(fp8_file)
    for name, changes in LEVERS.items():
        run_dir = root / name / "run"
        run_dir.parent.mkdir(parents=True)
        line[name] = str(write_spec(run_dir.parent / "spec.yaml", _spec(run_dir, changes)))
        runs[name] = run_dir
    for name in RESUMED:
        run_dir = root / f"{name}-resumed" / "run"
        run_dir.parent.mkdir(parents=True)
        spec_path = write_spec(run_dir.parent / "spec.yaml", _spec(run_dir, LEVERS[name]))
        resumes[name] = run_dir
        line[f"{name}-resumed"] = f"{spec_path} --resume {runs[name] / 'checkpoints' / 'step-00000002'}"
    procs = []
    for number, names in enumerate(LAUNCHES):
        listed = root / f"runs-{number}.txt"
        listed.write_text("\n".join(line[name] for name in names) + "\n")
        procs.append(launch(listed, num_ranks=2, script=SCRIPT))
    failed = [proc for proc in procs if proc.returncode != 0]
    return runs, resumes, failed[0] if failed else procs[1]  # the compiled launch's output, for its log lines


def _write_fp8_file(path: Path) -> None:
    """tiny-flux's transformer as ComfyUI's scaled fp8 file (the unit tests' writer)."""
    import sys

    from diffusers import FluxTransformer2DModel

    from dstune.builtin import ensure_builtin_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the unit tests' file writer
    from quantized_files import write_scaled_fp8

    transformer = FluxTransformer2DModel.from_pretrained(ensure_builtin_model(MODEL, CACHE_DIR) / "transformer")
    write_scaled_fp8(transformer, path, prefix="model.diffusion_model.")


def _losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in metrics(run_dir)]


def test_activation_offload_gives_the_plain_runs_losses_bitwise(launched):
    runs, _, proc = launched
    assert proc.returncode == 0, explain(proc)
    plain = _losses(runs["plain"])
    assert len(plain) == 4 and all(torch.isfinite(torch.tensor(plain)))
    assert _losses(runs["activation-offload"]) == plain


def test_compiled_blocks_give_the_plain_runs_losses_within_1e_5_and_say_their_compile_time(launched):
    runs, _, proc = launched
    assert proc.returncode == 0, explain(proc)
    compiled, plain = _losses(runs["compiled"]), _losses(runs["plain"])
    print("plain", plain, "compiled", compiled, "largest relative difference",
          max(abs(a - b) / abs(b) for a, b in zip(compiled, plain)))
    assert compiled == pytest.approx(plain, rel=COMPILED_TOLERANCE)
    assert "train.compile blocks: " in proc.stdout and "compiled with torch.compile" in proc.stdout
    said = [line for line in proc.stdout.splitlines() if "train.compile" in line]
    print("\n".join(said))
    # the compiled run's line and its resume's (the same process: its seconds are its own, not the first run's too)
    seconds = [float(line.split("train.compile: ")[1].split(" s ")[0]) for line in said if "went to compiling" in line]
    assert len(seconds) == 2 and seconds[0] > 0


@pytest.mark.parametrize("name", RESUMED)
def test_a_resume_with_each_lever_continues_exactly(launched, name):
    runs, resumes, proc = launched
    assert proc.returncode == 0, explain(proc)
    first, second = metrics(runs[name]), metrics(resumes[name])
    assert [m["step"] for m in second] == [3, 4]
    assert [m["loss"] for m in second] == [m["loss"] for m in first[2:]]


def test_text_encoder_offload_builds_the_same_text_cache_and_trains_the_same(launched):
    """model.text_encoder_offload: every text cache entry the 2 ranks built equals, tensor for tensor, the entry of
    the run without it, and the per-step losses are the same bitwise."""
    from safetensors.torch import load_file

    runs, _, proc = launched
    assert proc.returncode == 0, explain(proc)
    offloaded, cached = (_entries(runs[name].parent / "cache") for name in ("text-offload", "text-cached"))
    assert offloaded and sorted(offloaded) == sorted(cached)
    for name, path in offloaded.items():
        got, expected = load_file(path), load_file(cached[name])
        assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected), name
    assert _losses(runs["text-offload"]) == _losses(runs["text-cached"])


def _entries(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p for p in folder.rglob("*.safetensors")}


def test_a_lora_trains_on_a_quantized_fp8_file_near_the_full_precision_base(launched):
    """model.transformer_file: the frozen base read from a scaled fp8 file, the same run otherwise as the plain
    one (fp32, same draws): every step's loss within FP8_TOLERANCE of the plain run's, and not equal to it (the
    rounded base is the one trained on)."""
    runs, _, proc = launched
    assert proc.returncode == 0, explain(proc)
    fp8, plain = _losses(runs["fp8-file"]), _losses(runs["plain"])
    print("plain", plain, "fp8 file", fp8, "largest relative difference",
          max(abs(a - b) / abs(b) for a, b in zip(fp8, plain)))
    assert len(fp8) == 4 and fp8 == pytest.approx(plain, rel=FP8_TOLERANCE) and fp8 != plain


def test_bf16_optimizer_states_train(launched):
    runs, _, proc = launched
    assert proc.returncode == 0, explain(proc)
    losses = _losses(runs["bf16-states"])
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("name", MEASURED_FRESH)
def test_each_levers_memory_plan_holds_what_its_run_measured(launched, name):
    runs, _, proc = launched
    assert proc.returncode == 0, explain(proc)
    rows = memory_phase_rows(runs[name])
    for phase, predicted, measured, _ in rows:
        print(f"{name} {phase}: predicted {predicted / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB")
    low = [(phase, predicted, measured) for phase, predicted, measured, _ in rows if predicted < MEMORY_FLOOR * measured]
    assert not low, low


def test_an_int8_base_under_zero3_trains_near_the_bf16_base_and_stores_what_the_plan_says(launched):
    """model.base_precision int8 under ZeRO-3 on 2 CPU ranks: its per-step losses within INT8_TOLERANCE of the same
    LoRA run's on the bf16 base (same draws), not equal to them (the base is quantized); each rank stores its int8
    partitions as int8, as many bytes as the plan's int8 codes per rank (memory.json's quantized_base)."""
    import json

    runs, _, proc = launched
    assert proc.returncode == 0, explain(proc)
    int8, bf16 = _losses(runs["int8-zero3"]), _losses(runs["bf16-zero3"])
    print("bf16 base", bf16, "int8 base", int8, "largest relative difference",
          max(abs(a - b) / abs(b) for a, b in zip(int8, bf16)))
    assert len(int8) == 4 and int8 == pytest.approx(bf16, rel=INT8_TOLERANCE) and int8 != bf16
    measured = json.loads((runs["int8-zero3"] / "matrix.json").read_text())
    planned = json.loads((runs["int8-zero3"] / "memory.json").read_text())["predicted"]["parameters"]["quantized_base"]
    print("int8 / frozen partition bytes per rank", measured["int8_partition_bytes"],
          measured["frozen_partition_bytes"], "planned", planned)
    assert measured["int8_partition_bytes"] == [planned["int8_codes_bytes_per_rank"]] * 2
    assert measured["frozen_partition_bytes"] == [planned["stored_bytes_per_rank"]] * 2
    assert "int8_partition_bytes" not in json.loads((runs["bf16-zero3"] / "matrix.json").read_text())


def test_a_quantized_file_under_zero3_trains_near_the_bf16_base_and_each_rank_stores_half_its_bytes(launched):
    """model.transformer_file under ZeRO-3 (bf16): the file's layers (fp8 held as int8, the scales' bits as int32)
    partitioned from host memory like the int8 base: per-step losses within FP8_TOLERANCE of the bf16 base's, and
    each rank stores half the file's 1-byte weights, as int8 partitions."""
    import json

    from safetensors import safe_open

    runs, _, proc = launched
    assert proc.returncode == 0, explain(proc)
    fp8, bf16 = _losses(runs["fp8-file-zero3"]), _losses(runs["bf16-zero3"])
    print("bf16 base", bf16, "fp8 file", fp8, "largest relative difference",
          max(abs(a - b) / abs(b) for a, b in zip(fp8, bf16)))
    assert len(fp8) == 4 and fp8 == pytest.approx(bf16, rel=FP8_TOLERANCE) and fp8 != bf16
    with safe_open(LEVERS["fp8-file-zero3"]["model"]["transformer_file"], framework="pt") as file:
        weights = [file.get_tensor(key) for key in file.keys()]
    share = sum(-(-t.numel() // 2) for t in weights if t.element_size() == 1 and t.dim() == 2)  # each rank's half
    measured = json.loads((runs["fp8-file-zero3"] / "matrix.json").read_text())
    print("int8 partition bytes per rank", measured["int8_partition_bytes"], "half the file's 1-byte weights", share)
    assert measured["int8_partition_bytes"] == [share] * 2
