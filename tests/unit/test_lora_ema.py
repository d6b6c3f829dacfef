"""EMA arithmetic and sharding, LoRA adapters and their diffusers naming, the samples contact sheet, the spec rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dstune.ema import Ema, consolidated_ema, decay_at, overlay_ema, shard_range
from dstune.spec.models import EmaSpec
from dstune.models.sd.card import SD_CARD
from dstune.models.sd.model import Sd
from dstune.models.sd.spec import SdModelSpec


def _params(*shapes, seed=0) -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(shape, generator=generator))) for i, shape in enumerate(shapes)]


def test_decay_warms_up_like_diffusers_ema_model_and_is_capped():
    assert decay_at(0, 0.9999, warmup=True) == pytest.approx(1 / 10)
    assert decay_at(8, 0.9999, warmup=True) == pytest.approx(9 / 18)
    assert decay_at(10**6, 0.99, warmup=True) == 0.99
    assert decay_at(0, 0.99, warmup=False) == 0.99


def test_shard_ranges_cover_every_element_once_like_zero3_partitions():
    for numel in (1, 2, 7, 8, 1001):
        for world in (1, 2, 3, 8):
            ranges = [shard_range(numel, rank, world) for rank in range(world)]
            covered = [i for start, end in ranges for i in range(start, end)]
            assert covered == list(range(numel))
            assert all(end - start <= -(-numel // world) for start, end in ranges)


def test_ema_update_follows_the_formula_every_n_steps():
    params = _params((3, 2), (5,))
    ema = Ema(params, EmaSpec(decay=0.5, warmup=False, every_steps=2))
    start = {name: p.detach().clone() for name, p in params}
    expected = {name: t.clone() for name, t in start.items()}
    for step in range(1, 5):
        with torch.no_grad():
            for _, p in params:
                p.add_(1.0)
        ema.on_optimizer_step()
        if step % 2 == 0:
            for name, p in params:
                expected[name] = 0.5 * expected[name] + 0.5 * p.detach()
    assert ema.optimizer_steps == 4 and ema.updates == 2
    for name, _ in params:
        assert torch.allclose(ema.shadow[name].view_as(expected[name]), expected[name])


def test_shares_of_two_ranks_consolidate_to_the_full_ema(tmp_path):
    """Each rank keeps ceil(numel / 2) elements; the export concatenates the files (odd sizes, a 1-element param)."""
    params = _params((7,), (3, 3), (1,))
    settings = EmaSpec(decay=0.9, warmup=False)
    shares = [Ema(params, settings, rank=rank, world_size=2) for rank in (0, 1)]
    with torch.no_grad():
        for _, p in params:
            p.mul_(2.0)
    for ema in shares:
        ema.on_optimizer_step()
        ema.save(tmp_path)
    assert shares[1].shadow["p2"].numel() == 0  # rank 1 owns nothing of a 1-element parameter
    full = consolidated_ema(tmp_path)
    for name, p in params:
        expected = 0.9 * (p.detach() / 2) + 0.1 * p.detach()
        assert full[name].shape == p.shape
        assert torch.allclose(full[name], expected)


def test_ema_state_round_trips_and_refuses_another_model(tmp_path):
    params = _params((4, 4))
    ema = Ema(params, EmaSpec(decay=0.7))
    for _ in range(3):
        ema.on_optimizer_step()
    ema.save(tmp_path)
    again = Ema(_params((4, 4), seed=1), EmaSpec(decay=0.7))
    again.load(tmp_path)
    assert again.updates == 3 and again.optimizer_steps == 3
    assert torch.equal(again.shadow["p0"], ema.shadow["p0"])
    other = Ema(_params((4, 5)), EmaSpec(decay=0.7))
    with pytest.raises(ValueError, match="p0 has shape"):
        other.load(tmp_path)


def test_sampling_with_the_ema_restores_the_trained_weights_exactly():
    params = _params((6,))
    ema = Ema(params, EmaSpec(decay=0.5, warmup=False))
    trained = params[0][1].detach().clone()
    ema.shadow["p0"].fill_(3.0)
    with ema.weights_in_model():
        assert torch.equal(params[0][1].detach(), torch.full((6,), 3.0))
    assert torch.equal(params[0][1].detach(), trained)


def test_overlay_puts_ema_in_place_with_the_state_shapes():
    state = {"a": torch.zeros(()), "b": torch.zeros(2, 2), "frozen": torch.ones(3)}
    out = overlay_ema(state, {"a": torch.tensor([5.0]), "b": torch.ones(4)})
    assert out["a"].shape == () and out["a"].item() == 5.0
    assert torch.equal(out["b"], torch.ones(2, 2)) and torch.equal(out["frozen"], torch.ones(3))
    with pytest.raises(ValueError, match="no matching weight"):
        overlay_ema(state, {"nope": torch.ones(1)})


# ------------------------------------------------------------------------------------------------------ LoRA


def _tiny_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        attention_head_dim=2,
        norm_num_groups=4,
    )


def _tiny_sd(spec: SdModelSpec) -> Sd:
    """The SD class around a tiny random UNet, not loaded from a folder: apply_train_mode reads only its trained
    module and whether it writes LoRA files."""
    model = Sd(SD_CARD, spec, Path("tiny-unet"), "cpu")
    model.trainable = _tiny_unet()
    return model


def test_lora_makes_only_seeded_adapters_trainable():
    from dstune.families.lora import apply_train_mode

    spec = SdModelSpec(family="sd", train="lora", lora={"rank": 2, "alpha": 4})
    models = [_tiny_sd(spec), _tiny_sd(spec)]
    summaries = [apply_train_mode(model, spec, seed=3) for model in models]
    unets = [model.trainable for model in models]
    assert "LoRA rank 2, alpha 4" in summaries[0]
    trainable = {name: p for name, p in unets[0].named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert all(not torch.any(p) for n, p in trainable.items() if ".lora_B." in n)  # untrained adapter adds 0
    other = dict(unets[1].named_parameters())
    assert all(torch.equal(p, other[n]) for n, p in trainable.items())  # same seed, same A on every rank


def test_full_training_leaves_the_denoiser_as_it_is():
    from dstune.families.lora import apply_train_mode

    model = _tiny_sd(SdModelSpec(family="sd"))
    assert apply_train_mode(model, model.model_spec, seed=0).startswith("training: full")
    assert all(p.requires_grad for p in model.trainable.parameters())


def test_lora_target_modules_that_match_nothing_are_a_clear_error():
    from dstune.families.base import FamilyError
    from dstune.families.lora import apply_train_mode

    spec = SdModelSpec(family="sd", train="lora", lora={"target_modules": ["no_such_layer"]})
    with pytest.raises(FamilyError, match=r"model.lora.target_modules \['no_such_layer'\]"):
        apply_train_mode(_tiny_sd(spec), spec, seed=0)


def test_adapter_tensors_get_peft_names_for_diffusers_and_kohya_names():
    from dstune.families.base import FamilyError
    from dstune.families.lora import adapter_state_dict, diffusers_lora_layers, kohya_lora_tensors

    state = {
        "blocks.0.attn1.to_q.base_layer.weight": torch.ones(4, 4),
        "blocks.0.attn1.to_q.lora_A.default.weight": torch.ones(2, 4),
        "blocks.0.attn1.to_q.lora_B.default.weight": torch.zeros(4, 2),
    }
    assert set(adapter_state_dict(state)) == {"blocks.0.attn1.to_q.lora_A.weight", "blocks.0.attn1.to_q.lora_B.weight"}
    layers = diffusers_lora_layers(state)
    assert set(layers) == {"blocks.0.attn1.to_q.lora_A.weight", "blocks.0.attn1.to_q.lora_B.weight"}
    assert torch.equal(layers["blocks.0.attn1.to_q.lora_A.weight"], torch.ones(2, 4))
    kohya = kohya_lora_tensors(state, alpha=8)
    assert set(kohya) == {
        f"lora_unet_blocks_0_attn1_to_q.{part}" for part in ("lora_down.weight", "lora_up.weight", "alpha")
    }
    assert torch.equal(kohya["lora_unet_blocks_0_attn1_to_q.lora_down.weight"], torch.ones(2, 4))
    assert (
        kohya["lora_unet_blocks_0_attn1_to_q.alpha"].shape == () and kohya["lora_unet_blocks_0_attn1_to_q.alpha"] == 8
    )
    with pytest.raises(FamilyError, match="no LoRA adapter weights"):
        adapter_state_dict({"conv.weight": torch.ones(1)})


# ------------------------------------------------------------------------------------------ spec and samples


def test_lora_settings_without_lora_training_name_the_key():
    from dstune.spec.load import SpecError, SpecSource, validate_data

    data = {"model": {"family": "sd", "lora": {"rank": 4}}, "train": {"micro_batch_size": 1, "max_steps": 2}}
    with pytest.raises(SpecError, match=r"model\.lora: LoRA settings are given but `train` is 'full'"):
        validate_data(data, SpecSource("spec.yaml"))
    data["model"]["train"] = "lora"
    assert validate_data(data, SpecSource("spec.yaml")).model.lora_settings.rank == 4
    assert SdModelSpec(family="sd", train="lora").lora_settings.target_modules == ["to_q", "to_k", "to_v", "to_out.0"]


def test_contact_sheet_lists_every_step_in_order_with_escaped_prompts(tmp_path):
    from dstune.families.samples import write_contact_sheet

    for step in (10, 0, 5):
        (tmp_path / f"step-{step:06d}.png").write_bytes(b"png")
    (tmp_path / "notes.txt").write_text("not a grid")
    page = write_contact_sheet(tmp_path, ["a <red> circle", ""], "EMA").read_text()
    assert [page.index(f"step {s}</h2>") for s in (0, 5, 10)] == sorted(
        page.index(f"step {s}</h2>") for s in (0, 5, 10)
    )
    assert 'src="step-000005.png"' in page and "notes.txt" not in page
    assert "a &lt;red&gt; circle" in page and "(empty prompt)" in page and "EMA weights" in page
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def _zero3_param(full: torch.Tensor, rank: int, world: int) -> torch.nn.Parameter:
    """A stand-in for a ZeRO-3 parameter: its own partition (ceil(numel / world), padded with 0) as ds_tensor."""
    part = -(-full.numel() // world)
    share = torch.zeros(part)
    piece = full.reshape(-1)[rank * part : (rank + 1) * part]
    share[: piece.numel()] = piece
    param = torch.nn.Parameter(torch.empty(0))
    param.ds_tensor, param.ds_shape = torch.nn.Parameter(share), full.shape
    return param


@pytest.mark.parametrize("zero3", [False, True])
def test_ema_shares_are_recut_for_another_number_of_ranks(tmp_path, zero3):
    """2 ranks' shares -> 1 and 3 ranks: each new rank holds its slice of the same full EMA (ZeRO-3: padded with 0)."""
    full = {"p0": torch.arange(7.0), "p1": torch.arange(9.0).reshape(3, 3) + 100, "p2": torch.tensor([5.0])}

    def emas(world):
        out = []
        for rank in range(world):
            params = [
                (n, _zero3_param(t, rank, world) if zero3 else torch.nn.Parameter(t.clone())) for n, t in full.items()
            ]
            out.append(Ema(params, EmaSpec(decay=0.9), rank=rank, world_size=world))
        return out

    for ema in emas(2):
        ema.optimizer_steps, ema.updates = 5, 5
        ema.save(tmp_path)
    for world in (1, 3):
        recut = emas(world)
        for ema in recut:
            for shadow in ema.shadow.values():
                shadow.fill_(-1.0)  # whatever the new ranks started with is replaced
            ema.load_resharded(tmp_path)
            assert (ema.optimizer_steps, ema.updates) == (5, 5)
        for name, tensor in full.items():
            shares = [ema.shadow[name] for ema in recut]
            joined = torch.cat(shares)
            assert torch.equal(joined[: tensor.numel()], tensor.reshape(-1))
            assert torch.all(joined[tensor.numel() :] == 0)  # ZeRO-3 padding of the last partition
