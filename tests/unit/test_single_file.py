"""model.pretrained as a single checkpoint file in the original (non-diffusers) key layout: converted by diffusers'
from_single_file with model.base_pipeline as config, offline; the components the file lacks come from the base.

The fixture is the tiny built-in sd model written as one file in the original layout (tests/unit/original_layout.py)
with its UNet and text encoder weights changed, so a test can tell the file's weights from the base's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dstune import builtin as tiny
from dstune.families.base import FamilyError
from dstune.pretrained import SINGLE_FILE_INFO, build_model
from dstune.spec.models import FlowModelSpec
from dstune.models.sd.spec import SdModelSpec
from dstune.models.sdxl.spec import SdxlModelSpec
from dstune.models.tts_lm.spec import TtsLmModelSpec
from loaded_models import CACHE_DIR
from original_layout import original_unet_state


def write_sd_single_file(path: Path, with_text_encoder: bool = True) -> dict:
    """The tiny sd UNet (+ CLIP text encoder) in the original layout, every weight shifted by +0.01 so they differ
    from the built-in's; returns the shifted diffusers-named weights {component: state dict}."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    folder = tiny.ensure_builtin_model("tiny-sd", CACHE_DIR)
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet")
    text = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")
    with torch.no_grad():
        for module in (unet, text):
            for param in module.parameters():
                param.add_(0.01)
    tensors = original_unet_state(unet)
    if with_text_encoder:  # the original SD 1.x checkpoint keeps the CLIP text model's names under this prefix
        tensors.update(
            {
                f"cond_stage_model.transformer.text_model.{k.removeprefix('text_model.')}": v.contiguous()
                for k, v in text.state_dict().items()
                if "position_ids" not in k
            }
        )
    save_file(tensors, str(path))
    return {"unet": unet.state_dict(), "text_encoder": text.state_dict()}


def _sd(path, **more) -> SdModelSpec:
    return SdModelSpec(family="sd", pretrained=str(path), **more)


@pytest.fixture(scope="module")
def base() -> str:
    """The built-in tiny sd folder of the shared test cache (model.base_pipeline as a folder, so the converted
    folders go to each test's own cache_dir and the built-in is not built again there)."""
    return str(tiny.ensure_builtin_model("tiny-sd", CACHE_DIR))


def test_a_single_file_in_the_original_layout_builds_with_its_own_weights(tmp_path, base):
    path = tmp_path / "tiny-sd-original.safetensors"
    weights = write_sd_single_file(path)
    built = build_model(_sd(path, base_pipeline=base), tmp_path / "cache", "cpu")
    info = json.loads((built.folder / SINGLE_FILE_INFO).read_text())
    assert info["from_file"] == ["text_encoder", "unet"] and info["from_base"] == ["vae"]
    for name, module in (("unet", built.trainable), ("text_encoder", built.text_encoders["text_encoder"])):
        state = module.state_dict()
        assert max((state[k] - v).abs().max().item() for k, v in weights[name].items() if k in state) < 1e-6
    builtin = build_model(SdModelSpec(family="sd"), CACHE_DIR, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(builtin.vae.state_dict().values(), built.vae.state_dict().values()))
    again = build_model(_sd(path, base_pipeline=base), tmp_path / "cache", "cpu")
    assert again.folder == built.folder  # converted once, then read from the cache


def test_a_unet_only_file_takes_the_text_encoder_from_the_base(tmp_path, base):
    path = tmp_path / "unet-only.safetensors"
    write_sd_single_file(path, with_text_encoder=False)
    built = build_model(_sd(path, base_pipeline=base), tmp_path / "cache", "cpu")
    assert json.loads((built.folder / SINGLE_FILE_INFO).read_text())["from_base"] == ["text_encoder", "vae"]


def test_unusable_files_are_refused_saying_what_is_possible(tmp_path, base):
    good = tmp_path / "model.safetensors"
    write_sd_single_file(good)
    with pytest.raises(FamilyError, match=r"no such file\. Give an existing \.safetensors/\.ckpt checkpoint"):
        build_model(_sd(tmp_path / "missing.safetensors", base_pipeline=base), tmp_path, "cpu")
    with pytest.raises(ValueError, match="is a single checkpoint file: set base_pipeline to the diffusers sd pipeline"):
        _sd(good)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"encoder.layer.0.weight": torch.ones(2)}, str(foreign))
    with pytest.raises(
        FamilyError,
        match=r"the unet under model\.diffusion_model\..*not in that layout \(e\.g\. "
        r"encoder\.layer\.0\.weight\)",
    ):
        build_model(_sd(foreign, base_pipeline=base), tmp_path, "cpu")
    sdxl_like = tmp_path / "sdxl.safetensors"
    save_file(
        {
            "model.diffusion_model.label_emb.0.0.weight": torch.ones(2),
            "conditioner.embedders.0.transformer.x": torch.ones(1),
        },
        str(sdxl_like),
    )
    with pytest.raises(FamilyError, match=r"it looks like an SDXL checkpoint \(model.family sdxl\)"):
        build_model(_sd(sdxl_like, base_pipeline=base), tmp_path, "cpu")
    not_safetensors = tmp_path / "broken.safetensors"
    not_safetensors.write_bytes(b"not a checkpoint")
    with pytest.raises(FamilyError, match="cannot read it as a .safetensors checkpoint"):
        build_model(_sd(not_safetensors, base_pipeline=base), tmp_path, "cpu")
    with pytest.raises(
        FamilyError, match="model.family tts_lm cannot load a single checkpoint file.*model.family sd or sdxl"
    ):
        build_model(TtsLmModelSpec(family="tts_lm", pretrained=str(good)), tmp_path, "cpu")
    with pytest.raises(
        ValueError, match=r"model.family flow cannot load a single checkpoint file here.*\(sd and sdxl "
    ):
        FlowModelSpec(family="flow", pretrained=str(good), base_pipeline=base)
    with pytest.raises(ValueError, match="base_pipeline applies only when pretrained is a single checkpoint file"):
        SdxlModelSpec(family="sdxl", base_pipeline="builtin:tiny-sd")


def test_an_sdxl_unet_file_in_the_original_layout_builds_with_its_weights(tmp_path):
    """SDXL's original layout (label_emb for the added conditioning); VAE and both text encoders from the base."""
    from diffusers import UNet2DConditionModel

    folder = tiny.ensure_builtin_model("tiny-sdxl", CACHE_DIR)
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet")
    with torch.no_grad():
        for param in unet.parameters():
            param.add_(0.01)
    path = tmp_path / "tiny-sdxl-unet.safetensors"
    save_file(original_unet_state(unet), str(path))
    assert any(".label_emb." in key for key in original_unet_state(unet))
    built = build_model(
        SdxlModelSpec(family="sdxl", pretrained=str(path), base_pipeline=str(folder)), tmp_path / "cache", "cpu"
    )
    info = json.loads((built.folder / SINGLE_FILE_INFO).read_text())
    assert info["from_file"] == ["unet"] and info["from_base"] == ["text_encoder", "text_encoder_2", "vae"]
    state = built.trainable.state_dict()
    assert max((state[k] - v).abs().max().item() for k, v in unet.state_dict().items()) < 1e-6
