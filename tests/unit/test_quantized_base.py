"""model.base_precision: the frozen denoiser stored quantized under LoRA (bitsandbytes on the CPU here), and the
refusals (without LoRA, fp8, nf4 under ZeRO-3) with their file:line and key. The 2-rank ZeRO-2 run with an int8 base, its
loss against the full-precision base and its export are in tests/dist/test_lora_ema_runs.py."""

from __future__ import annotations

import pytest
import torch

from dstune.models.sd.spec import SdModelSpec
from dstune.spec.load import SpecError
from dstune.spec.models import BASE_PRECISION_BYTES
from loaded_models import CACHE_DIR, with_attributes

LORA = {"train": "lora", "lora": {"rank": 2, "alpha": 2}}


@pytest.fixture(scope="module")
def sd_model():
    """builtin:tiny-sd loaded: apply_train_mode makes a loaded model's trainable module trainable."""
    from dstune.pretrained import build_model

    return build_model(SdModelSpec(family="sd", pretrained="builtin:tiny-sd"), CACHE_DIR, "cpu")


def _write(tmp_path, model: dict, zero_stage: int = 2):
    spec = tmp_path / "spec.yaml"
    lines = ["model:", "  family: sd"] + [f"  {key}: {value}" for key, value in model.items()]
    lines += [
        "data:",
        "  path: builtin:shapes",
        "train:",
        "  micro_batch_size: 1",
        "  max_steps: 2",
        "deepspeed:",
        f"  zero_stage: {zero_stage}",
    ]
    spec.write_text("\n".join(lines) + "\n")
    return spec


def _issues(tmp_path, model: dict, zero_stage: int = 2) -> list:
    from dstune.validate import load_and_validate
    from dstune.world import world_from_flags

    with pytest.raises(SpecError) as caught:
        load_and_validate(_write(tmp_path, model, zero_stage), world=world_from_flags(world_size=2))
    return caught.value.issues


def test_base_precision_without_lora_is_refused_at_its_line(tmp_path):
    (issue,) = _issues(tmp_path, {"base_precision": "int8"})
    assert issue.key == "model.base_precision" and issue.where.endswith("spec.yaml:3")
    assert "`train` is 'full'" in issue.message and "Set `train: lora`" in issue.message


def test_fp8_is_refused_with_the_reason(tmp_path):
    (issue,) = _issues(tmp_path, {"train": "lora", "base_precision": "fp8"})
    assert issue.key == "model.base_precision" and issue.where.endswith("spec.yaml:4")
    assert "fp8 is not available" in issue.message and "aten.view.dtype" in issue.message


def test_nf4_under_zero3_is_refused_by_validate_and_int8_accepted(tmp_path):
    """nf4 stays bitsandbytes' (its block scales live on the parameter object, which ZeRO-3 does not gather); int8
    under ZeRO-3 is dstune's own partitionable layer (dstune.families.int8_partitioned), except with DoRA."""
    from dstune.validate import load_and_validate
    from dstune.world import world_from_flags

    (issue,) = _issues(tmp_path, {"train": "lora", "base_precision": "nf4"}, zero_stage=3)
    assert issue.key == "model.base_precision" and issue.where.endswith("spec.yaml:4")
    assert "nf4 with ZeRO stage 3" in issue.message and "neither partitions nor gathers" in issue.message
    assert "base_precision int8" in issue.message and "deepspeed.zero_stage 2" in issue.message
    for precision, stage in (("nf4", 2), ("int8", 2), ("int8", 3)):
        model = {"train": "lora", "base_precision": precision}
        resolved = load_and_validate(_write(tmp_path, model, stage), world=world_from_flags(world_size=2))
        assert resolved.spec.model.base_precision == precision
    spec = _write(tmp_path, {"train": "lora", "base_precision": "int8"}, 3)
    spec.write_text(spec.read_text() + f"  offload_param: {{device: nvme, nvme_path: {tmp_path}}}\n")
    with pytest.raises(SpecError) as caught:
        load_and_validate(spec, world=world_from_flags(world_size=2))
    (issue,) = caught.value.issues
    assert "NVMe parameter swapper" in issue.message and "offload_param cpu" in issue.message
    dora = {"train": "lora", "lora": "{type: dora, rank: 2}", "base_precision": "int8"}
    (issue,) = _issues(tmp_path, dora, zero_stage=3)
    assert issue.key == "model.lora.type" and "DoRA normalises by the base layer's weight" in issue.message


def _tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )


@pytest.mark.parametrize("precision, tolerance", [("int8", 0.02), ("nf4", 0.15)])
def test_quantized_base_keeps_the_output_and_trains_only_fp32_adapters(sd_model, precision, tolerance):
    """The quantized UNet's output stays near the fp32 one; only the (fp32) adapters get gradients; every weight
    survives DeepSpeed's broadcast (a byte view); linear weights shrink as BASE_PRECISION_BYTES says."""
    import bitsandbytes as bnb

    from dstune.families.lora import apply_train_mode

    reference, unet = _tiny_unet(), _tiny_unet()
    linears = [m for m in reference.modules() if type(m) is torch.nn.Linear]
    linear_numel = sum(m.weight.numel() for m in linears)
    model = with_attributes(sd_model, trainable=unet)  # the SD model training this small UNet
    summary = apply_train_mode(model, SdModelSpec(family="sd", base_precision=precision, **LORA), seed=0)
    assert f"frozen base {precision}: {len(linears)} linear layers quantized" in summary
    layer_type = bnb.nn.Linear8bitLt if precision == "int8" else bnb.nn.Linear4bit
    assert sum(isinstance(m, layer_type) for m in unet.modules()) == len(linears)
    trainable = {n: p for n, p in unet.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in unet.modules() if isinstance(m, layer_type))
    assert weight_bytes == linear_numel * (1 if precision == "int8" else 0.5)  # scales are beside: <= the table
    assert weight_bytes / linear_numel <= BASE_PRECISION_BYTES[precision] < BASE_PRECISION_BYTES["bf16"]
    for param in unet.parameters():
        param.data.view(torch.uint8)  # what deepspeed.initialize's _broadcast_model does to every parameter
    inputs = (torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 5, 32))
    expected = reference(*inputs).sample
    out = unet(*inputs).sample
    assert ((out - expected).norm() / expected.norm()).item() < tolerance
    out.pow(2).mean().backward()
    assert all(p.grad is not None for p in trainable.values())
    assert all(p.grad is None for p in unet.parameters() if not p.requires_grad)


def test_partitioned_build_only_under_zero3_for_families_that_can_and_without_a_quantized_base():
    from dstune.pretrained import partitioned_build_config
    from dstune.models.speecht5.spec import SpeechT5ModelSpec

    zero3, zero2 = {"zero_optimization": {"stage": 3}}, {"zero_optimization": {"stage": 2}}
    assert partitioned_build_config(SdModelSpec(family="sd"), zero3) is zero3
    assert partitioned_build_config(SdModelSpec(family="sd"), zero2) is None
    assert partitioned_build_config(SdModelSpec(family="sd", base_precision="int8", **LORA), zero3) is None
    assert partitioned_build_config(SpeechT5ModelSpec(family="speecht5"), zero3) is None  # builds whole
