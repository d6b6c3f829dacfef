"""model.transformer_file in Flux.1's original naming (the fp8 files people download: `double_blocks.N.img_attn.qkv`,
`single_blocks.N.linear1`, ...): dstune's map (dstune/models/sd3_flux/original_names.py) against diffusers' own
converter at Flux.1-dev's shapes, and tiny-flux written as a scaled fp8 file in that naming from its real weights,
read as the same bytes, the same dequantized weights and the same LoRA loss as the diffusers-named file."""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.families.quantized_base import _rows
from dstune.models.sd3_flux.card import FLUX_CARD
from loaded_models import CACHE_DIR
from quantized_files import flux_original_pieces, to_original, write_original_quantized

FLUX1_DEV = dict(  # Flux.1-dev's transformer at 2 + 2 of its 19 + 38 blocks (the map is per block)
    patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
)  # fmt: skip


def stand_ins(shapes: dict) -> dict:
    """One float64 column per parameter, each row its own number (parameter index x 1e6 + row): where a row lands
    after a converter says where it came from."""
    return {
        name: (torch.arange(shape[0], dtype=torch.float64) + 1e6 * i).reshape(-1, 1)
        for i, (name, shape) in enumerate(shapes.items())
    }


def dstune_reading(original: dict, config: dict, card) -> dict:
    """The diffusers-named tensors dstune's map makes of the original ones (the rows the loader reads)."""
    mapping = card.original_transformer_names({k: tuple(v.shape) for k, v in original.items()}, config)
    return {target: _rows(original[source], rows) for target, (source, rows) in mapping.items()}


def test_the_map_is_diffusers_converter_at_flux1_dev_shapes():
    """Every parameter of Flux.1-dev's transformer, each row traced: the original file the test helper writes
    converts back with diffusers' convert_flux_transformer_checkpoint_to_diffusers to the same rows (the helper is
    right), and dstune's map reads the same rows from it (dstune is right). At Flux.1-dev's width only: diffusers'
    converter splits linear1 at 3072 rows, Flux.1's width."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    with init_empty_weights():
        model = FluxTransformer2DModel(**FLUX1_DEV)
    diffusers_rows = stand_ins({name: tuple(p.shape) for name, p in model.state_dict().items()})
    original = to_original(diffusers_rows, flux_original_pieces(diffusers_rows))
    assert "double_blocks.1.img_attn.qkv.weight" in original and "single_blocks.1.linear1.weight" in original
    converted = convert_flux_transformer_checkpoint_to_diffusers(dict(original))
    assert converted.keys() == diffusers_rows.keys()
    assert all(torch.equal(converted[name], diffusers_rows[name]) for name in converted)
    read = dstune_reading(original, dict(model.config), FLUX_CARD)
    assert read.keys() == diffusers_rows.keys()
    assert all(torch.equal(read[name], diffusers_rows[name]) for name in read)


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory):
    from diffusers import FluxTransformer2DModel

    folder = tiny.ensure_builtin_model("tiny-flux", CACHE_DIR)
    root = tmp_path_factory.mktemp("flux-original")
    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    files = {}
    for kind, prefix in [("fp8", "model.diffusion_model."), ("int8", "")]:  # ComfyUI's prefix on one, none on the other
        paths = root / f"original-{kind}.safetensors", root / f"diffusers-{kind}.safetensors"
        written = write_original_quantized(transformer, flux_original_pieces, *paths, prefix=prefix, kind=kind)
        files[kind] = (*paths, written)
    return folder, files


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_tiny_flux_in_the_original_naming_reads_as_the_diffusers_named_file(flux_files, kind):
    """Scaled fp8 (one scale a tensor) and ComfyUI int8_tensorwise (one a row): the same stored bytes and scales
    layer by layer (a fused qkv's per-tensor scale on each of its pieces, its per-row scales sliced with their rows),
    the same dequantized weights and plain parameters, and the same LoRA loss, bitwise."""
    from diffusers import FluxTransformer2DModel

    from dstune.families.quantized_base import ScaledLinear, dequantized, load_quantized_transformer
    from dstune.pretrained import build_model
    from dstune.spec.models import FlowModelSpec
    from test_quantized_file import LORA, _lora_loss
    from tiny_batches import shape_batch

    folder, files = flux_files
    original, renamed, written = files[kind]
    scale = {"fp8": "model.diffusion_model.double_blocks.0.img_attn.qkv.scale_weight"}
    assert written[scale.get(kind, "single_blocks.0.linear1.weight_scale")].numel() == (
        1 if kind == "fp8" else 3 * 32 + 128
    )
    config = FluxTransformer2DModel.load_config(folder / "transformer")
    models = [load_quantized_transformer(FluxTransformer2DModel, config, p, FLUX_CARD) for p in (original, renamed)]
    layers = [{n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear)} for model in models]
    assert layers[0].keys() == layers[1].keys() and "single_transformer_blocks.0.proj_mlp" in layers[0]
    for name, layer in layers[0].items():
        other = layers[1][name]
        assert torch.equal(layer.weight, other.weight) and torch.equal(layer.scale_bits, other.scale_bits), name
        full = dequantized(layer.weight, layer.scale_bits, layer.storage, torch.float32)
        assert torch.equal(full, dequantized(other.weight, other.scale_bits, other.storage, torch.float32))
    plain = [
        {
            n: p
            for n, p in m.named_parameters()
            if not isinstance(m.get_submodule(n.rpartition(".")[0]), ScaledLinear) or n.endswith("bias")
        }
        for m in models
    ]  # noqa: E501
    assert plain[0].keys() == plain[1].keys()
    assert all(torch.equal(plain[0][n], plain[1][n]) for n in plain[0])
    losses = []
    for path in (original, renamed):
        spec = FlowModelSpec(family="flow", pretrained=str(folder), transformer_file=str(path), **LORA)
        losses.append(_lora_loss(build_model(spec, CACHE_DIR, "cpu"), shape_batch([0, 1]))[0].item())
    print("LoRA loss on the original-named file", losses[0], "on the diffusers-named file", losses[1])
    assert losses[0] == losses[1]


def test_validate_reads_the_original_naming_and_names_a_missing_key(flux_files, tmp_path):
    """Offline, from the header: the original-named file fits the folder's transformer; the same file without one
    tensor is refused at the key's line, naming the diffusers parameter it lacks and the naming it was read in."""
    from safetensors.torch import save_file

    from test_quantized_file import _issue, _validate

    folder, files = flux_files
    original, _, written = files["fp8"]
    assert _validate(tmp_path, folder, original).spec.model.transformer_file == str(original)
    dropped = "model.diffusion_model.single_blocks.0.linear1.bias"
    save_file({k: v for k, v in written.items() if k != dropped}, str(tmp_path / "lacking.safetensors"))
    message = _issue(tmp_path, folder, tmp_path / "lacking.safetensors").message
    assert "single_transformer_blocks.0.attn.to_q.bias" in message and "Flux.1's original names" in message


def test_the_memory_plan_counts_an_original_named_file_as_its_layers(flux_files, tmp_path):
    """validate's plan of the original-named file equals the diffusers-named file's: the same stored bytes (a fused
    qkv's one scale held by each of its three layers) and the largest layer dequantized as its pieces are."""
    from test_quantized_file import _plan

    folder, files = flux_files
    original, renamed, _ = files["fp8"]
    memories = [_plan(tmp_path, folder, str(path))[3]["transformer_file"] for path in (original, renamed)]
    assert memories[0] == memories[1] and memories[0]["stored_bytes"] > 0
