"""Qwen-Image-Edit-2509 / 2511 (its card QWEN_IMAGE_EDIT_PLUS_CARD and class QwenImageEditPlus,
dstune.models.qwen_image) on builtin:tiny-qwen-image-edit-plus's real components: several references per sample.

The reference is DiffSynth-Studio's Qwen-Image-Edit-2509 training path (github.com/modelscope/DiffSynth-Studio,
commit fed7b18f): diffsynth/diffusion/loss.py FlowMatchSFTLoss (noisy = (1 - sigma) x + sigma noise, target =
noise - x, mse of the prediction), diffsynth/pipelines/qwen_image.py model_fn_qwen_image (the target's packed tokens
then each edit image's, img_shapes [(1, h/2, w/2)] + one per edit image, timestep / 1000, the output cut to the
target's tokens) and QwenImageUnit_PromptEmbedder.encode_prompt_edit_multi (each instruction after "Picture k:
<vision tokens>" per edit image, the images resized to 384 x 384 px of area at their aspect ratio, sides multiples of
32, the template's first 64 tokens dropped). Retyped below; the transformer is diffusers' QwenImageTransformer2DModel
on both sides (DiffSynth's own DiT class has the same blocks). Two deliberate differences, both dstune options:
the draws (timestep, noise, posterior) are dstune's per-sample ones, taken by both sides; DiffSynth multiplies by its
scheduler's training_weight, which is dstune's model.loss_weighting (none here). The condition resize uses the
diffusers pipeline's filter (what QwenImageEditPlusPipeline renders with), where DiffSynth calls PIL's default.
"""

from __future__ import annotations

import math

import pytest
import torch

from dstune import builtin as tiny
from dstune.builtin.common import to_tensor
from dstune.data.synthetic import render_shape
from dstune.families import card_of
from dstune.families.flow_matching import timestep_density
from dstune.families.randomness import per_sample_randn
from dstune.models.qwen_image.card import QWEN_IMAGE_EDIT_PLUS_CARD
from dstune.models.qwen_image.model import QwenImageEditPlus, control_images, load_processor
from dstune.pretrained import build_model
from dstune.spec.models import FlowModelSpec, SampleSpec
from loaded_models import CACHE_DIR, with_settings

MODEL = "builtin:tiny-qwen-image-edit-plus"
SEED, STEP, INDICES = 3, 4, [5, 0]
SIDE = 64  # 8 px per latent: 8x8 latents, 16 target tokens, 16 per reference


@pytest.fixture(scope="module")
def built():
    return build_model(FlowModelSpec(family="flow", pretrained=MODEL), CACHE_DIR, "cpu")


def _batch(indices=INDICES, second=50) -> dict:
    """Targets are shapes; reference 1 and reference 2 are two other shapes."""
    targets = [render_shape(i, SIDE) for i in indices]
    return {
        "pixel_values": to_tensor([image for image, _ in targets]),
        "control_values": to_tensor([render_shape(i + 100, SIDE)[0] for i in indices]),
        "control_values_2": to_tensor([render_shape(i + second, SIDE)[0] for i in indices]),
        "caption": [f"put picture 2 into {caption}" for _, caption in targets],
        "index": torch.tensor(indices, dtype=torch.long),
    }


def test_builtin_is_a_qwen_image_edit_plus_pipeline_folder(built):
    from diffusers import QwenImageEditPlusPipeline

    folder = tiny.ensure_builtin_model("tiny-qwen-image-edit-plus", CACHE_DIR)
    assert card_of("flow", folder) is QWEN_IMAGE_EDIT_PLUS_CARD and type(built) is QwenImageEditPlus
    pipeline = QwenImageEditPlusPipeline.from_pretrained(folder, processor=load_processor(folder))
    assert pipeline.vae_scale_factor == 8 and not pipeline.transformer.config.zero_cond_t  # 2509's layout


def _diffsynth_text(pipeline, prompt: str, edit_image: list):
    """encode_prompt_edit_multi's lines (one prompt, as DiffSynth encodes it)."""
    template = pipeline.prompt_template_encode
    drop_idx = 64
    base_img_prompt = "".join(
        f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(len(edit_image))
    )
    txt = [template.format(base_img_prompt + prompt)]
    resized = []
    for image in edit_image:
        ratio = image.size[0] / image.size[1]
        width = math.sqrt(384 * 384 * ratio)
        height = width / ratio
        width, height = round(width / 32) * 32, round(height / 32) * 32
        resized.append(pipeline.image_processor.resize(image, height, width))  # the pipeline's filter (docstring)
    model_inputs = pipeline.processor(text=txt, images=resized, padding=True, return_tensors="pt")
    hidden_states = pipeline.text_encoder(
        input_ids=model_inputs.input_ids,
        attention_mask=model_inputs.attention_mask,
        pixel_values=model_inputs.pixel_values,
        image_grid_thw=model_inputs.image_grid_thw,
        output_hidden_states=True,
    ).hidden_states[-1]
    return hidden_states[0][model_inputs.attention_mask[0].bool()][drop_idx:]


def _diffsynth_edit_image_auto_resize(image, area: int):
    """QwenImageUnit_EditImageEmbedder.edit_image_auto_resize: the image at `area` pixels (DiffSynth: 1024 x 1024,
    data.resolution's square here) at its own aspect ratio, sides rounded to multiples of 32; the filter is the
    pipeline's Lanczos (docstring)."""
    from PIL import Image

    ratio = image.size[0] / image.size[1]
    width = math.sqrt(area * ratio)
    height = width / ratio
    return image.resize((round(width / 32) * 32, round(height / 32) * 32), Image.Resampling.LANCZOS)


def _diffsynth_loss(model, batch: dict, timesteps: torch.Tensor, seen: list, edit_images=None) -> torch.Tensor:
    """FlowMatchSFTLoss with model_fn_qwen_image, per sample (DiffSynth trains one sample per step), averaged.
    `edit_images`: each sample's edit images as DiffSynth resized them (default: the batch's reference pixels)."""
    from diffusers import QwenImageEditPlusPipeline
    from einops import rearrange

    pipeline = QwenImageEditPlusPipeline(
        scheduler=model.scheduler,
        vae=model.vae,
        transformer=model.trainable,
        **model.text_encoders,
        **model.tokenizers,
        **model.parts,
    )
    vae = model.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1)
    scale = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1)
    with torch.no_grad():
        posterior = vae.encode(batch["pixel_values"].unsqueeze(2)).latent_dist
        draw = lambda purpose: per_sample_randn(posterior.mean.shape[1:], SEED, STEP, INDICES, purpose)  # noqa: E731
        input_latents = ((posterior.mean + posterior.std * draw("vae_posterior"))[:, :, 0] - mean) * scale
        all_noise = draw("noise")[:, :, 0]
        if edit_images is None:
            edit_images = list(zip(*(control_images(batch[key]) for key in ("control_values", "control_values_2"))))
        edit_latents = [  # pipe.preprocess_image, then the VAE's mode, each sample's each edit image
            [(vae.encode(to_tensor([one])[:, :, None]).latent_dist.mode()[:, :, 0] - mean) * scale for one in images]
            for images in edit_images
        ]
    losses = []
    for i in range(len(INDICES)):
        latents_clean, noise, timestep = input_latents[i : i + 1], all_noise[i : i + 1], timesteps[i : i + 1]
        sigma = timestep / 1000
        latents = (1 - sigma) * latents_clean + sigma * noise  # scheduler.add_noise
        training_target = noise - latents_clean  # scheduler.training_target
        with torch.no_grad():
            prompt_emb = _diffsynth_text(pipeline, batch["caption"][i], list(edit_images[i])).unsqueeze(0)
        prompt_emb_mask = torch.ones(prompt_emb.shape[:2], dtype=torch.long)
        # model_fn_qwen_image
        img_shapes = [(1, latents.shape[2] // 2, latents.shape[3] // 2)]
        image = rearrange(latents, "B C (H P) (W Q) -> B (H W) (C P Q)", P=2, Q=2)
        image_seq_len = image.shape[1]
        edits = edit_latents[i]
        img_shapes += [(e.shape[0], e.shape[2] // 2, e.shape[3] // 2) for e in edits]
        edit_image = [rearrange(e, "B C (H P) (W Q) -> B (H W) (C P Q)", P=2, Q=2) for e in edits]
        image = torch.cat([image] + edit_image, dim=1)
        seen.append({"img_shapes": [img_shapes], "timestep": timestep / 1000, "hidden_states": image})
        with torch.no_grad():
            out = model.trainable(
                hidden_states=image,
                encoder_hidden_states=prompt_emb,
                encoder_hidden_states_mask=prompt_emb_mask,
                timestep=timestep / 1000,
                img_shapes=[img_shapes],
                return_dict=False,
            )[0]
        out = out[:, :image_seq_len]
        noise_pred = rearrange(out, "B (H W) (C P Q) -> B C (H P) (W Q)", H=SIDE // 16, W=SIDE // 16, P=2, Q=2)
        losses.append(torch.nn.functional.mse_loss(noise_pred.float(), training_target.float()))
    return torch.stack(losses).mean()


def test_loss_and_denoiser_inputs_equal_diffsynth_studios_edit_2509_training(built):
    model = with_settings(built, timestep_sampling="uniform")
    batch = _batch()
    seen_ours = []

    def forward(**kwargs):
        seen_ours.append(kwargs)
        return model.trainable(**kwargs)

    encoded = model.encode_batch(batch)
    u = timestep_density(model.model_spec, SEED, STEP, INDICES)
    with torch.no_grad():
        ours = model.loss(forward, encoded, SEED, STEP)
    timesteps = seen_ours[0]["timestep"] * 1000
    assert torch.allclose(timesteps, model.scheduler.timesteps[(u * 1000).long()], atol=1e-3)
    seen_reference = []
    reference = _diffsynth_loss(model, batch, timesteps, seen_reference)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    ours_inputs = seen_ours[0]
    for i, theirs in enumerate(seen_reference):  # the denoiser's inputs: positions, timestep, the token sequence
        assert ours_inputs["img_shapes"][i] == theirs["img_shapes"][0] == [(1, 4, 4), (1, 4, 4), (1, 4, 4)]
        assert torch.allclose(ours_inputs["timestep"][i : i + 1], theirs["timestep"])
        assert torch.allclose(ours_inputs["hidden_states"][i : i + 1], theirs["hidden_states"], atol=1e-6)


# References whose shapes differ from their target's (64 x 64): 96 x 48 trains at 96 x 32, 40 x 72 at 32 x 96
# (the target's area at their own aspect ratio, sides multiples of 32), 6 x 2 and 2 x 6 tokens.
REFERENCE_FILES = {"wide": (96, 48), "tall": (40, 72)}


def _own_size_dataset(tmp_path, **data):
    """Targets a.png, b.png (64 px shapes) with a wide and a tall reference each, through the dataset as training
    reads them (data.reference_size left out: the model's own)."""
    from dstune.data.images import ImageCaptionDataset
    from dstune.data.index import index_dataset
    from dstune.model_defaults import with_model_defaults
    from dstune.spec.models import Spec

    for name, number in (("a", 5), ("b", 0)):
        (tmp_path / "target").mkdir(exist_ok=True)
        image, caption = render_shape(number, SIDE)
        image.save(tmp_path / "target" / f"{name}.png")
        (tmp_path / "target" / f"{name}.txt").write_text(f"put picture 2 into {caption}")
        for folder, size in REFERENCE_FILES.items():
            (tmp_path / folder).mkdir(exist_ok=True)
            render_shape(number + 100 + size[0], 128)[0].resize(size).save(tmp_path / folder / f"{name}.png")
    spec = Spec.model_validate(
        {
            "model": {"family": "flow", "pretrained": MODEL},
            "data": {
                "path": str(tmp_path / "target"),
                "resolution": SIDE,
                "control_dir": ["../wide", "../tall"],
                **data,
            },
            "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "epochs": 1},
        }
    )
    spec = with_model_defaults(spec)[0]
    return spec, ImageCaptionDataset(spec.data, index_dataset(spec.data).records, SEED)


def test_references_keep_their_own_sizes_and_train_as_diffsynth_studio_trains_them(built, tmp_path):
    """Each reference at its own size (QwenImageEditPlusPipeline's and DiffSynth's edit_image_auto_resize, at
    data.resolution's area): the loss and the denoiser's inputs (each picture's own token grid in img_shapes) equal
    DiffSynth's lines on the files. Sized with the target (the old rule), img_shapes would read (1, 4, 4) thrice."""
    from PIL import Image

    from dstune.data.images import collate

    spec, dataset = _own_size_dataset(tmp_path)
    assert spec.data.reference_size == "own"
    batch = {**collate([dataset[0], dataset[1]]), "index": torch.tensor(INDICES, dtype=torch.long)}
    assert batch["control_values"].shape[-2:] == (32, 96) and batch["control_values_2"].shape[-2:] == (96, 32)
    model = with_settings(built, timestep_sampling="uniform")
    seen_ours = []

    def forward(**kwargs):
        seen_ours.append(kwargs)
        return model.trainable(**kwargs)

    with torch.no_grad():
        ours = model.loss(forward, model.encode_batch(batch), SEED, STEP)
    edits = [
        [
            _diffsynth_edit_image_auto_resize(Image.open(tmp_path / folder / name).convert("RGB"), SIDE**2)
            for folder in REFERENCE_FILES
        ]
        for name in batch["sample_id"]
    ]
    seen_reference = []
    reference = _diffsynth_loss(model, batch, seen_ours[0]["timestep"] * 1000, seen_reference, edits)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    for i, theirs in enumerate(seen_reference):
        assert seen_ours[0]["img_shapes"][i] == theirs["img_shapes"][0] == [(1, 4, 4), (1, 2, 6), (1, 6, 2)]
        assert torch.allclose(seen_ours[0]["hidden_states"][i : i + 1], theirs["hidden_states"], atol=1e-6)


def test_references_of_different_sizes_in_one_micro_batch_are_refused_at_validate(tmp_path):
    """A micro batch stacks each reference: own sizes that differ within a bucket are named at validate (and by the
    collate, should a run get there); at micro batch 1, or sized with the target, they train."""
    from dstune.data.buckets import reference_size_problem
    from dstune.data.images import collate
    from dstune.data.index import index_dataset

    spec, dataset = _own_size_dataset(tmp_path)
    render_shape(9, 128)[0].resize((48, 96)).save(tmp_path / "wide" / "b.png")  # b's first reference: tall now
    records = index_dataset(spec.data).records
    problem = reference_size_problem(records, spec.data, 2)
    assert "reference 1 of a.png trains at 96x32, of b.png at 32x96" in problem and "micro_batch_size: 1" in problem
    assert reference_size_problem(records, spec.data, 1) is None
    target = spec.data.model_copy(update={"reference_size": "target"})
    assert reference_size_problem(records, target, 2) is None
    with pytest.raises(ValueError, match="control_values: the references of one micro batch have different sizes"):
        collate([dataset[0], dataset[1]])


def test_each_reference_conditions_the_loss_and_cached_reference_latents_train_alike(built):
    batch = _batch([4, 7])
    encoded = built.encode_batch(batch)
    other_second = {**batch, "control_values_2": _batch([4, 7], second=150)["control_values_2"]}
    cached = {
        **batch,
        "control_latent_mean": encoded["control_latent"],
        "control_latent_mean_2": encoded["control_latent_2"],
    }
    with torch.no_grad():
        losses = [
            built.loss(built.trainable, built.encode_batch(b), 0, 1).item() for b in (batch, other_second, cached)
        ]
    assert losses[0] != losses[1] and losses[2] == losses[0]


def test_samples_render_from_the_references_and_each_one_changes_the_output(built, tmp_path):
    paths = []
    for number in (3, 4, 60):
        paths.append(str(tmp_path / f"{number}.png"))
        render_shape(number, SIDE)[0].save(paths[-1])
    rendered = []
    for second in (paths[1], paths[2]):  # one prompt, seed and first reference; another second reference
        spec = SampleSpec(prompts=["x"], control_images=[[paths[0], second]], steps=1, guidance=1.0, seed=1)
        rendered.append(built.sample(built.trainable, spec.prompts, spec, SIDE)[0])
    assert [image.size for image in rendered] == [(SIDE, SIDE)] * 2
    assert rendered[0].tobytes() != rendered[1].tobytes()  # the second reference changes the output


@pytest.mark.parametrize("model", ["Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511"])
def test_validate_plans_each_reference_as_a_picture_and_its_vision_tokens(model, tmp_path, capsys):
    """A folder refused before validates; at real size (configs stored with dstune) two references per sample hold
    more latent tokens, cache more latents and split more tokens over the ranks than one."""
    import re

    import yaml

    from dstune.cli import main

    found = {}
    for folders in (["../person"], ["../person", "../scene"]):
        spec = {
            "model": {"family": "flow", "pretrained": model, "train": "lora", "gradient_checkpointing": True},
            "data": {"path": "/data/not-here", "resolution": 1024, "control_dir": folders, "cache": {"latents": True}},
            "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "epochs": 1, "precision": "bf16"},
            "deepspeed": {"zero_stage": 3},
        }
        path = tmp_path / f"{len(folders)}.yaml"
        path.write_text(yaml.safe_dump(spec))
        assert main(["validate", str(path), "--num-gpus", "8", "--num-samples", "1000"]) == 0
        out = capsys.readouterr().out
        found[len(folders)] = {
            key: float(re.search(rf"{key}\s+([\d.]+) GB", out).group(1)) for key in ("activations", "cache on disk")
        }
    assert found[2]["cache on disk"] == pytest.approx(1.5 * found[1]["cache on disk"], rel=0.02)  # 3 latents vs 2
    assert found[2]["activations"] > 1.2 * found[1]["activations"]


def test_references_at_their_own_sizes_are_cached_at_them_and_train_as_read(built, tmp_path):
    """The real start-up (validate, cache build, loader) on the own-size dataset: each reference's latents are cached
    at its own size (96 x 32 px -> 12 x 4 latents, 32 x 96 -> 4 x 12) and the cached batch's loss is the loss of the
    same samples read from the files."""
    import yaml

    from dstune.data.images import collate
    from loaded_models import start_up

    spec, dataset = _own_size_dataset(tmp_path)
    written = spec.model_dump(mode="json", exclude_unset=True)
    written["data"].update(center_crop=True, cache={"latents": True, "dir": str(tmp_path / "cache")})
    written["output"] = {"dir": str(tmp_path / "out"), "cache_dir": str(CACHE_DIR)}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(written))
    model, caches, loader = start_up(path)
    batch = next(iter(loader))
    assert batch["control_latent_mean"].shape[-2:] == (4, 12) and batch["control_latent_mean_2"].shape[-2:] == (12, 4)
    read = collate([dataset[int(i)] for i in batch["index"]])
    with torch.no_grad():
        losses = [model.loss(model.trainable, model.encode_batch(b), SEED, STEP).item() for b in (batch, read)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_the_sequence_split_counts_each_reference_at_its_own_size_and_the_plan_at_its_bound(tmp_path):
    """The sequence-parallel checks count each sample's pictures at their own sizes (16 + 12 + 12 tokens, not 3 x
    16); the memory plan, which has no files, counts each own-size reference at the most pixels the rule gives at
    data.resolution (aspect ratios up to 4:1: 1.5 x 64 x 64 px at 64 px, 1.03 x at 1024)."""
    from dstune.data.buckets import own_size_pictures
    from dstune.data.index import index_dataset
    from dstune.spec.reference_sizes import own_area_bound
    from dstune.families.denoiser_facts import pipeline_folder
    from dstune.sequence_parallel import bucket_tokens

    spec, _ = _own_size_dataset(tmp_path)
    pictures = own_size_pictures(index_dataset(spec.data).records, spec.data)
    assert pictures == [((64, 64), (96, 32), (32, 96))]
    assert bucket_tokens(spec, None, None, pictures) == {"64x64 + 96x32 + 32x96": 40}
    target = spec.model_copy(update={"data": spec.data.model_copy(update={"reference_size": "target"})})
    assert bucket_tokens(target, None, None, None) == {"64x64 (target and source)": 48}
    assert own_area_bound(64) == 1.5 * 64**2 and own_area_bound(1024) < 1.04 * 1024**2
    folder = pipeline_folder(MODEL)
    areas = [QWEN_IMAGE_EDIT_PLUS_CARD.picture_areas(one, folder) for one in (spec, target)]
    assert areas == [1 + 2 * 1.5, 3]
