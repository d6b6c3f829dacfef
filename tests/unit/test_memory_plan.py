"""The memory plan: model states agree with DeepSpeed's own estimators, `dstune validate` shows
the Memory section and its JSON names, and the parameter counts on the meta device match the published sizes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dstune.cli import main
from dstune.memory.plan import BASE_PRECISION_BYTES, ModelCounts, Setup, estimate, model_states, parse_size
from dstune.memory.verdict import memory_json

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "launch" / "sd-tiny-demo.yaml")


def setup_for(stage: int, world: int, per_node: int, offload_optimizer="none", offload_param="none", **extra) -> Setup:
    values = dict(
        world_size=world,
        ranks_per_node=per_node,
        zero_stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        precision="bf16",
        optimizer="adamw",
        momentum=0.0,
        micro_batch=2,
        accumulation=1,
        gradient_checkpointing=False,
        lora=False,
        reduce_bucket=50_000_000,
        allgather_bucket=50_000_000,
        prefetch_bucket=45_000_000,
        overlap_comm=False,
    )
    return Setup(**{**values, **extra})


def counts_for(params: int, largest: int, **extra) -> ModelCounts:
    return ModelCounts("unet", params, params, largest, **extra)


# DeepSpeed's estimators assume mixed-precision Adam on every parameter; these are the cases they cover.
SIZES = [(859_520_964, 29_492_480), (2_567_463_684, 29_492_480), (11_901_408_320, 56_641_536)]
WORLDS = [(8, 8, 1), (16, 8, 2), (2, 2, 1)]  # (ranks, per node, nodes)


@pytest.mark.parametrize("params, largest", SIZES)
@pytest.mark.parametrize("world, per_node, nodes", WORLDS)
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_model_states_agree_with_deepspeed(params, largest, world, per_node, nodes, offload):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu = estimate_zero2_model_states_mem_needs(params, per_node, nodes, cpu_offload=offload)
    setup = setup_for(2, world, per_node, "cpu" if offload else "none")
    assert sum(model_states(counts_for(params, largest), setup)) == pytest.approx(gpu, abs=2)


@pytest.mark.parametrize("params, largest", SIZES)
@pytest.mark.parametrize("world, per_node, nodes", WORLDS)
@pytest.mark.parametrize("offload_optimizer, offload_param", [("none", "none"), ("cpu", "none"), ("cpu", "cpu")])
def test_zero3_model_states_agree_with_deepspeed(
    params, largest, world, per_node, nodes, offload_optimizer, offload_param
):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    _, gpu, _ = estimate_zero3_model_states_mem_needs(
        params,
        largest,
        per_node,
        nodes,
        cpu_offload=offload_optimizer != "none",
        cpu_offload_params=offload_param != "none",
    )
    setup = setup_for(3, world, per_node, offload_optimizer, offload_param)
    assert sum(model_states(counts_for(params, largest), setup)) == pytest.approx(gpu, abs=2)


def test_where_dstune_goes_beyond_deepspeeds_estimators():
    """Stages 0 and 1 (DeepSpeed has no estimator) follow the ZeRO paper; fp32 has no master copy; SGD without
    momentum has no state; a LoRA module's frozen base is counted apart from the trainable adapters."""
    params, counts = 1_000_000, counts_for(1_000_000, 10_000)
    # ZeRO-0 under bf16: DeepSpeed's (non-ZeRO) mixed-precision optimizer also makes an fp32 gradient copy
    assert sum(model_states(counts, setup_for(0, 4, 4))) == 16 * params + 4 * params
    assert sum(model_states(counts, setup_for(1, 4, 4))) == 2 * params + 2 * params + 4 * params / 4 + 12 * params / 4
    assert sum(model_states(counts, setup_for(0, 4, 4, precision="fp32"))) == 16 * params  # 4 + 4 + 8
    assert model_states(counts, setup_for(0, 4, 4, optimizer="sgd"))[2] == 4 * params  # master weights only
    lora = ModelCounts("unet", params, 10_000, 10_000)
    full_bf16 = estimate(lora, setup_for(2, 4, 4, lora=True))
    # the adapters are added beside the whole frozen base (module_params counts the module without them)
    assert full_bf16.parameters == 2 * 10_000 and full_bf16.frozen == 2 * params
    int8 = estimate(lora, setup_for(2, 4, 4, lora=True, base_bytes_per_param=BASE_PRECISION_BYTES["int8"]))
    assert int8.frozen == params and int8.total < full_bf16.total


def test_memory_json_names():
    result = memory_json(counts_for(1000, 100), setup_for(2, 2, 2), None)
    assert set(result["per_gpu"]) >= {
        "total_bytes",
        "parameters_bytes",
        "gradients_bytes",
        "optimizer_bytes",
        "frozen_bytes",
        "activations_bytes",
        "buffers_bytes",
    }
    assert {"host_per_node_bytes", "gpu_memory_bytes", "fits", "suggestions"} <= set(result)
    assert result["fits"] is None and result["gpu_memory_bytes"] is None


@pytest.mark.parametrize(
    "text, expected", [("24GB", 24e9), ("80G", 80e9), ("40GiB", 40 * 2**30), ("512MB", 512e6), ("24", 24e9)]
)
def test_parse_size(text, expected):
    assert parse_size(text) == int(expected)


@pytest.mark.parametrize("text", ["lots", "24XB", "-1GB", "0GB"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="24GB"):
        parse_size(text)


def test_validate_json_memory_and_require_fit(capsys):
    code = main(["validate", DEMO, "--num-gpus", "2", "--json", "--gpu-memory", "80GB"])
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert code == 0 and memory["fits"] is True and memory["gpu_memory_bytes"] == 80 * 10**9
    gpu = memory["per_gpu"]
    # the activations, the backward's transients and the gradients in flight, or the encoders' passes over the
    # micro batch before them (the demo caches nothing): one after the other, the larger counts
    backward = ("activations_bytes", "backward_transients_bytes", "gradients_in_flight_bytes")
    held = sum(value for key, value in gpu.items() if key not in ("total_bytes", "encoders_working_bytes", *backward))
    assert gpu["encoders_working_bytes"] > 0
    assert gpu["total_bytes"] == held + max(sum(gpu[key] for key in backward), gpu["encoders_working_bytes"])
    assert memory["parameters"]["module_params"] == 792_964  # builtin:tiny-sd's UNet, counted on meta
    assert main(["validate", DEMO, "--num-gpus", "2", "--gpu-memory", "1MB"]) == 0  # a plan, not an error
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    assert main(["validate", DEMO, "--num-gpus", "2", "--gpu-memory", "1MB", "--require-fit"]) == 1
    capsys.readouterr()
    assert main(["validate", DEMO, "--num-gpus", "2", "--require-fit"]) == 2  # needs --gpu-memory
    assert main(["validate", DEMO, "--num-gpus", "2", "--gpu-memory", "lots"]) == 2


PUBLISHED = [  # (stored config, parameters as published by the model's authors / its Hugging Face page)
    ("stable-diffusion-v1-5/stable-diffusion-v1-5/unet", 859_520_964),
    ("stable-diffusion-v1-5/stable-diffusion-v1-5/text_encoder", 123_060_480),
    ("stabilityai/stable-diffusion-xl-base-1.0/unet", 2_567_463_684),
    ("black-forest-labs/FLUX.1-dev/transformer", 11_901_408_320),
    ("black-forest-labs/FLUX.1-dev/text_encoder_2", 4_762_310_656),
    ("meta-llama/Llama-3.2-1B", 1_235_814_400),
]


@pytest.mark.parametrize("where, published", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_meta_device_counts_match_published_sizes(where, published):
    from dstune.memory.counts import STORE, count_component, meta_count

    path = str(STORE / "hub" / where / "config.json")
    assert meta_count(path)[0] == published == count_component(path)[0]


def test_stored_counts_are_the_meta_device_counts():
    """validate reads the stored configs' counts from counts.json (no diffusers import); they must be what the
    meta device gives for the same files."""
    from dstune.memory.counts import STORED_COUNTS, stored_counts

    assert json.loads(STORED_COUNTS.read_text()) == stored_counts(), (
        "regenerate: python3 -c 'from dstune.memory.counts import write_stored_counts; write_stored_counts()'"
    )


def test_lora_adapters_are_counted_on_the_meta_module():
    """Flux LoRA of launch/flux-lora-zero3-8gpu.yaml: rank 32 on the attention projections, 37.4 M adapters; another
    target list is counted on the meta device."""
    from dstune.memory.counts import STORE, count_component, meta_count

    path = str(STORE / "hub" / "black-forest-labs/FLUX.1-dev/transformer/config.json")
    default = ("to_q", "to_k", "to_v", "to_out.0")
    assert count_component(path, default, 32)[2] == meta_count(path, default, 32)[2] == 37_355_520
    assert 0 < meta_count(path, ("to_q",), 4)[2] < meta_count(path, default, 4)[2]


VERSION_STAMPS = ("transformers_version", "_diffusers_version")  # which library version wrote the file, not the model


def _config_values(path: Path) -> dict:
    """A config's values, less the version stamps and, in a modular index, where each component loads from (the
    built folder's own absolute path; the stored copy has none)."""
    values = {k: v for k, v in json.loads(path.read_text()).items() if k not in VERSION_STAMPS}
    for name, entry in values.items():
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict):
            values[name] = [*entry[:2], {**entry[2], "pretrained_model_name_or_path": None}]
    return values


def test_stored_builtin_configs_are_the_builders_configs():
    """dstune/model_configs/builtin holds copies of what each builtin writes: the same folder names as
    dstune.builtin, and (where the tests' built models are at hand) the same config files, apart from the version
    of transformers/diffusers that wrote them (a newer release on a fresh install changes only that stamp)."""
    from dstune.builtin import BUILTIN_MODELS
    from dstune.memory.counts import BUILTIN_FOLDERS, STORE

    assert BUILTIN_FOLDERS == {name: model.folder_name for name, model in BUILTIN_MODELS.items()}
    built = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests")) / "builtin"
    for folder in BUILTIN_FOLDERS.values():
        stored = sorted(p.relative_to(STORE / "builtin" / folder) for p in (STORE / "builtin" / folder).rglob("*.json"))
        assert stored, folder
        if (built / folder).is_dir():
            for relative in stored:
                assert _config_values(built / folder / relative) == _config_values(
                    STORE / "builtin" / folder / relative
                ), f"{folder}/{relative}"


def test_offload_moves_states_to_the_host_and_lora_counts_the_frozen_base(capsys):
    """The Setup is read from the compiled DeepSpeed JSON: ZeRO-3 with optimizer and parameter offload keeps only
    the largest layer on the GPU and the rest in host memory; Flux LoRA under ZeRO-3 partitions its frozen base."""
    spec = str(REPO / "launch" / "sd15-zero3-offload.yaml")
    assert main(["validate", spec, "--num-gpus", "8", "--num-samples", "20000", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    gpu, counts = memory["per_gpu"], memory["parameters"]
    assert gpu["optimizer_bytes"] == 0 and gpu["parameters_bytes"] == 2 * counts["largest_layer_params"]
    params = counts["module_params"]
    assert memory["host_per_node_bytes"] >= 8 * (16 * params / 8 + 2 * params / 8)  # fp32 grads + states, params
    spec = str(REPO / "launch" / "flux-lora-zero3-8gpu.yaml")
    assert main(["validate", spec, "--num-gpus", "8", "--num-samples", "20000", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    frozen_base = memory["parameters"]["frozen_base_params"]
    assert frozen_base > 11e9 and memory["per_gpu"]["frozen_bytes"] == pytest.approx(2 * frozen_base / 8, rel=1e-6)


def test_tts_lm_lora_counts_adapters_on_the_llama_attention(capsys):
    """tts_lm with train: lora trains peft adapters on q/k/v/o_proj: the plan's trainable count is those adapters
    (counted on the meta Llama), the rest is a frozen base; full training suggests that LoRA."""
    from dstune.memory.counts import STORE, meta_count

    spec = str(REPO / "launch" / "tts-lm-1b-zero3-8gpu.yaml")
    assert (
        main(
            [
                "validate",
                spec,
                "--num-gpus",
                "8",
                "--num-samples",
                "13100",
                "--json",
                "--set",
                "model.train=lora",
                "--set",
                "model.lora.rank=8",
            ]
        )
        == 0
    )
    counts = json.loads(capsys.readouterr().out)["memory"]["parameters"]
    config = str(STORE / "hub" / "meta-llama/Llama-3.2-1B" / "config.json")
    adapters = meta_count(config, ("q_proj", "k_proj", "v_proj", "o_proj"), 8)[2]
    assert counts["trainable_params"] == adapters and 1e6 < adapters < 1e-2 * counts["module_params"]
    assert counts["frozen_base_params"] == counts["module_params"]  # the adapters come on top of the base
    assert main(["validate", spec, "--num-gpus", "8", "--num-samples", "13100", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["memory"]
    assert full["parameters"]["trainable_params"] == full["parameters"]["module_params"]


def test_zero3_partitioned_build_reads_a_share_per_rank(capsys):
    """launch/qwen-image-lora-zero3-8gpu.yaml: Qwen-Image's stored configs count as published (a 20 B transformer,
    Qwen2.5-VL-7B's 8.29 B text encoder). Under ZeRO-3 the transformer is built partitioned, so a rank reads an
    eighth of it in fp32 (plus the largest tensor) and the frozen parts in bf16, not the whole model in fp32; the
    text encoder, which the text cache replaces, is read by one rank of the node (dstune.text_once)."""
    spec = str(REPO / "launch" / "qwen-image-lora-zero3-8gpu.yaml")
    assert main(["validate", spec, "--num-gpus", "8", "--num-samples", "20000", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    counts = memory["parameters"]
    assert 20.0e9 < counts["module_params"] < 20.6e9 and 8.25e9 < counts["companions"]["text_encoder"] < 8.35e9
    assert counts["once_per_node_companions"] == ["text_encoder"]
    frozen = sum(counts["companions"].values())
    text = counts["companions"]["text_encoder"]
    share = 4 * (counts["module_params"] / 8 + counts["largest_layer_params"]) + 2 * (frozen - text)
    assert memory["host_per_node_bytes"] == pytest.approx(8 * share + 2 * text, rel=1e-6)
    whole = 8 * 4 * (counts["module_params"] + frozen)
    assert memory["host_per_node_bytes"] < whole / 3


@pytest.mark.parametrize(
    "model", ["tiny-qwen-image", "tiny-z-image", "tiny-flux2", "tiny-flux2-dev", "tiny-flux", "tiny-flow"]
)
def test_cache_on_disk_is_what_the_cache_stores_per_sample(model):
    """validate's "cache on disk" for one 32 px sample under fp32 equals the bytes of the tensors the cache writes:
    the posterior's mean and std and the model's text tensors (a mask excepted: it is small). The tiny T5
    tokenizers stop at 32 tokens, which the stored configs do not say, so the length is set within it."""
    from dstune.families.diffusion import vae_posterior
    from dstune.families import get_facts
    from dstune.pretrained import build_model
    from dstune.spec.models import Spec

    model_section = {"family": "flow", "pretrained": f"builtin:{model}", "max_sequence_length": 32}
    spec = Spec.model_validate(
        {
            "model": model_section,
            "data": {"path": "builtin:shapes", "resolution": 32, "cache": {"latents": True, "text_embeddings": True}},
            "train": {
                "global_batch_size": 1,
                "max_steps": 1,
                "precision": "fp32",
                "optimizer": {"type": "adamw", "lr": 1e-4},
            },
        }
    )
    cache_dir = Path(os.environ.get("DSTUNE_TEST_CACHE", REPO / ".dstune-cache" / "tests"))
    built = build_model(spec.model, cache_dir, "cpu")
    mean, std = vae_posterior(built.vae, torch.zeros(1, 3, 32, 32))
    text = built.encode_text(["a red circle"])
    stored = 4 * (mean.numel() + std.numel()) + sum(
        t.numel() * t.element_size() for name, t in text.items() if t.is_floating_point()
    )
    assert get_facts("flow").count(spec, 1).cache_bytes == stored


A14B = str(REPO / "launch" / "wan22-a14b-low-noise-full-zero3-2x8gpu.yaml")
A14B_FLAGS = ["--hostfile", str(REPO / "launch" / "hostfile.example"), "--num-samples", "4000"]


def test_two_expert_wan_counts_the_trained_expert_and_the_other_only_while_sampling(capsys):
    """Wan 2.2 A14B low-noise expert (launch/wan22-a14b-...): the module is transformer_2 and validate says which
    timesteps it trains; the high-noise expert is not on the GPU during steps but joins every GPU (and host) while
    samples render, which sets the peak; without sample.prompts it never loads, and when only the samples do not fit
    dropping them is suggested."""
    assert main(["validate", A14B, *A14B_FLAGS, "--json"]) == 0
    from dstune.memory.counts import STORE, count_component

    memory = json.loads(capsys.readouterr().out)["memory"]
    params = memory["parameters"]
    expert_params = count_component(str(STORE / "hub/Wan-AI/Wan2.1-T2V-14B-Diffusers/transformer/config.json"))[0]
    assert params["module"] == "transformer_2" and params["module_params"] == expert_params  # same architecture
    assert params["sampling_companions"] == {"transformer": expert_params} and expert_params > 14e9
    expert = params["expert"]
    assert expert["name"] == "low_noise" and expert["timesteps"] == [0.0, 875.0] and not expert["max_included"]
    other_on_gpu = 2 * expert_params  # bf16
    sample = memory["phases"]["sample"]
    assert memory["peak_phase"] == "sample" and memory["peak_per_gpu_bytes"] == sample["per_gpu_bytes"]
    assert sample["parts"]["sampling-only parts"] == other_on_gpu
    assert main(["validate", A14B, *A14B_FLAGS, "--json", "--set", "sample.prompts=[]"]) == 0
    quiet = json.loads(capsys.readouterr().out)["memory"]
    assert "sample" not in quiet["phases"] and quiet["per_gpu"]["total_bytes"] == memory["per_gpu"]["total_bytes"]
    assert quiet["peak_per_gpu_bytes"] == max(p["per_gpu_bytes"] for p in quiet["phases"].values())
    assert quiet["peak_per_gpu_bytes"] < memory["peak_per_gpu_bytes"]
    # host: each of a node's 8 ranks reads the other expert while sampling (beside its cached UMT5 copy)
    assert (
        memory["host_per_node_bytes"] > quiet["host_per_node_bytes"]
        and memory["host_per_node_bytes"] >= 8 * other_on_gpu
    )
    between = (quiet["peak_per_gpu_bytes"] + memory["peak_per_gpu_bytes"]) // 2 // 10**6
    assert main(["validate", A14B, *A14B_FLAGS, "--json", "--gpu-memory", f"{between}MB"]) == 0
    tight = json.loads(capsys.readouterr().out)["memory"]
    assert tight["fits"] is False and tight["suggestions"][0]["change"].startswith("sample.prompts=[]")
    assert main(["validate", A14B, *A14B_FLAGS]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "low_noise (transformer_2) trains timesteps 0 to < 875 of 1000" in out
    assert "transformer (14.3 B) joins on every GPU while samples render" in out
    assert main(["validate", A14B, *A14B_FLAGS, "--set", "model.timestep_range=[600,900]"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "model.timestep_range" in out and "above the boundary 875" in out and "lower max to 875" in out
