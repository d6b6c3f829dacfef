"""The memory plan per phase (dstune.memory.phases): load, cache build, step, samples; the peak is the largest and the
verdict and every suggestion use it. Pure arithmetic on hand-made counts (torch-free, milliseconds), plus one real
launch spec through `dstune validate --json`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dstune.memory.plan import OVERLAP_COMM_FACTOR, ModelCounts, Setup, estimate
from dstune.memory.reserve import RUNTIME_RESERVE_BYTES
from dstune.memory.verdict import memory_json

REPO = Path(__file__).resolve().parents[2]
P, ENCODER, VAE = 2_000_000_000, 8_000_000_000, 100_000_000  # a 2 B module, an 8 B text encoder, a VAE


def setup(stage: int = 2, world: int = 8, **extra) -> Setup:
    values = dict(
        world_size=world,
        ranks_per_node=world,
        zero_stage=stage,
        offload_optimizer="none",
        offload_param="none",
        precision="bf16",
        optimizer="adamw",
        momentum=0.0,
        micro_batch=1,
        accumulation=1,
        gradient_checkpointing=True,
        lora=False,
        reduce_bucket=50_000_000,
        allgather_bucket=50_000_000,
        prefetch_bucket=45_000_000,
        overlap_comm=False,
    )
    return Setup(**{**values, **extra})


def counts(cached: tuple = ("text_encoder", "vae"), trainable: int = P, **extra) -> ModelCounts:
    return ModelCounts(
        "transformer",
        P,
        trainable,
        50_000_000,
        {"text_encoder": ENCODER, "vae": VAE},
        cached,
        activation_sample_bytes=4_000_000_000,
        checkpointed_sample_bytes=1_000_000_000,
        **extra,
    )


def test_the_cache_and_load_phases_hold_every_encoder_and_the_step_only_the_uncached():
    result = estimate(counts(), setup())
    encoders = 2 * (ENCODER + VAE)
    assert result.frozen == 0  # both encoders replaced by the cache during steps
    # built before deepspeed.initialize: the module in bf16 (2 bytes a parameter) beside every encoder
    assert result.phases["load"].per_gpu == result.phases["cache"].per_gpu == 2 * P + encoders + RUNTIME_RESERVE_BYTES
    assert result.peak == max(phase.per_gpu for phase in result.phases.values()) > result.total
    uncached = estimate(counts(cached=()), setup())
    assert "cache" not in uncached.phases and uncached.frozen == encoders
    # ZeRO-3 builds the module partitioned: a share and one gathered layer at load
    partitioned = estimate(counts(builds_partitioned=True), setup(3))
    assert (
        partitioned.phases["load"].parts["trainable module (training dtype, or its ZeRO-3 share)"]
        == 2 * P / 8 + 2 * 50_000_000
    )


def test_the_verdict_uses_the_peak():
    model = counts(builds_partitioned=True)
    result = estimate(model, setup())
    budget = result.peak - 1e9  # the step fits, the start-up does not; ZeRO-3 partitioned loading relieves it
    memory = memory_json(model, setup(), budget)
    assert memory["fits"] is False and memory["peak_phase"] == "load"
    assert memory["phases"]["step"]["per_gpu_bytes"] == memory["per_gpu"]["total_bytes"] < budget
    assert memory["suggestions"] == []  # dstune.memory_advice re-plans the spec (tests/unit/test_memory_advice.py)


def test_ema_is_counted_in_every_phase_after_the_engine_and_swapped_in_for_samples():
    plain = estimate(counts(), setup(samples=True))
    on_gpu = estimate(counts(), setup(samples=True, ema_device="same", ema_in_samples=True))
    assert on_gpu.ema == 4 * P / 8 and on_gpu.total == pytest.approx(plain.total + 4 * P / 8)
    # ZeRO 0-2: sampling with the EMA keeps the raw bf16 weights aside, a full copy on the EMA's device
    assert on_gpu.phases["sample"].per_gpu == pytest.approx(plain.phases["sample"].per_gpu + 4 * P / 8 + 2 * P)
    zero3 = estimate(counts(), setup(3, samples=True, ema_device="same", ema_in_samples=True))
    assert zero3.phases["sample"].parts["EMA swap (raw weights kept aside)"] == 2 * P / 8
    on_host = estimate(counts(), setup(samples=True, ema_device="cpu", ema_in_samples=True))
    assert on_host.ema == 0 and on_host.phases["sample"].per_gpu == plain.phases["sample"].per_gpu
    assert on_host.host_per_rank == pytest.approx(max(plain.host_per_rank, 2 * (ENCODER + VAE) + 4 * P / 8 + 2 * P))


def test_overlap_comm_buffers_follow_deepspeeds_documented_factor():
    lora = counts(trainable=10_000_000)
    quiet, overlapped = estimate(lora, setup()), estimate(lora, setup(overlap_comm=True))
    # on a GPU the reduce bucket is allocated whole (50 M elements) even for 10 M trainable parameters
    assert quiet.buffers == 2 * (50_000_000 + 10_000_000)
    assert overlapped.buffers == OVERLAP_COMM_FACTOR * 2 * (50_000_000 + 10_000_000)
    on_cpu = estimate(lora, setup(accelerator="cpu"))
    assert on_cpu.buffers == 2 * (10_000_000 + 10_000_000)  # untouched pages of a host buffer are not resident


def test_a_quantized_lora_base_loads_quantized_and_the_host_warning_names_what_lowers_it():
    lora = counts(trainable=10_000_000, builds_partitioned=True)
    int8 = estimate(lora, setup(lora=True, base_bytes_per_param=1.0))
    # the base reaches the GPU quantized: 1 byte a parameter beside the bf16 adapters
    assert int8.phases["load"].parts["trainable module (training dtype, or its ZeRO-3 share)"] == P + 2 * 10_000_000
    big = memory_json(replace(lora, module_params=20_000_000_000), setup(lora=True), None)
    assert big["host_per_node_bytes"] > 512e9 and "deepspeed.zero_stage=3" in big["host_warning"]
    assert memory_json(lora, setup(lora=True), None)["host_warning"] is None


def test_validate_json_gives_each_phase_and_the_peak(capsys):
    from dstune.cli import main

    spec = str(REPO / "launch" / "qwen-image-lora-zero3-8gpu.yaml")
    assert main(["validate", spec, "--num-gpus", "8", "--num-samples", "20000", "--json", "--gpu-memory", "16GB"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    phases = memory["phases"]
    assert set(phases) == {"load", "cache", "step", "sample"}
    assert memory["peak_per_gpu_bytes"] == max(p["per_gpu_bytes"] for p in phases.values())
    # the step alone would fit 16 GB; the 8.3 B text encoder beside the module while the cache is built does not
    assert phases["step"]["per_gpu_bytes"] < 16e9 < phases["cache"]["per_gpu_bytes"] and memory["fits"] is False
    assert memory["peak_phase"] in ("load", "cache", "sample")


def test_zero3_keeps_the_persistent_tensors_and_the_parameters_it_reuses_gathered():
    from dstune.memory.plan import persistent_params, zero3_gathered_bytes

    small = ((3072, 400), (65_536, 10), (200_000, 5))  # biases and norms, one mid-size tensor kind
    model = counts(small_tensors=small)
    # tensors of at most stage3_param_persistence_threshold elements stay whole on every rank
    assert persistent_params(model, setup(3, persistence_threshold=70_710)) == 3072 * 400 + 65_536 * 10
    assert persistent_params(model, setup(3, persistence_threshold=1_000)) == 0
    persistent = 3072 * 400 + 65_536 * 10
    # a 2 B module is larger than half the reuse distance (1e9): its last 5e8 elements stay gathered from the
    # forward pass to the backward pass; the largest layer is already in `parameters` (2L)
    big = zero3_gathered_bytes(model, setup(3, persistence_threshold=70_710))
    assert big == 2 * (persistent + 500_000_000 - 50_000_000)
    # a module below that stays gathered whole; stage3_max_live_parameters caps it
    smaller = replace(model, module_params=300_000_000, trainable_params=300_000_000)
    assert zero3_gathered_bytes(smaller, setup(3, persistence_threshold=70_710)) == 2 * (
        persistent + 300_000_000 - persistent - 50_000_000
    )
    assert zero3_gathered_bytes(
        smaller, setup(3, persistence_threshold=70_710, max_live_parameters=100_000_000)
    ) == 2 * (persistent + 100_000_000 - persistent - 50_000_000)
    # counted in the ZeRO-3 step's buffers beside the reduce bucket and its interleaved copy
    result = estimate(model, setup(3, persistence_threshold=70_710))
    assert result.buffers == 2 * 50_000_000 + 2 * 50_000_000 + big
    # samples (forward passes only): a parameter's next use is a whole module away, so a module within the reuse
    # distance stays gathered whole, a larger one keeps only its persistent tensors and the prefetch bucket
    # (+ the reduce bucket, which stage 3 allocates once and keeps: 50 M elements in bf16)
    key = "ZeRO-3 gathered parameters and reduce bucket"
    sampled = estimate(model, setup(3, persistence_threshold=70_710, samples=True)).phases["sample"].parts
    assert sampled[key] == 2 * persistent + 2 * 50_000_000  # prefetch bucket (45 M) < largest layer (50 M)
    sampled = estimate(smaller, setup(3, persistence_threshold=70_710, samples=True)).phases["sample"].parts
    assert sampled[key] == 2 * (300_000_000 - 50_000_000) + 2 * 50_000_000
    assert estimate(model, setup(2, samples=True)).phases["sample"].parts[key] == 0


def test_the_optimizer_steps_temporaries_count_where_they_exceed_the_freed_activations():
    from dstune.memory.plan import optimizer_step_temporaries

    # GPU: torch's foreach AdamW takes the square root of every second moment of the rank's flat partition at once
    assert optimizer_step_temporaries(counts(), setup(2)) == 4 * P / 8
    quiet = replace(counts(), checkpointed_sample_bytes=100_000_000)  # activations 100 MB, temporaries 1 GB
    assert estimate(quiet, setup(2)).step_temporaries == 4 * P / 8 - 100_000_000
    assert estimate(counts(), setup(2)).step_temporaries == 0  # 1 GB of activations, freed before the step, cover it
    # CPU: the single-tensor AdamW makes two temporaries of the tensor it steps; SGD and offloaded Adam: in place
    assert optimizer_step_temporaries(counts(), setup(2, accelerator="cpu")) == 8 * P / 8
    assert optimizer_step_temporaries(counts(), setup(0, accelerator="cpu", precision="fp32")) == 8 * 50_000_000
    assert optimizer_step_temporaries(counts(), setup(2, optimizer="sgd", momentum=0.9)) == 0
    assert optimizer_step_temporaries(counts(), setup(2, offload_optimizer="cpu")) == 0


def test_on_the_cpu_accelerator_the_reserve_comes_with_the_first_step_and_offload_stays_in_the_rank():
    from dstune.memory.reserve import (
        CPU_BF16_KERNELS_BYTES,
        CPU_RESERVE_PER_MODULE_PARAM,
        CPU_RUNTIME_RESERVE_BYTES,
        CPU_STARTUP_RESERVE_BYTES,
    )

    result = estimate(counts(), setup(2, accelerator="cpu", samples=True))  # bf16
    # the kept heap grows with the module; bf16's matmuls keep the oneDNN kernels they compiled
    reserve = CPU_RUNTIME_RESERVE_BYTES + CPU_RESERVE_PER_MODULE_PARAM * P + CPU_BF16_KERNELS_BYTES
    assert result.reserve == reserve
    assert result.phases["step"].parts["runtime reserve"] == result.phases["sample"].parts["runtime reserve"] == reserve
    # the libraries of the step load lazily, at the first step: before it, the loading code's own
    assert result.phases["load"].parts["runtime reserve"] == CPU_STARTUP_RESERVE_BYTES
    gpu = estimate(counts(), setup(2, samples=True))
    assert gpu.phases["load"].parts["runtime reserve"] == RUNTIME_RESERVE_BYTES  # the CUDA context, from the start
    # optimizer offload moves the states to the host: off a GPU, but on the CPU accelerator the same memory
    offloaded = setup(2, offload_optimizer="cpu", optimizer="sgd", momentum=0.9)
    assert estimate(counts(), offloaded).optimizer == 0
    on_cpu = estimate(counts(), replace(offloaded, accelerator="cpu"))
    assert on_cpu.optimizer == (4 + 4 + 4) * P / 8 + 4 * 50_000_000  # fp32 master, gradient and momentum, bucket


def test_bf16_on_the_cpu_accelerator_reserves_the_kernels_onednn_compiles_for_its_matmuls():
    """A bf16 run's ranks on the CPU keep oneDNN's JIT-compiled matmul kernels (measured +31-33 MB over the same fp32
    run of tiny-flux, ZeRO 2 and 3): in the step and sample phases' reserve; not in fp32's (MKL's precompiled
    sgemm), nor on a GPU, nor before the first step (load)."""
    from dstune.memory.reserve import CPU_BF16_KERNELS_BYTES

    bf16 = estimate(counts(), setup(3, accelerator="cpu", samples=True))
    fp32 = estimate(counts(), setup(3, accelerator="cpu", samples=True, precision="fp32"))
    assert bf16.reserve == fp32.reserve + CPU_BF16_KERNELS_BYTES
    for phase in ("step", "sample"):
        assert bf16.phases[phase].parts["runtime reserve"] == fp32.phases[phase].parts["runtime reserve"] + (
            CPU_BF16_KERNELS_BYTES
        )
    assert bf16.phases["load"].parts["runtime reserve"] == fp32.phases["load"].parts["runtime reserve"]
    assert estimate(counts(), setup(3)).reserve == estimate(counts(), setup(3, precision="fp32")).reserve


def test_the_small_tensor_count_is_what_zero3_sees_on_the_real_module_with_adapters():
    """count_small_tensors (from counts.json, as validate reads it) against the real tiny UNet built from the
    same config with peft's adapters on the default targets: the same tensor sizes, adapters included."""
    import torch
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig, inject_adapter_in_model

    from dstune.memory.counts import STORE, BUILTIN_FOLDERS, count_small_tensors
    from dstune.spec.model_sections import DEFAULT_LORA_TARGET_MODULES

    config = STORE / "builtin" / BUILTIN_FOLDERS["tiny-sd"] / "unet" / "config.json"
    counted = count_small_tensors(str(config), DEFAULT_LORA_TARGET_MODULES, 4)
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(config.parent)))
    unet = inject_adapter_in_model(LoraConfig(r=4, target_modules=list(DEFAULT_LORA_TARGET_MODULES)), unet)
    sizes: dict = {}
    for tensor in unet.parameters():
        if tensor.numel() <= 1 << 20:
            sizes[tensor.numel()] = sizes.get(tensor.numel(), 0) + 1
    assert dict(counted) == sizes
    assert any(numel == 4 * 32 for numel, _ in counted)  # an adapter's A or B on a 32-wide projection


ENCODE, TEXT, DECODE, FORWARD = 2_000_000_000, 500_000_000, 3_000_000_000, 1_000_000_000


def working(**extra) -> ModelCounts:
    """counts() with the encoders' working memory: one entry's VAE encode, one caption's text pass, one sample's
    decode and sampling forward (dstune.memory.working)."""
    values = dict(
        encode_entry_bytes=ENCODE,
        text_entry_bytes=TEXT,
        decode_sample_bytes=DECODE,
        sample_forward_bytes=FORWARD,
        samples_per_call=2,
    )
    return counts(**{**values, **extra})


def test_the_cache_phase_holds_one_chunks_encode_beside_the_loaded_parts():
    from dstune.memory.phases import TEXT_CHUNK, VAE_CHUNK

    loaded = estimate(working(), setup()).phases["load"].per_gpu
    for chunk in (8, 3, 1):
        cache = estimate(working(), setup(cache_chunk=chunk)).phases["cache"]
        assert cache.parts[VAE_CHUNK] == chunk * ENCODE and cache.parts[TEXT_CHUNK] == chunk * TEXT
        # the text encoders' pass follows the VAE's: the larger of the two counts, not both
        assert cache.per_gpu == loaded + chunk * max(ENCODE, TEXT)
    text_only = estimate(working(), setup()).phases["cache"]  # the text cache only: the VAE works in the step
    assert text_only.parts[VAE_CHUNK] == 8 * ENCODE
    step_encodes = estimate(working(cached=("text_encoder",)), setup(micro_batch=2)).phases["step"]
    assert step_encodes.parts["VAE encode of the micro batch (latents not cached)"] == 2 * ENCODE


def test_the_chunk_is_the_most_entries_whose_cache_phase_fits_and_one_at_least():
    from dstune.memory.verdict import choose_encoding

    model = working()
    loaded = estimate(model, setup()).phases["load"].per_gpu
    assert choose_encoding(model, setup(), None).cache_chunk == 8  # no GPU size: the most
    assert choose_encoding(model, setup(), loaded + 3.5 * ENCODE).cache_chunk == 3
    assert choose_encoding(model, setup(), loaded + 100 * ENCODE).cache_chunk == 8
    low = loaded + 0.5 * ENCODE  # not even one entry: one, and the verdict names the cache phase
    assert choose_encoding(model, setup(), low).cache_chunk == 1
    memory = memory_json(model, setup(), low)
    assert memory["fits"] is False and memory["peak_phase"] == "cache"
    assert memory["cache_encoding"] == {"entries_per_pass": 1, "chosen_for_gpu_memory": True, "vae_tiling": False}
    # a tileable VAE: never tiled by the plan (validate suggests it: test_hunyuan_video15_at_720p_...)
    tileable = working(encode_entry_tiled_bytes=ENCODE // 10)
    memory = memory_json(tileable, setup(), low)
    assert memory["cache_encoding"]["vae_tiling"] is False
    tiled = estimate(tileable, setup(vae_tiling=True, cache_chunk=4)).phases["cache"]
    assert tiled.per_gpu == loaded + 4 * max(ENCODE // 10, TEXT)


def test_without_a_gpu_size_each_common_card_is_planned_with_the_cache_pass_it_would_choose(capsys):
    """Kandinsky 6 Pro's launch spec: encoding the most entries a cache pass (8 clips of 121 frames at 512 px) needs
    far more than any card, but on 80 GB the cache encodes fewer a pass, as a run there (or --gpu-memory 80GB)
    plans it, and fits: the common cards' line says so, not 'fits none'."""
    from dstune.cli import main

    spec = str(REPO / "launch" / "kandinsky6-pro-lora-zero3-8gpu.yaml")
    assert main(["validate", spec, "--num-gpus", "8", "--num-samples", "2000", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    cards = {row["gpu"]: row for row in memory["common_gpus"]}
    assert memory["peak_per_gpu_bytes"] > 192e9 and memory["cache_encoding"]["entries_per_pass"] == 8
    assert cards["80GB"]["fits"] and cards["80GB"]["entries_per_pass"] < 8 and not cards["48GB"]["fits"]
    assert main(["validate", spec, "--num-gpus", "8", "--num-samples", "2000", "--json", "--gpu-memory", "80GB"]) == 0
    on_80 = json.loads(capsys.readouterr().out)["memory"]
    assert on_80["fits"] and on_80["peak_per_gpu_bytes"] == cards["80GB"]["peak_per_gpu_bytes"]
    assert main(["validate", spec, "--num-gpus", "8", "--num-samples", "2000"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "common GPUs" in line)
    assert "fits 80 GB (A100 80GB, H100) and larger; not 48 GB" in line and "1 entry a cache pass" in line


def test_the_step_holds_the_backward_transients_and_under_zero_0_to_2_a_gradient_in_flight():
    from dstune.memory.phases import IN_FLIGHT, TRANSIENTS

    transients = 700_000_000
    for stage in (0, 1, 2, 3):
        plain = estimate(counts(), setup(stage))
        with_transients = estimate(counts(transient_sample_bytes=transients), setup(stage, micro_batch=2))
        flight = 2 * 2 * 50_000_000 if stage < 3 else 0  # 2 x the largest layer's 16-bit gradient
        assert with_transients.phases["step"].parts[TRANSIENTS] == 2 * transients
        assert plain.phases["step"].parts.get(IN_FLIGHT, 0) == flight
        assert with_transients.total == pytest.approx(
            estimate(counts(), setup(stage, micro_batch=2)).total + 2 * transients
        )
    per_gpu = memory_json(counts(transient_sample_bytes=transients), setup(), None)["per_gpu"]
    assert per_gpu["backward_transients_bytes"] == transients and per_gpu["gradients_in_flight_bytes"] == 2e8


def test_the_sample_phase_holds_the_decode_or_one_sampling_forward():
    from dstune.memory.phases import DECODE as DECODE_LABEL, SAMPLING_FORWARD

    plain = estimate(counts(), setup(samples=True)).phases["sample"].per_gpu
    sample = estimate(working(), setup(samples=True)).phases["sample"]
    # both prompts decoded at once, or one forward of both: the larger, not both
    assert sample.parts[DECODE_LABEL] == 2 * DECODE and sample.parts[SAMPLING_FORWARD] == 2 * FORWARD
    assert sample.per_gpu == plain + max(2 * DECODE, 2 * FORWARD)
    assert "sample" not in estimate(working(), setup()).phases


LAUNCH_VERDICTS = {  # spec, GPU memory, fits, the peak phase, the chunk the plan chooses
    "hunyuan-video15-720p-lora-zero3-8gpu": ("80GB", True, "cache", 4),
    "krea2-lora-8x24gb": ("24GB", True, "cache", 4),
    "qwen-image-lora-zero3-8gpu": ("24GB", False, "cache", 1),
    "flux-lora-zero3-8gpu": ("24GB", True, "cache", 7),
}


@pytest.mark.parametrize("name", LAUNCH_VERDICTS)
def test_the_launch_specs_verdicts_count_the_encode_of_the_chunk_they_use(name, capsys):
    """The four example specs whose "fits" left the encoders' working memory out (docs/memory.md recomputes them):
    each fits with a cache phase that holds the encode of the chunk it will use, or does not fit and names the
    cache phase."""
    import shlex

    from dstune.cli import main
    from dstune.memory.phases import VAE_CHUNK

    size, fits, peak, chunk = LAUNCH_VERDICTS[name]
    spec = REPO / "launch" / f"{name}.yaml"
    _, *flags = shlex.split(spec.read_text().splitlines()[0].split("dstune validate ", 1)[1])
    assert main(["validate", str(spec), *flags, "--json", "--gpu-memory", size]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["fits"] is fits and memory["peak_phase"] == peak, (memory["fits"], memory["peak_phase"])
    assert memory["cache_encoding"]["entries_per_pass"] == chunk and memory["cache_encoding"]["chosen_for_gpu_memory"]
    cache = memory["phases"]["cache"]
    load = memory["phases"]["load"]["per_gpu_bytes"]
    assert cache["parts"][VAE_CHUNK] > 0 and cache["per_gpu_bytes"] >= load + cache["parts"][VAE_CHUNK]
    if fits:
        assert cache["per_gpu_bytes"] <= memory["gpu_memory_bytes"]
    else:  # one entry already does not fit beside the text encoder loaded for the cache
        assert load < memory["gpu_memory_bytes"] < cache["per_gpu_bytes"]


def test_hunyuan_video15_at_720p_fits_only_through_the_vaes_tiles(capsys):
    """Without model.vae_tiling one 720p clip's encode (and a sample's decode) does not fit any GPU: validate says
    the cache phase does not fit and suggests the tiles."""
    from dstune.cli import main

    spec = str(REPO / "launch" / "hunyuan-video15-720p-lora-zero3-8gpu.yaml")
    flags = ["--num-gpus", "8", "--num-samples", "2000", "--json", "--gpu-memory", "80GB"]
    assert main(["validate", spec, *flags, "--set", "model.vae_tiling=false"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["fits"] is False and memory["peak_phase"] == "cache" and memory["peak_per_gpu_bytes"] > 130e9
    assert memory["phases"]["sample"]["per_gpu_bytes"] > 80e9  # a 121-frame sample's decode, whole
    assert any(s["change"].startswith("model.vae_tiling=true") for s in memory["suggestions"])
