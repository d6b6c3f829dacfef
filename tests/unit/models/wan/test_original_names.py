"""model.transformer_file in Wan 2.1's original naming (the fp8 files people download: `blocks.N.self_attn.q`,
`head.head`, ...): dstune's map (dstune/models/wan/original_names.py) against diffusers' own converter on the
text-to-video and image-to-video transformers, and tiny-wan written as a scaled fp8 file in that naming from its
real weights, read as the same bytes and the same LoRA loss as the diffusers-named file."""

from __future__ import annotations

import pytest
import torch

from dstune import builtin as tiny
from dstune.models.wan.card import WAN_CARD
from loaded_models import CACHE_DIR
from quantized_files import linear_weights, to_original, wan_original_pieces, write_original_quantized
from tiny_batches import clip_batch

LORA = {"train": "lora", "lora": {"rank": 4, "alpha": 4}}


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-wan-i2v"])
def test_the_map_is_diffusers_converter(name):
    """Every parameter, each row traced (test_original_names of sd3_flux: stand_ins): the helper's original file
    converts back with diffusers' convert_wan_transformer_to_diffusers to the same rows, and dstune's map reads the
    same rows from it. The image-to-video transformer adds the image embedder and the image key/value layers."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from models.sd3_flux.test_original_names import dstune_reading, stand_ins

    config = WanTransformer3DModel.load_config(tiny.ensure_builtin_model(name, CACHE_DIR) / "transformer")
    with init_empty_weights():
        model = WanTransformer3DModel.from_config(config)
    diffusers_rows = stand_ins({name: tuple(p.shape) for name, p in model.state_dict().items()})
    original = to_original(diffusers_rows, wan_original_pieces(diffusers_rows))
    assert "blocks.0.self_attn.q.weight" in original and "head.modulation" in original
    converted = convert_wan_transformer_to_diffusers(dict(original))
    assert converted.keys() == diffusers_rows.keys()
    assert all(torch.equal(converted[name], diffusers_rows[name]) for name in converted)
    read = dstune_reading(original, dict(config), WAN_CARD)
    assert read.keys() == diffusers_rows.keys()
    assert all(torch.equal(read[name], diffusers_rows[name]) for name in read)


def test_tiny_wan_in_the_original_naming_trains_as_the_diffusers_named_file(tmp_path):
    """The same stored bytes and scales layer by layer, and the same LoRA loss (bitwise) on the same clips."""
    from diffusers import WanTransformer3DModel

    from dstune.families.lora import apply_train_mode
    from dstune.families.quantized_base import scaled_layers
    from dstune.pretrained import build_model
    from dstune.spec.models import VideoModelSpec

    folder = tiny.ensure_builtin_model("tiny-wan", CACHE_DIR)
    transformer = WanTransformer3DModel.from_pretrained(folder / "transformer")
    paths = tmp_path / "original.safetensors", tmp_path / "diffusers.safetensors"
    written = write_original_quantized(transformer, wan_original_pieces, *paths)
    assert "blocks.0.cross_attn.o.scale_weight" in written and "head.head.scale_weight" in written
    models, losses = [], []
    for path in paths:
        spec = VideoModelSpec(family="video", pretrained=str(folder), transformer_file=str(path), **LORA)
        model = build_model(spec, CACHE_DIR, "cpu")
        apply_train_mode(model, model.model_spec, seed=0)
        losses.append(model.loss(model.trainable, model.encode_batch(clip_batch([1, 8], 5)), 0, 3).item())
        models.append(model.trainable)
    layers = [scaled_layers(model) for model in models]
    assert len(layers[0]) == len(layers[1]) == len(linear_weights(transformer))
    for layer, other in zip(*layers):
        assert torch.equal(layer.weight, other.weight) and torch.equal(layer.scale_bits, other.scale_bits)
    plain = [{n: p for n, p in model.named_parameters() if p.dtype != torch.int8} for model in models]
    assert plain[0].keys() == plain[1].keys() and all(torch.equal(plain[0][n], plain[1][n]) for n in plain[0])
    print("LoRA loss on the original-named file", losses[0], "on the diffusers-named file", losses[1])
    assert losses[0] == losses[1]


def test_the_start_up_names_what_an_original_file_lacks(tmp_path):
    """tiny-wan's original-named file against the image-to-video transformer's config, refused before any weight is
    read: the image key/value layers named in diffusers' names, the naming it was read in, the patch embedding's
    other width."""
    from diffusers import WanTransformer3DModel

    from dstune.families.base import FamilyError
    from dstune.families.quantized_base import load_quantized_transformer

    transformer = WanTransformer3DModel.from_pretrained(
        tiny.ensure_builtin_model("tiny-wan", CACHE_DIR) / "transformer"
    )
    paths = tmp_path / "original.safetensors", tmp_path / "diffusers.safetensors"
    write_original_quantized(transformer, wan_original_pieces, *paths)
    config = WanTransformer3DModel.load_config(tiny.ensure_builtin_model("tiny-wan-i2v", CACHE_DIR) / "transformer")
    with pytest.raises(
        FamilyError,
        match=r"(?s)not in the file: blocks.0.attn2.add_k_proj.*Wan.s original names.*patch_embedding.weight",
    ):
        load_quantized_transformer(WanTransformer3DModel, config, paths[0], WAN_CARD)
