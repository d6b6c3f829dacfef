"""model.base_precision: int8 under ZeRO-3: dstune's Int8Linear (int8 codes and per-row scales as plain frozen
parameters). Its dequantization bound, its scales exact in the training dtype, peft's LoRA layers on top of it. The
2-rank ZeRO-3 LoRA run on it (loss against the bf16 base, partition bytes against the plan) is in
tests/dist/test_levers.py."""

from __future__ import annotations

import pytest
import torch

from dstune.families.int8_partitioned import Int8Linear, quantize_linear_weights_int8, representable_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scales_are_exact_in_the_training_dtype_and_every_weight_within_half_a_step(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40)
    with torch.no_grad():
        linear.weight[3] *= 1e-3  # rows of very different sizes: each has its own scale
        linear.weight[5] = 0.0  # an all-zero row: a positive scale, codes 0
    layer = Int8Linear.from_linear(linear, dtype)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == dtype
    assert not layer.weight.requires_grad and not layer.weight_scale.requires_grad
    scale = layer.weight_scale.float()
    absmax = linear.weight.detach().abs().amax(dim=1)
    assert torch.equal(scale.to(dtype).float(), scale)  # exactly what the engine keeps
    assert (scale >= absmax / 127).all() and (scale > 0).all()  # rounded up: no code past 127
    assert layer.weight.abs().max().item() <= 127
    error = (layer.dequantized_weight(torch.float32) - linear.weight.detach()).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()  # round to nearest: half a step at most
    if dtype == torch.bfloat16:  # rounded up to bf16: at most one bf16 step (2^-7 relative) above absmax / 127
        assert (scale <= absmax.clamp(min=1e-30) / 127 * (1 + 2**-7) + torch.finfo(dtype).tiny).all()
    assert torch.equal(layer.bias, linear.bias)


def test_representable_scale_rounds_up_not_to_nearest():
    wanted = torch.tensor([1.0 + 2**-8 + 2**-12]) * 127  # between two bf16 values, nearer the lower one
    scale = representable_scale(wanted, torch.bfloat16)
    assert scale.item() == 1.0 + 2**-7


def test_peft_adds_lora_on_the_int8_layer_and_only_the_adapters_train():
    """An nn.Linear subclass: peft dispatches it as a Linear and keeps its forward (the dequantized weight); the
    adapters stay fp32 beside the int8 codes, and only they get gradients."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import Linear as LoraLinear

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    model = torch.nn.Sequential(*[torch.nn.Linear(m.in_features, m.out_features) for m in (reference[0], reference[2])])
    model.insert(1, torch.nn.GELU())
    model.load_state_dict(reference.state_dict())
    assert quantize_linear_weights_int8(model, torch.bfloat16) == 2
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["0", "2"], init_lora_weights=False), model)
    assert isinstance(model[0], LoraLinear) and isinstance(model[0].base_layer, Int8Linear)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(trainable) == [f"{i}.lora_{ab}.default.weight" for i in (0, 2) for ab in "AB"]
    assert all(p.dtype == torch.float32 for p in trainable.values())
    x = torch.randn(4, 16)
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.lora_B.default.weight.zero_()  # adapters at zero: the quantized base's own output
        base_out, expected = model(x), reference(x)
    assert ((base_out - expected).norm() / expected.norm()).item() < 0.02
    model(x).pow(2).mean().backward()
    assert all(p.grad is not None for p in trainable.values())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_backward_keeps_the_int8_codes_not_a_dequantized_copy():
    """The input's gradient equals F.linear's on the dequantized weight, and what autograd keeps for backward is the
    int8 parameter and its scales (plus the input), never a compute-dtype copy of the weight."""
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(torch.nn.Linear(64, 96), torch.bfloat16)
    layer.weight_scale.data = layer.weight_scale.data.to(torch.bfloat16)
    layer.bias.data = layer.bias.data.to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert all(t.dtype == torch.int8 or t.numel() < 64 * 96 for t in saved)
    assert any(t is layer.weight or t.data_ptr() == layer.weight.data_ptr() for t in saved)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, grad)
    x2 = x.detach().clone().requires_grad_(True)
    expected_out = torch.nn.functional.linear(x2, layer.dequantized_weight(torch.bfloat16), layer.bias)
    (expected,) = torch.autograd.grad(expected_out, x2, grad)
    assert torch.equal(out, expected_out) and torch.equal(got, expected)


def test_the_plan_stores_what_the_int8_layers_of_a_video_model_hold(tmp_path):
    """validate's plan for a tiny-wan LoRA with an int8 base under ZeRO-3 (2 ranks, bf16): the stored bytes per rank
    and the int8 codes per rank are what the real transformer holds once its linear layers are Int8Linear and its
    other parameters bf16, halved; against the run on the bf16 base the GPU's frozen bytes change by that share
    instead of the bf16 one, plus one gathered layer's dequantized copy."""
    from diffusers import WanTransformer3DModel

    from dstune.builtin import ensure_builtin_model
    from dstune.validate import load_and_validate, plan_memory
    from dstune.world import world_from_flags
    from loaded_models import CACHE_DIR

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model:\n  family: video\n  pretrained: builtin:tiny-wan\n  train: lora\n  base_precision: int8\n"
        "data:\n  path: builtin:moving-shapes\ntrain:\n  micro_batch_size: 1\n  max_steps: 2\n  precision: bf16\n"
        "deepspeed:\n  zero_stage: 3\n"
    )
    resolved = load_and_validate(spec, world=world_from_flags(world_size=2))
    memory = plan_memory(resolved.spec, resolved.plan, resolved.ds_config, None, "cpu", resolved.clips)
    planned = memory["parameters"]["quantized_base"]
    module = WanTransformer3DModel.from_pretrained(ensure_builtin_model("tiny-wan", CACHE_DIR) / "transformer")
    quantize_linear_weights_int8(module, torch.bfloat16)
    module.to(torch.bfloat16)  # floating parameters only: the int8 codes stay int8
    codes = [p for p in module.parameters() if p.dtype == torch.int8]
    assert codes and planned["int8_codes_bytes_per_rank"] * 2 == sum(p.numel() for p in codes)
    assert planned["stored_bytes_per_rank"] * 2 == sum(p.numel() * p.element_size() for p in module.parameters())
    spec.write_text(spec.read_text().replace("  base_precision: int8\n", ""))
    resolved = load_and_validate(spec, world=world_from_flags(world_size=2))
    plain = plan_memory(resolved.spec, resolved.plan, resolved.ds_config, None, "cpu", resolved.clips)
    assert "quantized_base" not in plain["parameters"]
    # on the GPU: the stored share instead of the bf16 share, and one gathered layer's dequantized bf16 copy beside it
    params, layer = memory["parameters"]["module_params"], memory["parameters"]["largest_layer_params"]
    added = memory["per_gpu"]["frozen_bytes"] - plain["per_gpu"]["frozen_bytes"]
    assert added == pytest.approx(planned["stored_bytes_per_rank"] - 2 * params / 2 + 2 * layer, abs=1)
