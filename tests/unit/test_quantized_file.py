"""model.transformer_file: a LoRA trained on a frozen transformer read from a quantized single file as people
download them (ComfyUI's scaled fp8, ComfyUI's int8_tensorwise layers), written here from builtin:tiny-flux's real
weights. Its loss against the bf16 base's on the same draws, its weights kept stored through the casts, the memory
plan's stored and dequantized bytes, and validate's errors for wrong files with their key and line. The 2-rank run:
tests/dist/test_levers.py ("fp8-file")."""

from __future__ import annotations

import copy

import pytest
import torch

from dstune import builtin as tiny
from dstune.families.quantized_file import read_quantized_file
from dstune.pretrained import build_model
from dstune.spec.load import SpecError
from dstune.spec.models import FlowModelSpec
from loaded_models import CACHE_DIR
from quantized_files import linear_weights, write_comfy_int8, write_scaled_fp8
from tiny_batches import shape_batch

LORA = {"train": "lora", "lora": {"rank": 4, "alpha": 4}}
# the LoRA loss on the quantized base against the bf16 base's, relative: fp8 e4m3 keeps 3 mantissa bits (one scale
# a tensor), int8 one scale a row; measured 0.19 % and 0.015 % on tiny-flux
TOLERANCE = {"fp8": 0.01, "int8": 0.001}


@pytest.fixture(scope="module")
def folder():
    return tiny.ensure_builtin_model("tiny-flux", CACHE_DIR)


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory):
    """The bf16 base (tiny-flux's transformer rounded to bf16, computing in fp32) and the two quantized files
    written from it: fp8 under ComfyUI's `model.diffusion_model.` prefix, int8 without one."""
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("quantized")
    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer").to(torch.bfloat16).float()
    write_scaled_fp8(transformer, root / "fp8.safetensors", prefix="model.diffusion_model.")
    write_comfy_int8(transformer, root / "int8.safetensors")
    return transformer, {"fp8": root / "fp8.safetensors", "int8": root / "int8.safetensors"}


def _lora_loss(model, batch):
    from dstune.families.lora import apply_train_mode

    summary = apply_train_mode(model, model.model_spec, seed=0)
    return model.loss(model.trainable, model.encode_batch(batch), 0, 3), summary


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_a_lora_on_the_quantized_file_trains_near_the_bf16_base(folder, files, kind):
    """Same draws, same adapters: the LoRA loss within TOLERANCE of the bf16 base's; only the fp32 adapters get
    gradients; the linear weights stay 1 byte each and the scales exact through the cast to bf16 (the start-up's,
    as DeepSpeed's) and DeepSpeed's byte-view broadcast."""
    from dstune.engine import place_trainable
    from dstune.families.quantized_base import ScaledLinear

    bf16_base, paths = files
    batch = shape_batch([0, 1])
    reference = build_model(FlowModelSpec(family="flow", pretrained=str(folder), **LORA), CACHE_DIR, "cpu")
    reference.trainable.load_state_dict(bf16_base.state_dict())
    expected, _ = _lora_loss(reference, batch)
    spec = FlowModelSpec(family="flow", pretrained=str(folder), transformer_file=str(paths[kind]), **LORA)
    model = build_model(spec, CACHE_DIR, "cpu")
    loss, summary = _lora_loss(model, batch)
    print(kind, "loss", loss.item(), "bf16 base", expected.item(), "relative", abs(loss / expected - 1).item())
    assert abs(loss / expected - 1).item() < TOLERANCE[kind]
    layers = [m for m in model.trainable.modules() if isinstance(m, ScaledLinear)]
    assert len(layers) == len(linear_weights(bf16_base)) and f"{len(layers)} linear layers" in summary
    loss.backward()
    trained = {n: p for n, p in model.trainable.named_parameters() if p.requires_grad}
    assert trained and all(
        ".lora_" in n and p.dtype == torch.float32 and p.grad is not None for n, p in trained.items()
    )
    scales = [layer.scale_bits.clone() for layer in layers]
    place_trainable(model.trainable, "cpu", "bf16")
    assert all(layer.weight.dtype == torch.int8 for layer in layers)
    assert all(torch.equal(layer.scale_bits, scale) for layer, scale in zip(layers, scales))
    for param in model.trainable.parameters():
        param.data.view(torch.uint8)  # what deepspeed.initialize's _broadcast_model does to every parameter


def _plan(tmp_path, folder, transformer_file, precision="bf16"):
    from dstune.families import get_facts
    from dstune.families.quantized_file import quantized_file_setup
    from dstune.memory.plan import Setup
    from dstune.validate import plan_memory

    resolved = _validate(tmp_path, folder, transformer_file, precision=precision)
    counts = get_facts("flow").count(resolved.spec, resolved.plan.num_samples, None)
    setup = Setup.of(resolved.spec, resolved.plan, resolved.ds_config, None, "cpu")
    memory = plan_memory(resolved.spec, resolved.plan, resolved.ds_config, accelerator="cpu")
    return counts, setup, quantized_file_setup(transformer_file, setup), memory


def test_the_memory_plan_counts_the_files_stored_bytes_and_one_dequantized_layer(tmp_path, folder, files):
    """Under bf16 (the file's plain tensors are bf16 too) the plan's frozen base is the file's tensor bytes, the
    marker left out; its buffers hold the largest layer dequantized in bf16 beside them."""
    from safetensors import safe_open

    from dstune.memory.plan import estimate, frozen_base_bytes

    bf16_base, paths = files
    with safe_open(str(paths["fp8"]), framework="pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    stored = sum(t.numel() * t.element_size() for key, t in tensors.items() if not key.endswith("scaled_fp8"))
    counts, plain, quantized, memory = _plan(tmp_path, folder, str(paths["fp8"]))
    assert frozen_base_bytes(counts, quantized) == pytest.approx(stored, rel=1e-12)
    assert memory["transformer_file"]["stored_bytes"] == stored  # what validate --json says
    assert frozen_base_bytes(counts, plain) == 2 * sum(p.numel() for p in bf16_base.parameters())
    largest = max(bf16_base.get_parameter(name).numel() for name in linear_weights(bf16_base))
    assert read_quantized_file(paths["fp8"]).largest_layer_params == largest
    assert estimate(counts, quantized).buffers - estimate(counts, plain).buffers == 2 * largest
    assert memory["transformer_file"]["dequantized_layer_bytes"] == 2 * largest
    # under ZeRO-3 on 2 ranks each GPU keeps half the file's bytes, loaded and training (test_levers measures it)
    from dataclasses import replace

    from dstune.memory.plan import frozen_on_gpu, module_on_load

    zero3 = replace(quantized, zero_stage=3, world_size=2, accelerator="cuda")
    assert frozen_on_gpu(replace(counts, companions={}), zero3) == pytest.approx(stored / 2, rel=1e-12)
    trainable = 2 * counts.trainable_params
    assert module_on_load(counts, zero3) == pytest.approx((stored + trainable) / 2 + 2 * counts.largest_layer_params)


def _validate(tmp_path, folder, transformer_file, zero_stage=2, precision="fp32", train="lora", offload="none"):
    from dstune.validate import load_and_validate
    from dstune.world import world_from_flags

    spec = tmp_path / "spec.yaml"
    lines = ["model:", "  family: flow", f"  pretrained: {folder}", f"  train: {train}"]
    lines += [f"  transformer_file: {transformer_file}", "data:", "  path: builtin:shapes", "train:"]
    lines += [f"  precision: {precision}", "  micro_batch_size: 1", "  max_steps: 2", "deepspeed:"]
    lines += [f"  zero_stage: {zero_stage}"]
    if offload != "none":
        lines += [f"  offload_param: {{device: {offload}, nvme_path: {tmp_path}}}"]
    spec.write_text("\n".join(lines) + "\n")
    return load_and_validate(spec, world=world_from_flags(world_size=2))


def _issue(tmp_path, folder, transformer_file, **settings):
    with pytest.raises(SpecError) as caught:
        _validate(tmp_path, folder, transformer_file, **settings)
    (issue,) = [issue for issue in caught.value.issues if issue.key == "model.transformer_file"]
    return issue


def test_validate_names_what_is_wrong_with_a_file_and_where(tmp_path, folder, files):
    """Each wrong file, refused offline at the key's line with the tensor it is about: no scale beside a float8
    weight, a plain (unquantized) file, another model's transformer, and the settings it cannot go with."""
    from safetensors.torch import save_file

    bf16_base, paths = files
    written = write_scaled_fp8(bf16_base, tmp_path / "whole.safetensors")
    scale = next(key for key in written if key.endswith(".scale_weight"))
    save_file({k: v for k, v in written.items() if k != scale}, str(tmp_path / "unscaled.safetensors"))
    issue = _issue(tmp_path, folder, tmp_path / "unscaled.safetensors")
    assert issue.where.endswith("spec.yaml:5") and scale in issue.message and "no " in issue.message

    save_file({k: v.to(torch.bfloat16) for k, v in bf16_base.state_dict().items()}, str(tmp_path / "plain.safetensors"))
    assert "holds no quantized weights" in _issue(tmp_path, folder, tmp_path / "plain.safetensors").message

    other = copy.deepcopy(bf16_base)
    other.transformer_blocks[0].attn.to_q = torch.nn.Linear(other.transformer_blocks[0].attn.to_q.in_features, 8)
    write_scaled_fp8(other, tmp_path / "other.safetensors")
    message = _issue(tmp_path, folder, tmp_path / "other.safetensors").message
    assert "transformer_blocks.0.attn.to_q.weight [8, " in message and "shapes differ" in message

    assert _validate(tmp_path, folder, paths["fp8"], zero_stage=3)  # partitioned as stored (test_levers runs it)
    assert "NVMe" in _issue(tmp_path, folder, paths["fp8"], zero_stage=3, offload="nvme").message
    assert "set train: lora" in _issue(tmp_path, folder, paths["fp8"], train="full").message


def test_the_start_up_refuses_a_file_of_another_transformer_naming_its_keys(folder, tmp_path):
    """Where validate cannot compare (a built-in's folder is built at start-up), the load does, before any weight
    is read: tiny-flow's (SD3) transformer file against tiny-flux's config."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from dstune.families.base import FamilyError
    from dstune.families.quantized_base import load_quantized_transformer

    sd3 = SD3Transformer2DModel.from_pretrained(tiny.ensure_builtin_model("tiny-flow", CACHE_DIR) / "transformer")
    write_scaled_fp8(sd3, tmp_path / "sd3.safetensors")
    config = FluxTransformer2DModel.load_config(folder / "transformer")
    with pytest.raises(
        FamilyError,
        match=r"(?s)parameters of FluxTransformer2DModel are not in the file: single_.*no parameter.*pos_embed",
    ):
        load_quantized_transformer(FluxTransformer2DModel, config, tmp_path / "sd3.safetensors")
