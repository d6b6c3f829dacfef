"""model.activation_offload: cpu. The checkpoint function keeps copies of each block's inputs (never the inputs
themselves) and gives the same gradients as plain checkpointing; the memory plan moves the blocks' inputs from the
GPU figure to the host and keeps one block's on the GPU; validate refuses it without gradient checkpointing."""

from __future__ import annotations

import json
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dstune.cli import main
from dstune.families.diffusion import non_reentrant_checkpoint, offloaded_checkpoint
from dstune.memory.plan import estimate

from test_memory_plan import counts_for, setup_for

REPO = Path(__file__).resolve().parents[2]
WAN = str(REPO / "launch" / "wan21-t2v-14b-lora-zero3-8gpu.yaml")


class Block(torch.nn.Module):
    """A diffusers-style block: hidden states, a time embedding every block reads, a (cos, sin) tuple."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.dropout = torch.nn.Dropout(0.5)  # the recomputation must draw the same mask

    def forward(self, hidden, temb, rotary):
        cos, sin = rotary
        return self.dropout(torch.tanh(self.linear(hidden * cos + sin)) + temb)


def _run(checkpoint, seed: int = 0):
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList(Block(8) for _ in range(3))
    x = torch.randn(2, 8, requires_grad=True)
    temb = torch.randn(2, 8, requires_grad=True)
    rotary = (torch.randn(2, 8), torch.randn(2, 8))
    torch.manual_seed(seed + 1)
    hidden, middles = x, []
    for block in blocks:
        hidden = checkpoint(block, hidden, temb, rotary)
        middles.append(weakref.ref(hidden))
    loss = hidden.square().mean()
    alive = [ref() is not None for ref in middles[:-1]]  # a block's output, once the next block has read it
    loss.backward()
    return loss, [x.grad, temb.grad, *(p.grad for p in blocks.parameters())], alive


def test_offloaded_checkpoint_gives_plain_checkpointings_loss_and_gradients_bitwise():
    loss, grads, _ = _run(non_reentrant_checkpoint)
    loss_offloaded, grads_offloaded, _ = _run(offloaded_checkpoint)
    assert torch.equal(loss, loss_offloaded)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_offloaded))


def test_offloaded_checkpoint_holds_copies_not_the_blocks_inputs():
    """Plain checkpointing keeps each block's input (the previous block's output) alive until backward; with
    offload the checkpoint holds a copy, so the device tensor is freed once nothing reads it (on a GPU: the point
    of offloading), and the time embedding every block reads is left as it is."""
    _, _, alive_plain = _run(non_reentrant_checkpoint)
    _, _, alive_offloaded = _run(offloaded_checkpoint)
    assert alive_plain == [True, True] and alive_offloaded == [False, False]


def test_the_plan_moves_the_block_inputs_to_the_host_on_a_gpu():
    counts = counts_for(
        1_000_000, 100_000, checkpointed_sample_bytes=1000, offloaded_sample_bytes=600, offload_block_bytes=50
    )
    plain = setup_for(2, 8, 8, gradient_checkpointing=True)
    offloaded = replace(plain, activation_offload=True)
    before, after = estimate(counts, plain), estimate(counts, offloaded)
    # micro batch 2, bf16: the GPU keeps all but the inputs, and one block's back; the host gets the inputs
    assert before.activations == 2 * 1000 and after.activations == 2 * (1000 - 600 + 50)
    assert after.offloaded_activations == 2 * 600 and after.per_gpu()["offloaded_activations_bytes"] == 1200
    assert "offloaded_activations_bytes" not in before.per_gpu()
    # the CPU accelerator: the host is the device, the copies and one block's inputs are counted there
    on_cpu = estimate(counts, replace(offloaded, accelerator="cpu"))
    assert on_cpu.activations == 2 * (1000 + 50) and on_cpu.offloaded_activations == 0
    # without checkpointing there is nothing to offload
    assert estimate(counts, replace(offloaded, gradient_checkpointing=False)).activations == 0


def _validate(capsys, *sets: str) -> dict:
    args = ["validate", WAN, "--num-gpus", "8", "--num-samples", "1000", "--json"]
    for item in sets:
        args += ["--set", item]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)["memory"]["per_gpu"]


def test_validate_counts_wans_block_inputs_on_the_host(capsys):
    """Wan 2.1 14B LoRA (40 blocks, checkpointed): offload takes 39 of 40 blocks' inputs off the GPU."""
    plain = _validate(capsys)
    offloaded = _validate(capsys, "model.activation_offload=cpu")
    moved = plain["activations_bytes"] - offloaded["activations_bytes"]
    assert offloaded["offloaded_activations_bytes"] == pytest.approx(moved * 40 / 39, rel=1e-3)
    assert offloaded["total_bytes"] == plain["total_bytes"] - moved


def test_validate_refuses_offload_without_checkpointing(capsys):
    code = main(
        [
            "validate",
            WAN,
            "--num-gpus",
            "8",
            "--num-samples",
            "1000",
            "--set",
            "model.activation_offload=cpu",
            "--set",
            "model.gradient_checkpointing=false",
        ]
    )
    err = capsys.readouterr()
    assert code == 1
    assert (
        "model: activation_offload 'cpu'" in err.out + err.err and "gradient_checkpointing: true" in err.out + err.err
    )


# ------------------------------------------------------------------------------------- train.compile: the refusals


def _spec_error(model: dict, train: dict, deepspeed: dict) -> str:
    data = {"path": "builtin:tones"} if model["family"] == "tts_lm" else {}
    from dstune.spec.load import SpecError, SpecSource, validate_data

    base = {"micro_batch_size": 2, "max_steps": 4}
    with pytest.raises(SpecError) as err:
        validate_data(
            {"model": model, "data": data, "train": {**base, **train}, "deepspeed": deepspeed}, SpecSource("spec.yaml")
        )
    return str(err.value)


@pytest.mark.parametrize(
    "model, deepspeed, why",
    [
        ({"family": "flow"}, {"zero_stage": 3}, "ZeRO-3 gathers and releases each block's parameters"),
        ({"family": "flow"}, {"zero_stage": 2, "sequence_parallel_size": 2}, "attention all-to-alls"),
        ({"family": "tts_lm"}, {"zero_stage": 2}, "trains no diffusers denoiser"),
    ],
)
def test_compiled_blocks_are_refused_where_dstune_has_not_run_them(model, deepspeed, why):
    message = _spec_error(model, {"compile": "blocks"}, deepspeed)
    assert "train.compile" in message and why in message


def test_compiled_blocks_and_offload_are_accepted_on_a_diffusion_model_under_zero2():
    from dstune.spec.load import SpecSource, validate_data

    spec = validate_data(
        {
            "model": {"family": "sd", "gradient_checkpointing": True, "activation_offload": "cpu"},
            "train": {"micro_batch_size": 2, "max_steps": 4, "compile": "blocks"},
            "deepspeed": {"zero_stage": 2},
        },
        SpecSource("spec.yaml"),
    )
    assert spec.train.compile == "blocks" and spec.model.activation_offload == "cpu"


def test_compiled_blocks_add_the_compilers_memory_on_the_cpu_accelerator_only():
    from dstune.memory.reserve import CPU_COMPILE_RESERVE_BYTES

    counts = counts_for(1_000_000, 100_000, checkpointed_sample_bytes=1000)
    plain = setup_for(2, 2, 2, gradient_checkpointing=True, accelerator="cpu")
    compiled = replace(plain, compiled_blocks=True)
    assert estimate(counts, compiled).reserve == estimate(counts, plain).reserve + CPU_COMPILE_RESERVE_BYTES
    on_gpu = replace(compiled, accelerator="cuda")
    assert estimate(counts, on_gpu).reserve == estimate(counts, replace(on_gpu, compiled_blocks=False)).reserve
