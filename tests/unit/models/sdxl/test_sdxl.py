"""SDXL (its card and class, dstune.models.sd) and builtin:tiny-sdxl on the real (tiny) components, and the crop
geometry it conditions on.

The built-in model lives in the shared test cache (as in tests/dist), so it is built once per machine (~10 s).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from dstune.pretrained import build_model
from dstune.data.images import ImageCaptionDataset, collate, crop_fields, decoded_size
from dstune.data.index import SampleRecord
from dstune import builtin as tiny
from dstune.models.sd.card import SD_CARD
from dstune.models.sdxl.card import SDXL_CARD
from dstune.models.sdxl.model import Sdxl, time_ids
from dstune.families.base import FamilyError
from dstune.spec.models import DataSpec, SampleSpec
from dstune.models.sdxl.spec import SdxlModelSpec
from loaded_models import CACHE_DIR


@pytest.fixture(scope="module")
def built():
    return build_model(SdxlModelSpec(family="sdxl"), CACHE_DIR, "cpu", torch.float32)


def _batch(pixels: torch.Tensor) -> dict:
    return {
        "pixel_values": pixels,
        "caption": ["a red circle", ""],
        "index": torch.tensor([3, 8]),
        "original_size": torch.tensor([[48, 64], [32, 32]]),
        "crop_top_left": torch.tensor([[0, 6], [0, 0]]),
    }


def _record(path: Path) -> SampleRecord:
    return SampleRecord(sample_id=path.stem, image_path=str(path), caption="x", repeats=1)


# ------------------------------------------------------------------------------------------- crop geometry


def test_crop_fields_are_the_crop_the_loader_made(tmp_path):
    """A 64x48 (w x h) image at 32 px: resized to 43x32, the centre crop starts 6 px from the left; flipped, the
    same crop sits 5 px from the left of the flipped image. Sizes are (height, width), crops (top, left)."""
    path = tmp_path / "wide.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(path)
    record = _record(path)
    plain = crop_fields(record, (64, 48), 32, 0.5, 0.5, flip=False)
    assert plain["original_size"].tolist() == [48, 64] and plain["crop_top_left"].tolist() == [0, 6]
    assert crop_fields(record, (64, 48), 32, 0.5, 0.5, flip=True)["crop_top_left"].tolist() == [0, 5]
    assert crop_fields(record, (64, 48), 32, 0.0, 0.0, flip=False)["crop_top_left"].tolist() == [0, 0]
    assert crop_fields(record, (64, 48), 32, 1.0, 0.0, flip=False)["crop_top_left"].tolist() == [0, 11]
    ids = time_ids(plain["original_size"][None], plain["crop_top_left"][None], (32, 32))
    assert ids.tolist() == [[48.0, 64.0, 0.0, 6.0, 32.0, 32.0]]


def test_original_size_is_the_file_size_even_when_jpeg_decodes_smaller(tmp_path):
    """JPEGs are decoded at a reduced DCT scale (draft); SDXL's original size is still the file's own."""
    path = tmp_path / "big.jpg"
    Image.new("RGB", (512, 256), (10, 200, 10)).save(path, quality=90)
    data = DataSpec(path=str(tmp_path), resolution=32, num_workers=0)
    dataset = ImageCaptionDataset(data, [_record(path)], seed=0)
    sample = dataset[0]
    assert decoded_size(_record(path), 32, 32) == (64, 32) == dataset.load_image(_record(path)).size  # 1/8 scale
    assert sample["original_size"].tolist() == [256, 512]
    assert sample["crop_top_left"].tolist() == [0, 16]  # 64x32 after resize; centre of 32 free pixels (+1)
    batch = collate([sample, sample])
    assert batch["original_size"].shape == (2, 2) and batch["crop_top_left"].dtype == torch.long


# ------------------------------------------------------------------------------------------- the model


def test_builtin_is_sdxl_shaped_and_tiny(built):
    assert type(built) is Sdxl and built.card is SDXL_CARD
    assert built.trainable.config.addition_embed_type == "text_time"
    assert sum(p.numel() for p in built.trainable.parameters()) < 500_000
    assert built.prediction_type == "epsilon"  # SDXL base's own schedule
    sd_vae = tiny.ensure_builtin_model("tiny-sd", CACHE_DIR) / "vae"
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):  # tiny-sd's trained VAE, byte for byte
        assert (built.folder / "vae" / name).read_bytes() == (sd_vae / name).read_bytes()


def test_encode_and_loss_shapes_and_gradients(built):
    encoded = built.encode_batch(_batch(torch.rand(2, 3, 32, 32) * 2 - 1))
    assert encoded["latent_mean"].shape == (2, 4, 16, 16)
    assert encoded["encoder_hidden_states"].shape == (2, 77, 32 + 48)  # both encoders' penultimate states
    assert encoded["text_embeds"].shape == (2, 48)  # text_encoder_2's projection
    assert encoded["time_ids"].tolist() == [[48, 64, 0, 6, 32, 32], [32, 32, 0, 0, 32, 32]]
    built.trainable.zero_grad(set_to_none=True)
    value = built.loss(built.trainable, encoded, seed=0, step=1)
    value.backward()
    assert torch.isfinite(value) and value.ndim == 0
    assert built.trainable.add_embedding.linear_1.weight.grad.abs().sum() > 0  # time ids + pooled reach the UNet
    assert all(p.grad is None for part in built.frozen.values() for p in part.parameters())


def test_conditioning_changes_the_prediction(built):
    """Different crops and different pooled text give different losses: the extra inputs are really used."""
    batch = _batch(torch.rand(2, 3, 32, 32) * 2 - 1)
    with torch.no_grad():
        encoded = built.encode_batch(batch)
        base = built.loss(built.trainable, encoded, 0, 1)
        moved = dict(encoded, time_ids=encoded["time_ids"] + torch.tensor([0, 0, 8, 8, 0, 0]))
        assert not torch.equal(built.loss(built.trainable, moved, 0, 1), base)
        assert torch.equal(built.loss(built.trainable, encoded, 0, 1), base)  # deterministic


def test_cached_tensors_give_the_same_encoding(built):
    """A batch from the cache (posterior + the card's text_tensors) encodes like one from pixels."""
    batch = _batch(torch.rand(2, 3, 32, 32) * 2 - 1)
    fresh = built.encode_batch(batch)
    stored = built.encode_text(batch["caption"])
    assert tuple(stored) == SDXL_CARD.text_tensors
    cached = {k: v for k, v in batch.items() if k != "pixel_values"}
    cached.update(stored, latent_mean=fresh["latent_mean"], latent_std=fresh["latent_std"])
    again = built.encode_batch(cached)
    assert all(torch.equal(fresh[k], again[k]) for k in fresh)


def test_v_prediction_override(tmp_path):
    built = build_model(SdxlModelSpec(family="sdxl", prediction="v_prediction"), CACHE_DIR, "cpu")
    assert built.prediction_type == "v_prediction" and built.noise_scheduler.config.prediction_type == "v_prediction"
    encoded = built.encode_batch(_batch(torch.rand(2, 3, 32, 32) * 2 - 1))
    assert torch.isfinite(built.loss(built.trainable, encoded, 0, 1))


def test_sample_and_export_reload_with_the_sdxl_pipeline(built, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    images = built.sample(built.trainable, ["a red circle", "a blue square"], SampleSpec(steps=2), 32)
    assert [image.size for image in images] == [(32, 32), (32, 32)] and built.trainable.training
    state = {k: v + 0.01 for k, v in built.trainable.state_dict().items()}
    out = built.export(state, tmp_path / "export")
    pipeline = StableDiffusionXLPipeline.from_pretrained(out)
    assert torch.equal(pipeline.unet.state_dict()["conv_in.weight"], state["conv_in.weight"])
    result = pipeline(
        "a red circle",
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=5.0,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    assert result.images.shape == (1, 32, 32, 3)


def test_folder_problems_are_named(tmp_path):
    folder = tmp_path / "sd-shaped"
    shutil.copytree(tiny.ensure_builtin_model("tiny-sd", CACHE_DIR), folder)
    with pytest.raises(FamilyError, match="StableDiffusionPipeline.*model.family: sd"):
        build_model(SdxlModelSpec(family="sdxl", pretrained=str(folder)), CACHE_DIR, "cpu")
    broken = tmp_path / "broken"
    shutil.copytree(tiny.ensure_builtin_model("tiny-sdxl", CACHE_DIR), broken)
    config = json.loads((broken / "unet" / "config.json").read_text())
    (broken / "unet" / "config.json").write_text(json.dumps(dict(config, cross_attention_dim=32)))
    with pytest.raises(FamilyError, match="cross_attention_dim 32 != text_encoder hidden_size \\+ text_encoder_2"):
        build_model(SdxlModelSpec(family="sdxl", pretrained=str(broken)), CACHE_DIR, "cpu")
    shutil.rmtree(broken / "tokenizer_2")
    with pytest.raises(FamilyError, match="missing subfolder tokenizer_2/"):
        build_model(SdxlModelSpec(family="sdxl", pretrained=str(broken)), CACHE_DIR, "cpu")


def test_text_cache_tensors_and_keys():
    """sdxl's text entries hold both tensors and are keyed by both encoders; sd's keys are what they always were."""
    from dstune.cache.entries import key_of, text_key

    assert SDXL_CARD.text_tensors == ("encoder_hidden_states", "text_embeds")
    assert "text_encoder_2" in SDXL_CARD.text_cache_folders
    assert SD_CARD.text_cache_folders == ("text_encoder", "tokenizer")
    sd_key = text_key("a cat", "f" * 64, "float32", SD_CARD.text_tensors)
    assert sd_key == key_of({"kind": "text", "caption": "a cat", "text_encoder": "f" * 64, "dtype": "float32"})
    assert text_key("a cat", "f" * 64, "float32", SDXL_CARD.text_tensors) != sd_key


def test_lora_trains_only_adapters_and_exports_a_file_the_sdxl_pipeline_loads(tmp_path):
    from diffusers import StableDiffusionXLPipeline

    from dstune.families.lora import LORA_WEIGHT_FILE, apply_train_mode, export_lora

    spec = SdxlModelSpec(family="sdxl", train="lora", lora={"rank": 4})
    built = build_model(spec, CACHE_DIR, "cpu")
    apply_train_mode(built, spec, seed=0)
    encoded = built.encode_batch(_batch(torch.rand(2, 3, 32, 32) * 2 - 1))
    built.loss(built.trainable, encoded, 0, 1).backward()
    trained = [name for name, p in built.trainable.named_parameters() if p.grad is not None]
    assert trained and all(".lora_" in name for name in trained)
    state = {k: v + 0.01 if ".lora_B." in k else v for k, v in built.trainable.state_dict().items()}
    out = export_lora(built, state, tmp_path / "lora", spec)
    assert (out / LORA_WEIGHT_FILE).is_file()
    pipeline = StableDiffusionXLPipeline.from_pretrained(tiny.ensure_builtin_model("tiny-sdxl", CACHE_DIR))
    pipeline.load_lora_weights(out)
    image = pipeline("a red circle", height=32, width=32, num_inference_steps=2, output_type="np").images[0]
    assert image.shape == (32, 32, 3)
